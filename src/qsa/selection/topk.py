"""Exact per-row top-k of block scores and its expansion to token indices (``@triton.jit`` only).

Scores are compared through :func:`score_key`, an order-preserving map from fp32 to uint32, so every
comparison below is an unsigned integer comparison. One program handles one row: it finds the key
``T`` of the k-th best candidate and how many candidates equal to ``T`` to keep (``need``), then emits
the kept blocks in ascending index order through a prefix sum. ``docs/selection.md`` has the
derivation and the exactness argument.
"""

import triton
import triton.language as tl

SIGN_BIT = tl.constexpr(0x80000000)
INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def score_key(x):
    """fp32 -> uint32 with ``key(a) > key(b)`` iff ``a > b``; -0.0 and +0.0 share a key, every NaN
    maps to 1 (below -inf, whose key is 0x007FFFFF). Key 0 is left free for "not a candidate"."""
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.uint32, bitcast=True)
    key = tl.where(u >= SIGN_BIT, u ^ 0xFFFFFFFF, u | SIGN_BIT)
    return tl.where(x != x, tl.full(key.shape, 1, tl.uint32), key)


@triton.jit
def _load_keys(src_ptr, offs, lim, FROM_SCORES: tl.constexpr):
    """Keys of one row at ``offs``; 0 (not a candidate) at and past ``lim``."""
    m = offs < lim
    if FROM_SCORES:
        key = tl.where(m, score_key(tl.load(src_ptr + offs, mask=m, other=0.0).to(tl.float32)), 0)
    else:
        key = tl.load(src_ptr + offs, mask=m, other=0).to(tl.uint32, bitcast=True)
    return key


@triton.jit
def _threshold_in_tile(key, need):
    """Search for the largest t with #{key >= t} >= need (need >= 1, at least ``need`` nonzero keys
    in a tile of at most 65535, so t >= 1 and key 0 never qualifies), two bits per step from the top.

    A step counts the keys >= t | d << s for the digits d = 1, 2, 3 in one block-wide reduction
    (counts 1 and 3 share an int32, 16 bits each) and keeps the largest digit whose count reaches
    ``need``; digits above the largest key are skipped without counting. The search stops early when
    some candidate c has exactly ``need`` keys >= c: then t = c - 1, since keeping the keys > c - 1
    keeps exactly ``need``. Returns (t, need - #{key > t}).
    """
    top = tl.max(key, axis=0)
    t = tl.full((), 0, tl.uint32)
    lo = tl.full((), SIGN_BIT >> 1, tl.uint32)
    exact = tl.full((), 0, tl.int32)
    while (lo != 0) & (exact == 0):
        c1 = t | lo
        if c1 <= top:
            c2 = t | (lo << 1)
            c3 = c1 | c2
            packed = (key >= c1).to(tl.int32) + ((key >= c3).to(tl.int32) << 16)
            n13, n2 = tl.split(tl.sum(tl.join(packed, (key >= c2).to(tl.int32)), axis=0))
            n1 = n13 & 0xFFFF
            n3 = n13 >> 16
            # counts fall with the digit: take the largest digit that still has >= need keys
            c = tl.where(n3 >= need, c3, tl.where(n2 >= need, c2, tl.where(n1 >= need, c1, t)))
            n = tl.where(n3 >= need, n3, tl.where(n2 >= need, n2, n1))
            exact = ((n == need) & (c != t)).to(tl.int32)
            t = c
        lo = lo >> 2
    if exact != 0:
        t = t - 1
    return t, need - tl.sum((key > t).to(tl.int32), axis=0)


@triton.jit
def _threshold_chunked(src_ptr, lim, need, FROM_SCORES: tl.constexpr, BLOCK_N: tl.constexpr,
                       RADIX_BITS: tl.constexpr):
    """Radix select over a row read in chunks: the key t of the need-th largest nonzero key, and how
    many keys equal to t are among the ``need`` largest, and how many keys equal t. One histogram
    pass per RADIX_BITS-bit digit."""
    NUM_BINS: tl.constexpr = 1 << RADIX_BITS
    o_bin = tl.arange(0, NUM_BINS)
    o_n = tl.arange(0, BLOCK_N)
    t = tl.full((), 0, tl.uint32)
    for p in tl.static_range(32 // RADIX_BITS):
        shift = 32 - (p + 1) * RADIX_BITS
        hist = tl.zeros([NUM_BINS], dtype=tl.int32)
        for n0 in range(0, lim, BLOCK_N):
            key = _load_keys(src_ptr, n0 + o_n, lim, FROM_SCORES)
            digit = ((key >> shift) & (NUM_BINS - 1)).to(tl.int32)
            m_match = key > 0
            if p > 0:
                m_match = m_match & ((key >> (shift + RADIX_BITS)) == (t >> (shift + RADIX_BITS)))
            hist += tl.histogram(digit, NUM_BINS, mask=m_match)
        # ge[d]: matching keys whose digit is >= d (non-increasing in d, ge[0] >= need).
        ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        d = tl.max(tl.where(ge >= need, o_bin, 0), axis=0)
        need = need - tl.sum(tl.where(o_bin > d, hist, 0), axis=0)
        n_eq = tl.sum(tl.where(o_bin == d, hist, 0), axis=0)
        t = t | (d.to(tl.uint32) << shift)
    return t, need, n_eq


@triton.jit
def _emit(out_row_ptr, key, o_blk, t, need, n_eq, n_out, EMIT_TOKENS: tl.constexpr):
    """Keep keys > t, and keys == t while fewer than ``need`` of them were kept (``n_eq`` keys == t
    came before this tile; with need == 0 no prefix count is needed); write the kept ones to slots
    n_out, n_out + 1, ... in the order of ``o_blk`` (ascending). Returns the updated (n_eq, n_out)."""
    if need == 0:
        sel = (key > t).to(tl.int32)
    else:
        is_eq = (key == t).to(tl.int32)
        rank_eq = n_eq + tl.cumsum(is_eq, axis=0) - is_eq
        sel = ((key > t) | ((is_eq != 0) & (rank_eq < need))).to(tl.int32)
        n_eq += tl.sum(is_eq, axis=0)
    slot = n_out + tl.cumsum(sel, axis=0) - sel
    if EMIT_TOKENS:
        for i_t in tl.static_range(4):
            tl.store(out_row_ptr + (4 * slot + i_t), 4 * o_blk + i_t, mask=sel != 0)
    else:
        tl.store(out_row_ptr + slot, o_blk, mask=sel != 0)
    return n_eq, n_out + tl.sum(sel, axis=0)


@triton.jit
def topk_kernel(
    src_ptr,    # [rows, n_cols] fp32/fp16/bf16 scores (FROM_SCORES) or int32 keys (score_key bits)
    vis_ptr,    # [rows] int32/int64 visible blocks (block mode only)
    req_ptr,    # [rows] int32/int64 request of each row (token mode only)
    pos_ptr,    # [rows] int32/int64 position of each row (token mode only)
    seq_ptr,    # [num_reqs] int32/int64 sequence lengths (token mode only)
    out_ptr,    # [rows, k] int32 blocks, or [rows, 4k + 3] int32 tokens (EMIT_TOKENS)
    n_cols, num_reqs, k,
    stride_src, stride_out,
    FROM_SCORES: tl.constexpr,
    EMIT_TOKENS: tl.constexpr,
    SINGLE_TILE: tl.constexpr,   # the whole row fits one BLOCK_N tile held in registers
    BLOCK_N: tl.constexpr,      # search tile (the whole row when SINGLE_TILE, else a chunk)
    RADIX_BITS: tl.constexpr,   # digit width of the chunked radix select
    EMIT_BLOCK: tl.constexpr,   # blocks per emission chunk
    OUT_BLOCK: tl.constexpr,    # output entries per padding chunk
):
    i_r = tl.program_id(0).to(tl.int64)
    src_row = src_ptr + i_r * stride_src
    out_row = out_ptr + i_r * stride_out

    if EMIT_TOKENS:
        req = tl.load(req_ptr + i_r).to(tl.int64)
        pos = tl.minimum(tl.load(pos_ptr + i_r).to(tl.int64), INT32_MAX)  # no overflow of pos + 1
        ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
        seq = tl.load(seq_ptr + tl.where(ok, req, 0), mask=ok, other=0).to(tl.int64)  # none when num_reqs == 0
        lim = tl.minimum((pos + 1) // 4, seq // 4)
        tail_start = ((pos + 1) // 4) * 4
        tail_len = tl.where(ok, pos + 1 - tail_start, 0)
        width = 4 * k + 3
    else:
        lim = tl.load(vis_ptr + i_r).to(tl.int64)
        tail_start = lim * 0
        tail_len = lim * 0
        seq = lim * 0
        width = k
    lim = tl.maximum(tl.minimum(lim, n_cols), 0).to(tl.int32)

    zero = tl.full((), 0, tl.int32)
    t = tl.full((), 0, tl.uint32)
    need = zero
    if SINGLE_TILE:
        b_key = _load_keys(src_row, tl.arange(0, BLOCK_N), lim, FROM_SCORES)
        n_cand = tl.sum((b_key > 0).to(tl.int32), axis=0)
        if n_cand > k:
            t, need = _threshold_in_tile(b_key, k)
            if need == tl.sum((b_key == t).to(tl.int32), axis=0):
                t = t - 1           # every key == t is kept: keys > t - 1 is the same set
                need = zero
    else:
        n_cand = zero
        for n0 in range(0, lim, BLOCK_N):
            b_key = _load_keys(src_row, n0 + tl.arange(0, BLOCK_N), lim, FROM_SCORES)
            n_cand += tl.sum((b_key > 0).to(tl.int32), axis=0)
        if n_cand > k:
            t, need, n_eq_t = _threshold_chunked(src_row, lim, k, FROM_SCORES, BLOCK_N, RADIX_BITS)
            if need == n_eq_t:
                t = t - 1
                need = zero

    # Emit in ascending block order, a chunk at a time (the row is hot in L1/L2 by now).
    o_e = tl.arange(0, EMIT_BLOCK)
    n_eq = zero
    n_out = zero
    for n0 in range(0, lim, EMIT_BLOCK):
        e_key = _load_keys(src_row, n0 + o_e, lim, FROM_SCORES)
        n_eq, n_out = _emit(out_row, e_key, n0 + o_e, t, need, n_eq, n_out, EMIT_TOKENS)

    # Past the kept blocks: the causal tail (token mode), then -1.
    if EMIT_TOKENS:
        filled = 4 * n_out
    else:
        filled = n_out
    o_w = tl.arange(0, OUT_BLOCK)
    for j0 in range((filled // OUT_BLOCK) * OUT_BLOCK, width, OUT_BLOCK):
        j = j0 + o_w
        i_t = (j - filled).to(tl.int64)
        tok = tail_start + i_t
        tok = tl.where((i_t < tail_len) & (tok < seq), tok, -1)
        tl.store(out_row + j, tok.to(tl.int32), mask=(j >= filled) & (j < width))
