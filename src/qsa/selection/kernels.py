"""Indexer kernels (``@triton.jit`` only): block scores through the paged compressed-key cache, the
clearing of blocks whose table entry is invalid, and the store of freshly completed compressed keys.
Launchers live in ``qsa/selection/api.py``."""

import triton
import triton.language as tl

from ..attention.kernels import norm_rope_head, round_to
from .topk import INT32_MAX, score_key

BIG_REQ = tl.constexpr(2**31 - 1)


@triton.jit
def block_scores_kernel(
    q_ptr,      # [rows, H, D] index queries (last dim contiguous)
    kc_ptr,     # [num_blocks, block_size // 4, D] compressed keys (last dim contiguous)
    bt_ptr,     # [num_reqs, max_blocks] int32 block table
    req_ptr,    # [rows] int32/int64 request of each row
    pos_ptr,    # [rows] int32/int64 position of each row
    seq_ptr,    # [num_reqs] int32/int64 sequence lengths
    out_ptr,    # [rows, n_cols] int32 score keys (WRITE_KEYS) or fp32 scores
    rows, num_reqs, num_blocks, n_cols, n_per_prog, scale,
    stride_qr, stride_qh, stride_kb, stride_kr, stride_bt, stride_out,
    ROWS_PER_PAGE: tl.constexpr,  # block_size // 4
    H: tl.constexpr,
    H_PAD: tl.constexpr,      # next power of two >= H
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_KEYS: tl.constexpr,   # int32 score_key bits (no candidate mask); else fp32, -inf off-candidates
    DOT_FP32: tl.constexpr,     # upcast dot operands (bf16 under the interpreter, triton#11584)
):
    """Program (i_r, i_g): rows [i_r * BLOCK_R, +BLOCK_R) x blocks [i_g * n_per_prog, +n_per_prog),
    ``n_per_prog`` a multiple of BLOCK_N.

    Rows of the tile are served one request at a time (a tile of one request is one pass): one
    tensor-core dot per key tile covers all BLOCK_R rows x H heads, so a compressed-key tile is loaded
    once per row tile. Blocks past the largest visible count of the request's rows are neither loaded
    nor (in key mode) written. Tile rows of other requests compute values that are never stored.
    """
    i_r = tl.program_id(0)
    i_g = tl.program_id(1)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < rows
    o_r64 = o_r.to(tl.int64)
    o_d = tl.arange(0, D)
    o_n = tl.arange(0, BLOCK_N)

    req = tl.load(req_ptr + o_r, mask=m_r, other=-1).to(tl.int64)  # checked before it is narrowed to int32
    # Positions past INT32_MAX see what INT32_MAX sees (every int32 token), with no overflow of pos + 1.
    pos = tl.minimum(tl.load(pos_ptr + o_r, mask=m_r, other=-1).to(tl.int64), INT32_MAX)
    m_ok = m_r & (req >= 0) & (req < num_reqs) & (pos >= 0)
    req = tl.where(m_ok, req, -1).to(tl.int32)
    seq = tl.load(seq_ptr + tl.where(m_ok, req, 0), mask=m_ok, other=0).to(tl.int64)
    vis = tl.minimum((pos + 1) // 4, seq // 4)
    vis = tl.where(m_ok, tl.maximum(tl.minimum(vis, n_cols), 0), 0).to(tl.int32)

    # Query tile: matrix row m = r * H_PAD + h (head h of tile row r), zero for padded heads.
    o_m = tl.arange(0, BLOCK_R * H_PAD)
    o_mr = i_r * BLOCK_R + o_m // H_PAD
    o_mh = o_m % H_PAD
    p_q = q_ptr + o_mr.to(tl.int64)[:, None] * stride_qr + o_mh[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=((o_mr < rows) & (o_mh < H))[:, None], other=0.0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)

    n_lo = i_g * n_per_prog
    n_hi = tl.minimum(n_lo + n_per_prog, n_cols)
    req_todo = tl.where(vis > n_lo, req, BIG_REQ)
    cur = tl.min(req_todo, axis=0)
    while cur < BIG_REQ:
        m_cur = req_todo == cur
        n_stop = tl.minimum(tl.max(tl.where(m_cur, vis, 0), axis=0), n_hi)
        for n0 in range(n_lo, n_stop, BLOCK_N):
            o_b = n0 + o_n
            m_b = o_b < n_stop
            page = tl.load(bt_ptr + cur.to(tl.int64) * stride_bt + o_b // ROWS_PER_PAGE, mask=m_b, other=-1)
            m_kc = m_b & (page >= 0) & (page < num_blocks)
            p_kc = kc_ptr + page.to(tl.int64)[:, None] * stride_kb + ((o_b % ROWS_PER_PAGE) * stride_kr)[:, None]
            b_kc = tl.load(p_kc + o_d[None, :], mask=m_kc[:, None], other=0.0)
            if DOT_FP32:
                b_kc = b_kc.to(tl.float32)
            s = tl.dot(b_q, tl.trans(b_kc), input_precision="ieee")         # [BLOCK_R * H_PAD, BLOCK_N]
            if H < H_PAD:
                # A zero padding head still meets the keys in the dot (0 * inf = NaN): drop its row.
                s = tl.where((o_mh < H)[:, None], s, 0.0)
            s = tl.where(s < 0.0, 0.0, s)                                    # relu that keeps NaN
            score = tl.sum(tl.reshape(s, [BLOCK_R, H_PAD, BLOCK_N]), axis=1) * scale
            p_out = out_ptr + o_r64[:, None] * stride_out + o_b[None, :]
            if WRITE_KEYS:
                # No per-block mask here: entries past a row's visible count are never read, and
                # invalid table entries are cleared afterwards by clear_invalid_pages_kernel.
                tl.store(p_out, score_key(score).to(tl.int32, bitcast=True),
                         mask=m_cur[:, None] & (o_b < n_cols)[None, :])
            else:
                m_out = m_cur[:, None] & (o_b[None, :] < vis[:, None])
                tl.store(p_out, tl.where(m_kc[None, :], score, float("-inf")), mask=m_out)
        cur = tl.min(tl.where(req_todo > cur, req_todo, BIG_REQ), axis=0)

    if not WRITE_KEYS:
        for n0 in range(n_lo, n_hi, BLOCK_N):
            o_b = n0 + o_n
            p_out = out_ptr + o_r64[:, None] * stride_out + o_b[None, :]
            m_out = m_r[:, None] & (o_b[None, :] >= vis[:, None]) & (o_b[None, :] < n_hi)
            tl.store(p_out, tl.full([BLOCK_R, BLOCK_N], float("-inf"), tl.float32), mask=m_out)


@triton.jit
def clear_invalid_pages_kernel(
    keys_ptr,   # [rows, n_cols] int32 score keys (written: 0 where the page is invalid)
    req_ptr,    # [rows] int32/int64 request of each row
    bt_ptr,     # [num_reqs, max_blocks] int32 block table
    rows, num_reqs, num_blocks, max_blocks, n_cols,
    stride_keys, stride_bt,
    ROWS_PER_PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program (i_r, i_p): rows [i_r * BLOCK_R, +BLOCK_R) x table entries [i_p * BLOCK_P, +BLOCK_P).
    Sets key 0 (not a candidate) on the ROWS_PER_PAGE blocks of every invalid entry; a program whose
    entries are all valid (the usual case) only reads the table."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    req = tl.load(req_ptr + o_r, mask=o_r < rows, other=-1).to(tl.int64)
    m_ok = (o_r < rows) & (req >= 0) & (req < num_reqs)
    m_rp = m_ok[:, None] & (o_p < max_blocks)[None, :]
    page = tl.load(bt_ptr + tl.where(m_ok, req, 0)[:, None] * stride_bt + o_p[None, :], mask=m_rp, other=0)
    m_bad = m_rp & ((page < 0) | (page >= num_blocks))
    if tl.max(m_bad.to(tl.int32)) > 0:
        p_keys = keys_ptr + o_r.to(tl.int64)[:, None] * stride_keys
        for j in range(ROWS_PER_PAGE):
            o_b = o_p * ROWS_PER_PAGE + j
            tl.store(p_keys + o_b[None, :], tl.zeros([BLOCK_R, BLOCK_P], tl.int32),
                     mask=m_bad & (o_b < n_cols)[None, :])


@triton.jit
def batch_row(perm_ptr, i, ORDERED: tl.constexpr):
    """The batch row of sorted row ``i``: ``perm[i]``, or ``i`` itself where the rows come sorted."""
    if ORDERED:
        return i.to(tl.int64)
    else:
        return tl.load(perm_ptr + i)


@triton.jit
def store_compressed_kernel(
    kc_new_ptr,   # [T, D] fp32 compressed key of the group each sorted row would close (mean or transformed)
    grp_ptr,      # [T, 4, D] fp32 raw keys of each token's group, positions 4*(p//4) .. p
    req_ptr,      # [T] int32/int64 request of each token
    pos_ptr,      # [T] int32/int64 position of each token
    bt_ptr,       # [num_reqs, max_blocks] int32 block table
    kc_ptr,       # [num_blocks, block_size // 4, D] compressed-key cache (written)
    part_ptr,     # [num_reqs, 3, D] fp32 raw keys of each request's open group (written)
    perm_ptr,     # [T] int64 sorted row -> batch row (read with NORM_ROPE unless ORDERED)
    w_ptr,        # [D] norm weight (NORM_ROPE)
    cos_ptr,      # [T, HALF] fp32 cos of each batch row's group start 4*(p//4) (NORM_ROPE, HALF > 0)
    sin_ptr,      # [T, HALF] fp32 sin, as cos
    T, num_reqs, num_blocks, max_blocks, rows_per_page,
    stride_kb, stride_kr, stride_bt, stride_w, stride_cos, stride_sin,
    eps,
    D: tl.constexpr,
    NORM_ROPE: tl.constexpr,  # kc_new holds the means: RMSNorm (1 + w) and RoPE them here, in fp32
    HALF: tl.constexpr,       # rotated pairs of the RoPE (0: none)
    ORDERED: tl.constexpr,    # the batch rows come sorted: sorted row t is batch row t
):
    """Token t closing a group (p % 4 == 3) stores its compressed key, rounded once to the cache dtype (with
    NORM_ROPE after the fused transform of the mean); the last token of a request in the step whose
    group stays open stores the group's raw keys so far into the partial buffer."""
    t = tl.program_id(0)
    o_d = tl.arange(0, D)
    req = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    j = pos % 4
    if ok & (j == 3):
        b = pos // 4
        i_page = b // rows_per_page
        if i_page < max_blocks:
            page = tl.load(bt_ptr + req * stride_bt + i_page).to(tl.int64)
            if (page >= 0) & (page < num_blocks):
                p_kc = kc_ptr + page * stride_kb + (b % rows_per_page) * stride_kr
                if NORM_ROPE:
                    row = batch_row(perm_ptr, t, ORDERED)
                    norm_rope_head(kc_new_ptr + t.to(tl.int64) * D, w_ptr, cos_ptr + row * stride_cos,
                                   sin_ptr + row * stride_sin, p_kc, stride_w, eps, D, HALF, D, True)
                else:
                    KC: tl.constexpr = kc_ptr.dtype.element_ty
                    val = tl.load(kc_new_ptr + t.to(tl.int64) * D + o_d)
                    tl.store(p_kc + o_d, round_to(val, KC).to(KC))
    if ok & (j != 3):
        t_next = tl.minimum(t + 1, T - 1)
        req_next = tl.load(req_ptr + t_next).to(tl.int64)
        pos_next = tl.load(pos_ptr + t_next).to(tl.int64)
        last = (t + 1 >= T) | (req_next != req) | (pos_next != pos + 1)
        if last:
            o_m = tl.arange(0, 4)
            m_m = o_m[:, None] <= j
            vals = tl.load(grp_ptr + t.to(tl.int64) * (4 * D) + o_m[:, None] * D + o_d[None, :], mask=m_m)
            tl.store(part_ptr + req * (3 * D) + o_m[:, None] * D + o_d[None, :], vals, mask=m_m)


@triton.jit
def assemble_groups_kernel(
    raw_ptr,      # [T, D] raw keys of the step (any float dtype, last dim contiguous)
    perm_ptr,     # [T] int64 sorted row -> batch row: rows ordered by (request, position), stably
    req_ptr,      # [T] int32/int64 request of each batch row
    pos_ptr,      # [T] int32/int64 position of each batch row
    part_ptr,     # [num_reqs, 3, D] fp32 raw keys of each request's open group (read)
    next_ptr,     # [num_reqs] int64 next expected position of each request (read when TRACK)
    grp_ptr,      # [T, 4, D] fp32 out: members 4*(p//4) .. p of each sorted row's group (0 past p)
    mean_ptr,     # [T, D] fp32 out: (((m0 + m1) + m2) + m3) * 0.25
    blk_ptr,      # [T] int64 out: block index p // 4 (0 for rows that store nothing)
    req_out_ptr,  # [T] int64 out: request for store_compressed_kernel (-1: the row stores nothing)
    pos_out_ptr,  # [T] int64 out: position for store_compressed_kernel (-1: the row stores nothing)
    flag_ptr,     # [T] int32 out: bit 0 the row is refused, bit 1 the row is its request's last
    T, num_reqs, stride_raw,
    D: tl.constexpr,
    TRACK: tl.constexpr,   # next_ptr is given: a member neither in the step nor held is missing
    ORDERED: tl.constexpr,  # the batch rows come sorted (perm_ptr is not read)
):
    """Program i: sorted row i. Rows of one request are adjacent and ascend by position; of several rows
    with one (request, position) the last one (in batch order) is the row, the others are ignored.

    A member ``4*(p//4) + m`` (m < p % 4) comes from this step's row of that position when there is one
    (found by scanning back over the request's rows), else from ``partial[req, m]`` when the request's open
    group holds it (TRACK: ``next_pos`` is in that group and past the member; without TRACK always), else it
    is missing and the row is refused. Closing rows (p % 4 == 3) that are not refused, and the last row of
    each request when its group stays open and it is not refused, are handed to store_compressed_kernel:
    every other row gets request and position -1 there (the store kernel's "last of its request" test then
    sees exactly one row per request)."""
    i = tl.program_id(0)
    o_d = tl.arange(0, D)
    row = batch_row(perm_ptr, i, ORDERED)
    req = tl.load(req_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    has_next = i + 1 < T
    if ORDERED:
        row_n = tl.where(has_next, i + 1, 0).to(tl.int64)
    else:
        row_n = tl.load(perm_ptr + i + 1, mask=has_next, other=0)
    req_n = tl.load(req_ptr + row_n, mask=has_next, other=-1).to(tl.int64)
    pos_n = tl.load(pos_ptr + row_n, mask=has_next, other=-1).to(tl.int64)
    same_next = has_next & (req_n == req) & (pos_n >= 0)
    active = ok & ~(same_next & (pos_n == pos))       # a later duplicate shadows this row
    final = active & ~same_next
    j = tl.where(active, pos % 4, 0)
    g0 = pos - j

    # The rows of the group's earlier members sit just before row i (duplicates in between): scan back.
    src0 = tl.full([], -1, tl.int64)
    src1 = tl.full([], -1, tl.int64)
    src2 = tl.full([], -1, tl.int64)
    s = i - 1
    go = active & (j > 0) & (s >= 0)
    while go:
        row_s = batch_row(perm_ptr, s, ORDERED)
        req_s = tl.load(req_ptr + row_s).to(tl.int64)
        pos_s = tl.load(pos_ptr + row_s).to(tl.int64)
        in_grp = (req_s == req) & (pos_s >= g0)
        m = pos_s - g0
        take = in_grp & (pos_s < pos)
        src0 = tl.where(take & (m == 0) & (src0 < 0), row_s, src0)   # first seen: the last duplicate
        src1 = tl.where(take & (m == 1) & (src1 < 0), row_s, src1)
        src2 = tl.where(take & (m == 2) & (src2 < 0), row_s, src2)
        s -= 1
        go = in_grp & (s >= 0)

    req_c = tl.where(active, req, 0)
    if TRACK:
        e = tl.load(next_ptr + req_c, mask=active, other=-1).to(tl.int64)
        held = tl.where((e >= 0) & (e - e % 4 == g0), e - g0, 0)      # members the open group holds
    else:
        held = tl.full([], 3, tl.int64)
    p_part = part_ptr + req_c * (3 * D)
    missing = j < 0                                                    # False: j >= 0
    x = tl.load(raw_ptr + row * stride_raw + o_d, mask=active, other=0.0).to(tl.float32)

    need = active & (0 < j)
    v0 = tl.load(raw_ptr + src0 * stride_raw + o_d, mask=need & (src0 >= 0), other=0.0).to(tl.float32)
    v0 = tl.where(need & (src0 < 0), tl.load(p_part + o_d, mask=need & (src0 < 0) & (0 < held), other=0.0), v0)
    missing = missing | (need & (src0 < 0) & (held <= 0))
    v0 = tl.where(j == 0, x, v0)

    need = active & (1 < j)
    v1 = tl.load(raw_ptr + src1 * stride_raw + o_d, mask=need & (src1 >= 0), other=0.0).to(tl.float32)
    v1 = tl.where(need & (src1 < 0), tl.load(p_part + D + o_d, mask=need & (src1 < 0) & (1 < held), other=0.0), v1)
    missing = missing | (need & (src1 < 0) & (held <= 1))
    v1 = tl.where(j == 1, x, v1)

    need = active & (2 < j)
    v2 = tl.load(raw_ptr + src2 * stride_raw + o_d, mask=need & (src2 >= 0), other=0.0).to(tl.float32)
    v2 = tl.where(need & (src2 < 0), tl.load(p_part + 2 * D + o_d, mask=need & (src2 < 0) & (2 < held),
                                              other=0.0), v2)
    missing = missing | (need & (src2 < 0) & (held <= 2))
    v2 = tl.where(j == 2, x, v2)

    v3 = tl.where(j == 3, x, 0.0)
    i64 = i.to(tl.int64)
    p_grp = grp_ptr + i64 * (4 * D) + o_d
    tl.store(p_grp, v0)
    tl.store(p_grp + D, v1)
    tl.store(p_grp + 2 * D, v2)
    tl.store(p_grp + 3 * D, v3)
    tl.store(mean_ptr + i64 * D + o_d, (((v0 + v1) + v2) + v3) * 0.25)

    refused = missing                                                  # never without TRACK
    store = (active & (j == 3) & ~refused) | (final & (j != 3) & ~refused)
    tl.store(blk_ptr + i, tl.where(active, pos // 4, 0))
    tl.store(req_out_ptr + i, tl.where(store, req, -1))
    tl.store(pos_out_ptr + i, tl.where(store, pos, -1))
    tl.store(flag_ptr + i, refused.to(tl.int32) + 2 * final.to(tl.int32))


@triton.jit
def finish_groups_kernel(
    perm_ptr,     # [T] int64 sorted row -> batch row
    req_ptr,      # [T] int32/int64 request of each batch row
    pos_ptr,      # [T] int32/int64 position of each batch row
    flag_ptr,     # [T] int32 flags of assemble_groups_kernel
    next_ptr,     # [num_reqs] int64 next expected position of each request (written)
    ref_ptr,      # [3] int64 refusals: count, request and position of the first one recorded (written)
    T,
    RECORD: tl.constexpr,   # ref_ptr is given
    BLOCK: tl.constexpr,
    ORDERED: tl.constexpr,  # the batch rows come sorted (perm_ptr is not read)
):
    """One program, after assemble_groups_kernel: the last row of each request sets that request's next
    expected position (p + 1, or -1 when its group stays open with a member missing), and refused rows
    are counted; the first refusal ever recorded keeps its request and position (the lowest
    (request, position) of its step)."""
    o = tl.arange(0, BLOCK)
    count = tl.zeros([], tl.int64)
    first = tl.full([], 2**31 - 1, tl.int32)
    for start in range(0, T, BLOCK):
        o_t = start + o
        m_t = o_t < T
        flag = tl.load(flag_ptr + o_t, mask=m_t, other=0)
        if ORDERED:
            row = o_t.to(tl.int64)
        else:
            row = tl.load(perm_ptr + o_t, mask=m_t, other=0)
        req = tl.load(req_ptr + row, mask=m_t, other=0).to(tl.int64)
        pos = tl.load(pos_ptr + row, mask=m_t, other=0).to(tl.int64)
        refused = (flag & 1) != 0
        final = (flag & 2) != 0
        nxt = tl.where(refused & (pos % 4 != 3), -1, pos + 1)
        tl.store(next_ptr + req, nxt, mask=m_t & final)
        count += tl.sum(refused.to(tl.int64), axis=0)
        first = tl.minimum(first, tl.min(tl.where(refused, o_t, 2**31 - 1), axis=0))
    if RECORD:
        if count > 0:
            prev = tl.load(ref_ptr)
            if prev == 0:
                row = batch_row(perm_ptr, first, ORDERED)
                tl.store(ref_ptr + 1, tl.load(req_ptr + row).to(tl.int64))
                tl.store(ref_ptr + 2, tl.load(pos_ptr + row).to(tl.int64))
            tl.store(ref_ptr, prev + count)
