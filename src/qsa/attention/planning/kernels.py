"""Page4 planner kernels: single-row microblock lists, and grouped unions by logical microblock."""

import triton
import triton.language as tl

from ... import settings
from ..kernels import INT32_MAX, enter_launch, row_setup, row_width


@triton.jit
def _or_within_run(lm_a, bits_a, lm_b, bits_b):
    # Inclusive scan over ascending logical microblocks: OR of the bits of the current run.
    return lm_b, tl.where(lm_a == lm_b, bits_a | bits_b, bits_b)


@triton.jit
def _logically_kept(b_t, pos, seq_len, max_blocks, BLOCK_SIZE: tl.constexpr):
    """docs/spec.md section 4 checks that do not need the block table: 0 <= t < seq_len, t <= pos, t's block
    inside the table."""
    return (b_t >= 0) & (b_t < seq_len) & (b_t <= pos) & (b_t // BLOCK_SIZE < max_blocks)


@triton.jit
def _kept_keys(p_idx, o_w, W, req, pos, seq_len, row_ok, bt_ptr, stride_bt_req, max_blocks, num_blocks,
               BLOCK_SIZE: tl.constexpr):
    """(token ``t`` where it is kept (docs/spec.md section 4), INT32_MAX where it is dropped; its block)."""
    b_t = tl.load(p_idx + o_w, mask=(o_w < W) & row_ok, other=-1)
    b_lb = b_t // BLOCK_SIZE
    m_keep = _logically_kept(b_t, pos, seq_len, max_blocks, BLOCK_SIZE)
    b_phys = tl.load(bt_ptr + req * stride_bt_req + b_lb, mask=m_keep, other=-1)
    m_keep = m_keep & (b_phys >= 0) & (b_phys < num_blocks)
    return tl.where(m_keep, b_t, INT32_MAX), b_phys


@triton.jit
def _last(b_x, CH: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, CH) == CH - 1, b_x, 0), 0)


@triton.jit
def _emit_sorted_chunk(
    b_key,  # [CH] ascending kept tokens, INT32_MAX (dropped) last
    b_phys,  # [CH] physical block of each kept token
    next_key,  # first key after this chunk (INT32_MAX past the row)
    prev_key,  # last key before this chunk (-1 before the row)
    carry_bits,  # OR of the bits of prev_key's run seen so far
    count,  # entries emitted before this chunk
    p_ids,  # [cap] row of the ids output
    p_masks,  # [cap] row of the masks output
    BLOCK_SIZE: tl.constexpr,
    CH: tl.constexpr,
    EMIT_TOKENS: tl.constexpr,
):
    """Emit one entry per logical unit (microblock, or token) that ends in this chunk."""
    UNIT_SHIFT: tl.constexpr = 0 if EMIT_TOKENS else 2
    o_c = tl.arange(0, CH)
    b_next = tl.gather(b_key, tl.minimum(o_c + 1, CH - 1), 0)
    b_next = tl.where(o_c == CH - 1, next_key, b_next)
    m_valid = b_key != INT32_MAX
    b_unit = b_key >> UNIT_SHIFT
    # A dropped entry's key INT32_MAX shares its microblock with tokens 2**31-4 .. 2**31-2: a unit ends
    # where the next key is dropped, whatever its unit.
    m_emit = m_valid & ((b_next == INT32_MAX) | (b_unit != (b_next >> UNIT_SHIFT)))
    b_slot = count + tl.cumsum(m_emit.to(tl.int32), 0) - 1
    if EMIT_TOKENS:
        tl.store(p_ids + b_slot, b_key, mask=m_emit)
        new_carry = carry_bits
    else:
        b_bits = tl.where(m_valid, 1 << (b_key & 3), 0)
        _, b_run = tl.associative_scan((b_unit, b_bits), 0, _or_within_run)
        # The first run may have started in the previous chunk.
        b_run = tl.where(b_unit == (prev_key >> UNIT_SHIFT), b_run | carry_bits, b_run)
        b_id = b_phys * (BLOCK_SIZE // 4) + (b_key % BLOCK_SIZE) // 4
        tl.store(p_ids + b_slot, b_id, mask=m_emit)
        tl.store(p_masks + b_slot, b_run.to(tl.uint8), mask=m_emit)
        new_carry = _last(b_run, CH)
    return count + tl.sum(m_emit.to(tl.int32), 0), new_carry


@triton.jit
def _pad_row(count, first_id, p_ids, p_masks, PAD: tl.constexpr):
    """Pad the list to a whole tile with (first id, mask 0), a real used microblock."""
    o_pad = count + tl.arange(0, PAD)
    m_pad = o_pad < (count + PAD - 1) // PAD * PAD
    tl.store(p_ids + o_pad, tl.zeros([PAD], tl.int32) + first_id, mask=m_pad)
    tl.store(p_masks + o_pad, tl.zeros([PAD], tl.uint8), mask=m_pad)


@triton.jit
def _finish_row(count, p_ids, p_masks, counts_ptr, i_r, PAD: tl.constexpr, EMIT_TOKENS: tl.constexpr):
    """Store the count; pad a microblock list (its first id read back from the list)."""
    tl.store(counts_ptr + i_r, count)
    if not EMIT_TOKENS:
        tl.debug_barrier()
        first_id = tl.load(p_ids, mask=count > 0, other=0, cache_modifier=".cg")
        _pad_row(count, first_id, p_ids, p_masks, PAD)


@triton.jit
def _keep_limit(pos, seq_len, max_blocks, BLOCK_SIZE: tl.constexpr):
    """``_logically_kept`` as one bound: a token ``t`` passes its checks iff 0 <= t < limit, that is iff
    ``t < limit`` as unsigned 32-bit numbers (a negative ``t`` is 2**31 or more); ``t <= pos`` is
    ``t < pos + 1``, and for ``t >= 0`` the block check is ``t < max_blocks * BLOCK_SIZE``. A position
    past ``INT32_MAX`` keeps what ``INT32_MAX`` keeps (every int32 token), without ``pos + 1`` overflowing."""
    lim = tl.minimum(tl.minimum(tl.minimum(pos, INT32_MAX) + 1, seq_len), tl.cast(max_blocks, tl.int64) * BLOCK_SIZE)
    return tl.minimum(tl.maximum(lim, 0), INT32_MAX).to(tl.uint32)


@triton.jit
def _logical_tokens(p_idx, o_w, W, pos, seq_len, row_ok, max_blocks, BLOCK_SIZE: tl.constexpr):
    """(token at columns ``o_w``, whether it passes the checks not involving the block table);
    columns outside ``[0, W)`` read as dropped.

    The microblock rows' scan-free steps call this five times per column, so the checks are one
    unsigned compare (``_keep_limit``) rather than ``_logically_kept``'s four with a 64-bit position
    and a division (faster on decode-256; bitwise equal). The token lists' planner keeps
    ``_logically_kept``, where the bound measured slower (docs/performance.md)."""
    b_t = tl.load(p_idx + o_w, mask=(o_w >= 0) & (o_w < W) & row_ok, other=-1)
    return b_t, b_t.to(tl.uint32, bitcast=True) < _keep_limit(pos, seq_len, max_blocks, BLOCK_SIZE)


@triton.jit
def _strictly_ascending(b_t, m_log, b_prev, m_prev, o_c):
    """Whether the row is a strictly ascending run of kept tokens followed by dropped entries only:
    every kept entry after the first follows a kept, smaller one."""
    m_bad = m_log & (o_c > 0) & ~(m_prev & (b_prev < b_t))
    return tl.max(m_bad.to(tl.int32), 0) == 0


@triton.jit
def _emit_ascending(p_idx, o_w, W, b_t, m_log, b_phys, b_prev, m_prev, pos, seq_len, row_ok, max_blocks, num_blocks,
                    p_ids, p_masks, count, first_id, BLOCK_SIZE: tl.constexpr):
    """Emit the entries at columns ``o_w`` of a row whose kept tokens are a strictly ascending prefix,
    after the ``count`` already emitted, with neighbour reads instead of scans: a microblock's tokens
    are at most 4 adjacent entries, so an entry ends its microblock's run when the next entry is not a
    kept token of it, and the run's bits are those of the entry and of the up to 3 before it in the
    same microblock (read from the row, so a run may straddle two steps). A table entry covers a whole
    block, so the block-table check of one kept token holds for every token of its microblock;
    ``b_phys`` is the table entry of each kept token (-1 elsewhere). Returns the new count and the
    list's first id."""
    m_keep = m_log & (b_phys >= 0) & (b_phys < num_blocks)
    b_unit = b_t >> 2
    b_next, m_next = _logical_tokens(p_idx, o_w + 1, W, pos, seq_len, row_ok, max_blocks, BLOCK_SIZE)
    m_emit = m_keep & ~(m_next & ((b_next >> 2) == b_unit))
    b_bits = (1 << (b_t & 3)) | tl.where(m_prev & ((b_prev >> 2) == b_unit), 1 << (b_prev & 3), 0)
    for j in tl.static_range(2, 4):
        b_before, m_before = _logical_tokens(p_idx, o_w - j, W, pos, seq_len, row_ok, max_blocks, BLOCK_SIZE)
        b_bits |= tl.where(m_before & ((b_before >> 2) == b_unit), 1 << (b_before & 3), 0)
    b_id = b_phys * (BLOCK_SIZE // 4) + (b_t % BLOCK_SIZE) // 4
    b_slot = count + tl.cumsum(m_emit.to(tl.int32), 0) - 1
    tl.store(p_ids + b_slot, b_id, mask=m_emit)
    tl.store(p_masks + b_slot, b_bits.to(tl.uint8), mask=m_emit)
    first_id = tl.where(count == 0, tl.sum(tl.where(m_emit & (b_slot == 0), b_id, 0), 0), first_id)
    return count + tl.sum(m_emit.to(tl.int32), 0), first_id


@triton.jit
def _ascending_step(p_idx, o_w, W, req, pos, seq_len, row_ok, bt_ptr, stride_bt_req, max_blocks, num_blocks,
                    p_ids, p_masks, count, first_id, BLOCK_SIZE: tl.constexpr):
    """Columns ``o_w`` of a microblock row: whether they keep the row strictly ascending (checked
    against the column before each), and if so, their entries emitted (``_emit_ascending``)."""
    b_t, m_log = _logical_tokens(p_idx, o_w, W, pos, seq_len, row_ok, max_blocks, BLOCK_SIZE)
    # the table entries load with the row, before its order is known: a row in order needs them
    b_phys = tl.load(bt_ptr + req * stride_bt_req + b_t // BLOCK_SIZE, mask=m_log, other=-1)
    b_tp, m_logp = _logical_tokens(p_idx, o_w - 1, W, pos, seq_len, row_ok, max_blocks, BLOCK_SIZE)
    ordered = _strictly_ascending(b_t, m_log, b_tp, m_logp, o_w)
    if ordered:
        count, first_id = _emit_ascending(p_idx, o_w, W, b_t, m_log, b_phys, b_tp, m_logp, pos, seq_len, row_ok,
                                          max_blocks, num_blocks, p_ids, p_masks, count, first_id, BLOCK_SIZE)
    return ordered, count, first_id


@triton.jit
def _sort_and_emit(p_idx, p_keys, W, req, pos, seq_len, row_ok, bt_ptr, stride_bt_req, max_blocks, num_blocks,
                   p_ids, p_masks, counts_ptr, i_r, BLOCK_SIZE: tl.constexpr, BLOCK_W: tl.constexpr,
                   CH: tl.constexpr, PAD: tl.constexpr, EMIT_TOKENS: tl.constexpr):
    """Plan one row in any order: its kept tokens sorted into ``p_keys`` ([BLOCK_W] scratch), then
    streamed CH at a time."""
    o_w = tl.arange(0, BLOCK_W)
    o_c = tl.arange(0, CH)
    b_all, _ = _kept_keys(p_idx, o_w, W, req, pos, seq_len, row_ok, bt_ptr, stride_bt_req, max_blocks, num_blocks,
                          BLOCK_SIZE)
    tl.store(p_keys + o_w, tl.sort(b_all))
    tl.debug_barrier()
    prev_key = -1
    carry = 0
    count = 0
    for c in range(0, W, CH):
        b_key = tl.load(p_keys + c + o_c, mask=c + o_c < BLOCK_W, other=INT32_MAX)
        next_key = tl.load(p_keys + c + CH, mask=c + CH < BLOCK_W, other=INT32_MAX)
        b_phys = tl.load(bt_ptr + req * stride_bt_req + b_key // BLOCK_SIZE, mask=b_key != INT32_MAX, other=0)
        count, carry = _emit_sorted_chunk(b_key, b_phys, next_key, prev_key, carry, count, p_ids, p_masks,
                                          BLOCK_SIZE, CH, EMIT_TOKENS)
        prev_key = _last(b_key, CH)
    _finish_row(count, p_ids, p_masks, counts_ptr, i_r, PAD, EMIT_TOKENS)


@triton.jit
def single_row_plan_kernel(
    idx_ptr,  # [rows, W] int32 token indices
    bt_ptr,  # [num_reqs, max_blocks] int32 block table
    req_ptr,  # [rows] int32|int64 token_to_req
    pos_ptr,  # [rows] int32|int64 positions
    seq_lens_ptr,  # [num_reqs] int32
    ids_ptr,  # [rows, cap] int32 out: physical microblock ids (or tokens with EMIT_TOKENS)
    masks_ptr,  # [rows, cap] uint8 out: bit t % 4
    counts_ptr,  # [rows] int32 out
    unsorted_ptr,  # [rows] int32 out: rows left to single_row_sort_plan_kernel
    num_unsorted_ptr,  # [1] int32, zero on entry
    keys_ptr,  # [rows - row_start, SORT_W] int32 scratch with SORT_W
    idx_count_ptr,  # [rows] int32 index_counts with HAS_COUNTS; else None (no parameter)
    row_start,  # program i plans row row_start + i
    W,
    num_reqs,
    max_blocks,
    num_blocks,
    stride_idx_row,
    stride_bt_req,
    stride_ids_row,
    stride_masks_row,
    stride_idx_count,  # index_counts row stride with HAS_COUNTS; else None
    BLOCK_SIZE: tl.constexpr,
    CH: tl.constexpr,  # tokens per step
    PAD: tl.constexpr,
    EMIT_TOKENS: tl.constexpr,  # emit distinct kept logical tokens instead of microblocks
    ONE_CHUNK: tl.constexpr,  # CH >= W: sort a row found out of order here, in registers
    ASCENDING_STEPS: tl.constexpr = False,  # several steps, microblocks: the scan-free path of ascending rows
    SORT_W: tl.constexpr = 0,  # with ASCENDING_STEPS: a row out of order is sorted here (power of two >= W)
    HAS_COUNTS: tl.constexpr = False,  # a row reads only its first index_counts entries (row_width)
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    """One row whose kept tokens already ascend (as select_tokens emits them): one streaming pass.

    Kept tokens are read CH at a time; each logical unit is emitted where its run ends, with the OR
    of its bits. A row found out of order is handed to ``single_row_sort_plan_kernel``, unless the
    row is one chunk (``ONE_CHUNK``): then it is sorted in place and no second launch is needed. A
    microblock list of strictly ascending kept tokens (dropped entries last) is emitted by
    ``_ascending_step`` without scans: in one step, or with ``ASCENDING_STEPS`` in several, where a
    step found out of order hands the row on (the steps it already emitted are rewritten).

    The row is its first ``n_w`` entries (``row_width``: ``W``, or its count with ``HAS_COUNTS``); none
    past them is read.
    """
    enter_launch(PDL)
    i_r = tl.program_id(0).to(tl.int64) + row_start
    req, pos, seq_len, row_ok = row_setup(req_ptr, pos_ptr, seq_lens_ptr, i_r, num_reqs)
    n_w = row_width(idx_count_ptr, i_r, stride_idx_count, W, HAS_COUNTS)
    p_idx = idx_ptr + i_r * stride_idx_row
    p_ids = ids_ptr + i_r * stride_ids_row
    p_masks = masks_ptr + i_r * stride_masks_row
    o_c = tl.arange(0, CH)
    if ONE_CHUNK:
        ascending = False
        if not EMIT_TOKENS:  # token lists stay on the gather path: they measured slower on this one
            ascending, count, first_id = _ascending_step(p_idx, o_c, n_w, req, pos, seq_len, row_ok, bt_ptr,
                                                         stride_bt_req, max_blocks, num_blocks, p_ids, p_masks,
                                                         tl.zeros([], tl.int32), tl.zeros([], tl.int32), BLOCK_SIZE)
            if ascending:
                tl.store(counts_ptr + i_r, count)
                _pad_row(count, first_id, p_ids, p_masks, PAD)
        if not ascending:
            b_key, b_phys = _kept_keys(p_idx, o_c, n_w, req, pos, seq_len, row_ok, bt_ptr, stride_bt_req,
                                       max_blocks, num_blocks, BLOCK_SIZE)
            b_prev = tl.gather(b_key, tl.maximum(o_c - 1, 0), 0)
            if tl.min((b_prev <= b_key).to(tl.int32), 0) == 0:
                b_key = tl.sort(b_key)
                b_phys = tl.load(bt_ptr + req * stride_bt_req + b_key // BLOCK_SIZE, mask=b_key != INT32_MAX,
                                 other=0)
            count, _ = _emit_sorted_chunk(b_key, b_phys, INT32_MAX, -1, 0, 0, p_ids, p_masks, BLOCK_SIZE, CH,
                                          EMIT_TOKENS)
            _finish_row(count, p_ids, p_masks, counts_ptr, i_r, PAD, EMIT_TOKENS)
    elif ASCENDING_STEPS and not EMIT_TOKENS:
        count = tl.zeros([], tl.int32)
        first_id = tl.zeros([], tl.int32)
        ordered = n_w >= 0
        c = 0
        while (c < n_w) & ordered:
            ordered, count, first_id = _ascending_step(p_idx, c + o_c, n_w, req, pos, seq_len, row_ok, bt_ptr,
                                                       stride_bt_req, max_blocks, num_blocks, p_ids, p_masks, count,
                                                       first_id, BLOCK_SIZE)
            c += CH
        if ordered:
            tl.store(counts_ptr + i_r, count)
            _pad_row(count, first_id, p_ids, p_masks, PAD)
        elif SORT_W > 0:  # the entries the steps stored are rewritten after the sort's barrier
            _sort_and_emit(p_idx, keys_ptr + (i_r - row_start) * SORT_W, n_w, req, pos, seq_len, row_ok, bt_ptr,
                           stride_bt_req, max_blocks, num_blocks, p_ids, p_masks, counts_ptr, i_r, BLOCK_SIZE,
                           SORT_W, CH, PAD, EMIT_TOKENS)
        else:
            tl.store(unsorted_ptr + tl.atomic_add(num_unsorted_ptr, 1), i_r.to(tl.int32))
    else:
        b_key, b_phys = _kept_keys(p_idx, o_c, n_w, req, pos, seq_len, row_ok, bt_ptr, stride_bt_req, max_blocks,
                                   num_blocks, BLOCK_SIZE)
        prev_key = -1
        carry = 0
        count = 0
        ordered = n_w >= 0
        c = 0
        while (c < n_w) & ordered:
            b_key_next, b_phys_next = _kept_keys(p_idx, c + CH + o_c, n_w, req, pos, seq_len, row_ok, bt_ptr,
                                                 stride_bt_req, max_blocks, num_blocks, BLOCK_SIZE)
            b_prev = tl.gather(b_key, tl.maximum(o_c - 1, 0), 0)
            b_prev = tl.where(o_c == 0, prev_key, b_prev)
            ordered = tl.min((b_prev <= b_key).to(tl.int32), 0) != 0
            if ordered:
                next_key = tl.sum(tl.where(o_c == 0, b_key_next, 0), 0)
                count, carry = _emit_sorted_chunk(b_key, b_phys, next_key, prev_key, carry, count, p_ids, p_masks,
                                                  BLOCK_SIZE, CH, EMIT_TOKENS)
            prev_key = _last(b_key, CH)
            b_key = b_key_next
            b_phys = b_phys_next
            c += CH
        if ordered:
            _finish_row(count, p_ids, p_masks, counts_ptr, i_r, PAD, EMIT_TOKENS)
        else:
            tl.store(unsorted_ptr + tl.atomic_add(num_unsorted_ptr, 1), i_r.to(tl.int32))


@triton.jit
def single_row_sort_plan_kernel(
    idx_ptr,  # [rows, W] int32
    bt_ptr,  # [num_reqs, max_blocks] int32
    req_ptr,  # [rows]
    pos_ptr,  # [rows]
    seq_lens_ptr,  # [num_reqs] int32
    ids_ptr,  # [rows, cap] int32 out
    masks_ptr,  # [rows, cap] uint8 out
    counts_ptr,  # [rows] int32 out
    unsorted_ptr,  # [rows] int32 rows to do
    num_unsorted_ptr,  # [1] int32
    keys_ptr,  # [programs, BLOCK_W] int32 scratch
    idx_count_ptr,  # [rows] int32 index_counts with HAS_COUNTS; else None (no parameter)
    num_programs,
    W,
    num_reqs,
    max_blocks,
    num_blocks,
    stride_idx_row,
    stride_bt_req,
    stride_ids_row,
    stride_masks_row,
    stride_idx_count,  # index_counts row stride with HAS_COUNTS; else None
    BLOCK_SIZE: tl.constexpr,
    BLOCK_W: tl.constexpr,  # power of two >= W
    CH: tl.constexpr,
    PAD: tl.constexpr,
    EMIT_TOKENS: tl.constexpr,
    HAS_COUNTS: tl.constexpr = False,  # a row reads only its first index_counts entries (row_width)
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    """Rows whose indices are not in ascending order: sort the kept tokens, then stream as above."""
    enter_launch(PDL)
    pid = tl.program_id(0)
    p_keys = keys_ptr + pid.to(tl.int64) * BLOCK_W
    n = tl.load(num_unsorted_ptr)
    i = pid
    while i < n:
        i_r = tl.load(unsorted_ptr + i).to(tl.int64)
        req, pos, seq_len, row_ok = row_setup(req_ptr, pos_ptr, seq_lens_ptr, i_r, num_reqs)
        n_w = row_width(idx_count_ptr, i_r, stride_idx_count, W, HAS_COUNTS)
        _sort_and_emit(idx_ptr + i_r * stride_idx_row, p_keys, n_w, req, pos, seq_len, row_ok, bt_ptr, stride_bt_req,
                       max_blocks, num_blocks, ids_ptr + i_r * stride_ids_row, masks_ptr + i_r * stride_masks_row,
                       counts_ptr, i_r, BLOCK_SIZE, BLOCK_W, CH, PAD, EMIT_TOKENS)
        tl.debug_barrier()
        i += num_programs


@triton.jit
def _udiv(x, D: tl.constexpr):
    """``x // D`` for ``x >= 0`` (unsigned: a shift for powers of two, no sign fix-up)."""
    return (x.to(tl.uint32) // D).to(tl.int32)


@triton.jit
def _umod(x, D: tl.constexpr):
    """``x % D`` for ``x >= 0``."""
    return (x.to(tl.uint32) % D).to(tl.int32)


@triton.jit
def _store_i32(p, x, m, PTX: tl.constexpr):
    """``tl.store(p, x, mask=m)`` of int32 ``x``. With ``PTX`` (GPU only) as an inline store in the
    operands' own layout: Triton gives a scattered store a layout of its own and converts pointers,
    values and masks to it through shared memory, with barriers, on every scan step."""
    if PTX:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r,r", [p, x, m.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(p, x, mask=m)


@triton.jit
def _load_i32(p, m, PTX: tl.constexpr, CG: tl.constexpr = False):
    """``tl.load(p, mask=m, other=0)`` of int32, in the operands' own layout with ``PTX`` (as ``_store_i32``);
    ``CG``: through the L2 only (words that global atomics wrote)."""
    if PTX:
        if CG:
            return tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.cg.b32 $0, [$1]; }",
                "=r,l,r", [p, m.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.b32 $0, [$1]; }",
                "=r,l,r", [p, m.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    elif CG:
        return tl.load(p, mask=m, other=0, cache_modifier=".cg")
    else:
        return tl.load(p, mask=m, other=0)


@triton.jit
def _word_bits(b_x, b_nib, b_q):
    """(scratch word, bits) of token bits ``b_nib`` (bit ``t % 4``) of logical microblock ``b_x`` for
    group row ``b_q``: scratch word x holds row q's bits of microblock x at 4q .. 4q + 3."""
    return b_x, b_nib << (4 * b_q)


@triton.jit
def _or_word(p_bits, p_sec, b_x, b_nib, b_q, b_ok, SUMMARY: tl.constexpr):
    """OR token bits ``b_nib`` of logical microblock ``b_x`` for group row ``b_q`` into the scratch where
    ``b_ok``; with ``SUMMARY``, also mark the microblock's 8-word sector (a plain byte store: every
    writer stores the same 1)."""
    b_word, b_bit = _word_bits(b_x, b_nib, b_q)
    tl.atomic_or(p_bits + b_word, b_bit, mask=b_ok, sem="relaxed")
    if SUMMARY:
        tl.store(p_sec + (b_x >> 3), tl.full(b_x.shape, 1, tl.int8), mask=b_ok)


@triton.jit
def _or_token(p_bits, p_sec, p_bt, b_t, b_ok, b_q, num_blocks, BLOCK_SIZE: tl.constexpr,
              SUMMARY: tl.constexpr, LATE_TABLE: tl.constexpr):
    """Set the bit of each token ``b_t`` where ``b_ok`` and its block-table entry is valid (``LATE_TABLE``:
    the scan checks the entry instead)."""
    if LATE_TABLE:
        b_ok_t = b_ok
    else:
        b_phys = tl.load(p_bt + _udiv(b_t, BLOCK_SIZE), mask=b_ok, other=-1)
        b_ok_t = b_ok & (b_phys >= 0) & (b_phys < num_blocks)
    _or_word(p_bits, p_sec, b_t >> 2, 1 << (b_t & 3), b_q, b_ok_t, SUMMARY)


@triton.jit
def _or_quads(p_bits, p_sec, p_bt, t0, t1, t2, t3, k0, k1, k2, k3, b_q, num_blocks, XCAP,
              BLOCK_SIZE: tl.constexpr, SUMMARY: tl.constexpr, LATE_TABLE: tl.constexpr):
    """Set the bits of the kept tokens of index quads ``(t0, t1, t2, t3)`` (``k*``: kept by the checks
    not involving the block table). A quad whose kept tokens share one microblock (as select_tokens
    emits them) takes one atomic (and one table lookup, unless ``LATE_TABLE`` leaves it to the scan); the
    tokens of any other quad take their own.
    The four columns of a quad are separate tensors of one layout, so no step reduces across threads.
    Returns the lowest and highest logical microblock of each quad's kept tokens (XCAP, -1: none)."""
    PER_BLOCK: tl.constexpr = BLOCK_SIZE // 4
    x0 = t0 >> 2
    x1 = t1 >> 2
    x2 = t2 >> 2
    x3 = t3 >> 2
    lo = tl.minimum(tl.minimum(tl.where(k0, x0, XCAP), tl.where(k1, x1, XCAP)),
                    tl.minimum(tl.where(k2, x2, XCAP), tl.where(k3, x3, XCAP)))
    hi = tl.maximum(tl.maximum(tl.where(k0, x0, -1), tl.where(k1, x1, -1)),
                    tl.maximum(tl.where(k2, x2, -1), tl.where(k3, x3, -1)))
    one = lo == hi
    nib = (tl.where(k0, 1 << (t0 & 3), 0) | tl.where(k1, 1 << (t1 & 3), 0)
           | tl.where(k2, 1 << (t2 & 3), 0) | tl.where(k3, 1 << (t3 & 3), 0))
    if LATE_TABLE:
        one_ok = one
    else:
        b_phys = tl.load(p_bt + _udiv(lo, PER_BLOCK), mask=one, other=-1)
        one_ok = one & (b_phys >= 0) & (b_phys < num_blocks)
    _or_word(p_bits, p_sec, lo, nib, b_q, one_ok, SUMMARY)
    split = ~one
    _or_token(p_bits, p_sec, p_bt, t0, k0 & split, b_q, num_blocks, BLOCK_SIZE, SUMMARY, LATE_TABLE)
    _or_token(p_bits, p_sec, p_bt, t1, k1 & split, b_q, num_blocks, BLOCK_SIZE, SUMMARY, LATE_TABLE)
    _or_token(p_bits, p_sec, p_bt, t2, k2 & split, b_q, num_blocks, BLOCK_SIZE, SUMMARY, LATE_TABLE)
    _or_token(p_bits, p_sec, p_bt, t3, k3 & split, b_q, num_blocks, BLOCK_SIZE, SUMMARY, LATE_TABLE)
    return lo, hi


@triton.jit
def _emit_words(b_v, o_x, count, p_bits, p_bt, p_gids, p_gmasks, num_blocks, PER_BLOCK: tl.constexpr,
                LATE_TABLE: tl.constexpr, SYNC_SCAN: tl.constexpr, PTX: tl.constexpr):
    """One scan step over ``[sectors, 8]`` scratch words ``b_v`` of logical microblocks ``o_x``, ascending:
    each nonzero word (with a valid table entry, under ``LATE_TABLE``) becomes a plan entry at the running
    ``count`` (prefix sums per sector, then within it); every nonzero word is zeroed. Returns the count."""
    m_live = b_v != 0
    b_page = _load_i32(p_bt + _udiv(o_x, PER_BLOCK), m_live, PTX)
    m_emit = m_live
    if LATE_TABLE:
        m_emit = m_live & (b_page >= 0) & (b_page < num_blocks)
    b_n = tl.sum(m_emit.to(tl.int32), 1)
    b_slot = (count + tl.cumsum(b_n, 0) - b_n)[:, None] + tl.cumsum(m_emit.to(tl.int32), 1) - 1
    _store_i32(p_gids + b_slot, b_page * PER_BLOCK + _umod(o_x, PER_BLOCK), m_emit, PTX)
    _store_i32(p_gmasks + b_slot, b_v, m_emit, PTX)
    if SYNC_SCAN:
        tl.debug_barrier()
    _store_i32(p_bits + o_x, tl.zeros(b_v.shape, tl.int32), m_live, PTX)
    return count + tl.sum(b_n, 0)


@triton.jit
def _group_rows(req_ptr, pos_ptr, row0, o_q, GROUP_ROWS: tl.constexpr, num_rows, num_reqs):
    """(request, position, row is pending) of each row of the group starting at ``row0``."""
    m_q = (o_q < GROUP_ROWS) & (row0 + o_q < num_rows)
    b_req = tl.load(req_ptr + row0 + o_q, mask=m_q, other=-1).to(tl.int64)
    b_pos = tl.load(pos_ptr + row0 + o_q, mask=m_q, other=-1).to(tl.int64)
    return b_req, b_pos, m_q & (b_req >= 0) & (b_req < num_reqs) & (b_pos >= 0)


@triton.jit
def _next_request(b_pending, b_req, o_q, BLOCK_Q: tl.constexpr):
    """The request of the first pending row, its pending rows, and the rows still pending after them."""
    q_first = tl.min(tl.where(b_pending, o_q, BLOCK_Q), 0)
    req = tl.sum(tl.where(o_q == q_first, b_req, 0), 0)
    b_mine = b_pending & (b_req == req)
    return req, b_mine, b_pending & ~b_mine


@triton.jit
def _row_limits(b_pos, b_mine, seq_len, max_blocks, BLOCK_SIZE: tl.constexpr):
    """(rows to read, as [BLOCK_Q, 1]; their last kept token as unsigned [BLOCK_Q, 1]): a row keeps (table
    aside) the tokens 0 <= t <= its last, one unsigned compare per token."""
    b_last = tl.minimum(tl.minimum(b_pos, seq_len.to(tl.int64) - 1), max_blocks.to(tl.int64) * BLOCK_SIZE - 1)
    return (b_mine & (b_last >= 0))[:, None], tl.maximum(b_last, 0).to(tl.int32).to(tl.uint32)[:, None]


@triton.jit
def _group_widths(count_ptr, row0, o_q, stride_count, W, num_rows, GROUP_ROWS: tl.constexpr,
                  HAS_COUNTS: tl.constexpr):
    """Entries of each row of the group starting at ``row0`` that may be read (``row_width`` for a group):
    ``W``, or with ``HAS_COUNTS`` each row's ``index_counts`` entry clamped to ``[0, W]``, as
    ``[BLOCK_Q, 1]``."""
    if HAS_COUNTS:
        m_q = (o_q < GROUP_ROWS) & (row0 + o_q < num_rows)
        n = tl.load(count_ptr + (row0 + o_q) * stride_count, mask=m_q, other=0)
        return tl.minimum(tl.maximum(n, 0), W)[:, None]
    else:
        return W


@triton.jit
def _load_quads(p_r, c, o_c, m_r, W):
    """The four columns of the index quads starting at columns ``c + o_c`` (-1 at and past ``W``, a
    scalar or each row's width ``[BLOCK_Q, 1]``)."""
    o_n = c + o_c
    n0 = tl.load(p_r + c, mask=m_r & (o_n < W), other=-1)
    n1 = tl.load(p_r + c + 1, mask=m_r & (o_n + 1 < W), other=-1)
    n2 = tl.load(p_r + c + 2, mask=m_r & (o_n + 2 < W), other=-1)
    n3 = tl.load(p_r + c + 3, mask=m_r & (o_n + 3 < W), other=-1)
    return n0, n1, n2, n3


@triton.jit
def _bits_pass(p_idx, o_q, o_a, b_pos, b_mine, seq_len, max_blocks, W, n_w, XCAP, p_bits, p_sec, p_bt, num_blocks,
               p_map, base, flag_off, BLOCK_Q: tl.constexpr, QUADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               SUMMARY: tl.constexpr, LATE_TABLE: tl.constexpr, MAP: tl.constexpr,
               SHARED: tl.constexpr):
    """Phase 1 of the grouped planners: the bits of every kept token of the rows ``b_mine`` of one request
    (``_or_quads`` into the scratch bitmap, or with ``MAP`` ``_or_quads_map`` into the byte map), QUADS
    quads a row per step, the next step's indices in flight; a row's entries at and past its width ``n_w``
    (``_group_widths``) are never read. Returns the lowest and highest logical microblock touched (XCAP,
    -1: none)."""
    STEP: tl.constexpr = 4 * QUADS
    o_c = 4 * o_a[None, :]  # [1, QUADS]: first column of each quad
    m_r, u_last = _row_limits(b_pos, b_mine, seq_len, max_blocks, BLOCK_SIZE)
    p_r = p_idx + o_c
    n0, n1, n2, n3 = _load_quads(p_r, 0, o_c, m_r, n_w)
    b_lo = tl.full([BLOCK_Q, QUADS], XCAP, tl.int32)
    b_hi = tl.full([BLOCK_Q, QUADS], -1, tl.int32)
    for c in range(0, W, STEP):
        t0, t1, t2, t3 = n0, n1, n2, n3
        n0, n1, n2, n3 = _load_quads(p_r, c + STEP, o_c, m_r, n_w)
        k0 = t0.to(tl.uint32) <= u_last
        k1 = t1.to(tl.uint32) <= u_last
        k2 = t2.to(tl.uint32) <= u_last
        k3 = t3.to(tl.uint32) <= u_last
        if MAP:
            lo, hi = _or_quads_map(p_bits, p_map, base, flag_off, t0, t1, t2, t3, k0, k1, k2, k3, o_q[:, None], XCAP,
                                   SHARED)
        else:
            lo, hi = _or_quads(p_bits, p_sec, p_bt, t0, t1, t2, t3, k0, k1, k2, k3, o_q[:, None], num_blocks, XCAP,
                               BLOCK_SIZE, SUMMARY, LATE_TABLE)
        b_lo = tl.minimum(b_lo, lo)
        b_hi = tl.maximum(b_hi, hi)
    return tl.min(tl.min(b_lo, 1), 0), tl.max(tl.max(b_hi, 1), 0)


@triton.jit
def _finish_group(count, g, g_counts_ptr, p_gids, p_gmasks, PAD: tl.constexpr):
    """Store the group's count and pad its list to a whole tile with (first id, mask 0): a real microblock
    some row uses."""
    tl.store(g_counts_ptr + g, count)
    first_id = tl.load(p_gids, mask=count > 0, other=0, cache_modifier=".cg")
    o_pad = count + tl.arange(0, PAD)
    m_pad = o_pad < (count + PAD - 1) // PAD * PAD
    tl.store(p_gids + o_pad, tl.zeros([PAD], tl.int32) + first_id, mask=m_pad)
    tl.store(p_gmasks + o_pad, tl.zeros([PAD], tl.int32), mask=m_pad)


@triton.jit
def grouped_plan_kernel(
    idx_ptr,  # [rows, W] int32 token indices
    bt_ptr,  # [num_reqs, max_blocks] int32 block table
    req_ptr,  # [rows] int32|int64 token_to_req
    pos_ptr,  # [rows] int32|int64 positions
    seq_lens_ptr,  # [num_reqs] int32
    g_ids_ptr,  # [groups, cap_g] int32 out: physical microblock ids
    g_masks_ptr,  # [groups, cap_g] int32 out: bit 4q + t % 4
    g_counts_ptr,  # [groups] int32 out
    bits_ptr,  # [programs, stride_bits] int32 scratch, all zero between groups (see SUMMARY)
    idx_count_ptr,  # [rows] int32 index_counts with HAS_COUNTS; else None (no parameter)
    W,
    num_rows,
    num_groups,
    num_programs,
    num_reqs,
    max_blocks,
    num_blocks,
    XCAP,  # bitmap words per program: logical microblocks of a request (max_blocks * BLOCK_SIZE // 4), x512
    stride_bits,  # scratch words per program: XCAP, then (SUMMARY) XCAP // 32 sector flags and XCAP // 8 list
    stride_idx_row,
    stride_bt_req,
    stride_g_ids,
    stride_g_masks,
    stride_idx_count,  # index_counts row stride with HAS_COUNTS; else None
    GROUP_ROWS: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # power of two >= GROUP_ROWS
    BLOCK_SIZE: tl.constexpr,
    QUADS: tl.constexpr,  # index quads (4 columns) per row per step
    SCAN: tl.constexpr,  # logical microblocks per emission step (a multiple of 8)
    PAD: tl.constexpr,
    SYNC_SCAN: tl.constexpr = False,  # barrier between a scan step's loads and its zeroing stores (see below)
    SUMMARY: tl.constexpr = False,  # scan only the 8-word sectors the bitmap pass marked
    SUM_STEP: tl.constexpr = 512,  # sector-flag words (4 sectors each) per step of the summary pass
    PTX: tl.constexpr = False,  # the scans' scattered loads and stores as inline PTX (GPU only: _store_i32)
    LATE_TABLE: tl.constexpr = False,  # the bitmap pass sets bits of logically kept tokens;
    # the scan drops microblocks whose block-table entry is invalid (one entry serves a whole microblock)
    HAS_COUNTS: tl.constexpr = False,  # each row reads only its first index_counts entries (_group_widths)
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    """Union of each group's rows by (request, logical microblock), emitted in ascending logical order.

    Straight from ``indices``: no per-row plan, sort or hash. For each request of the group (in the
    order of its first row), every kept token ``t`` of the request's rows ``q`` sets bit ``t % 4`` of
    row ``q``'s nibble of logical microblock ``t // 4`` in a per-program scratch bitmap (relaxed atomic
    ORs: the result depends neither on their order nor on the order or repetition of a row's indices).
    A scan over the touched microblocks, in ascending logical order, emits every nonzero one as an entry
    (its physical id from the block table, the row nibbles as the 32-bit mask) at a running count, and
    zeroes the scratch again. Index quads that fall in one microblock (as select_tokens emits them) take
    a single atomic (``_or_quads``). The bitmap pass reduces nothing across threads inside its loop (the
    touched range is reduced once after it), and the scan reads whole 8-word sectors: with ``SUMMARY``
    only those the bitmap pass flagged, listed first. With ``LATE_TABLE`` the block table is checked by
    the scan, once per microblock, instead of by the bitmap pass.

    A scan step of fewer words than 8 per thread lays some words out in threads of several warps, and
    its prefix sums may then stay inside one warp, with no barrier between the warps; ``SYNC_SCAN`` (set
    by ``plan_groups`` for such steps) puts one between the step's loads and its zeroing stores, so
    that no warp zeroes a word another warp has yet to read.
    """
    enter_launch(PDL)
    pid = tl.program_id(0)
    p_bits = bits_ptr + pid.to(tl.int64) * stride_bits
    p_flags = p_bits + XCAP  # SUMMARY: one byte per 8-word sector of the bitmap, 1 where the pass set a bit
    p_sec = p_flags.to(tl.pointer_type(tl.int8))
    p_list = p_flags + XCAP // 32  # SUMMARY: the marked sectors, ascending
    o_q = tl.arange(0, BLOCK_Q)
    o_a = tl.arange(0, QUADS)
    PER_BLOCK: tl.constexpr = BLOCK_SIZE // 4
    SCAN_W: tl.constexpr = SCAN // 8

    g = pid
    while g < num_groups:
        row0 = g.to(tl.int64) * GROUP_ROWS
        b_req, b_pos, b_pending = _group_rows(req_ptr, pos_ptr, row0, o_q, GROUP_ROWS, num_rows, num_reqs)
        p_gids = g_ids_ptr + g.to(tl.int64) * stride_g_ids
        p_gmasks = g_masks_ptr + g.to(tl.int64) * stride_g_masks
        p_idx = idx_ptr + (row0 + o_q[:, None]) * stride_idx_row
        n_w = _group_widths(idx_count_ptr, row0, o_q, stride_idx_count, W, num_rows, GROUP_ROWS, HAS_COUNTS)
        count = 0
        while tl.max(b_pending.to(tl.int32), 0) > 0:
            # The request of the first pending row, and all pending rows of it.
            req, b_mine, b_pending = _next_request(b_pending, b_req, o_q, BLOCK_Q)
            seq_len = tl.load(seq_lens_ptr + req)
            p_bt = bt_ptr + req * stride_bt_req

            # Phase 1: set the bits of every kept token of the request's rows (next step's indices in flight).
            b_lo, x_hi = _bits_pass(p_idx, o_q, o_a, b_pos, b_mine, seq_len, max_blocks, W, n_w, XCAP, p_bits, p_sec,
                                    p_bt, num_blocks, p_bits, 0, 0, BLOCK_Q, QUADS, BLOCK_SIZE, SUMMARY, LATE_TABLE,
                                    False, False)
            # The scanned range, widened to whole 8-word sectors (the scratch is zero past the touched words).
            x_lo = b_lo // 8 * 8
            x_end = tl.where(x_hi >= 0, (x_hi // 8 + 1) * 8, 0)
            tl.debug_barrier()

            # Phase 2: emit the nonzero microblocks in ascending logical order; leave the scratch zero.
            if SUMMARY:
                # (a) The marked sectors of the touched range, ascending, into the list; flags back to 0.
                o_f = tl.arange(0, SUM_STEP)
                o_b = tl.arange(0, 4)
                n_sec = 0
                w_lo = x_lo // 32
                w_end = tl.cdiv(x_end, 32)
                for w0 in range(w_lo, w_end, SUM_STEP):
                    o_w = w0 + o_f
                    b_f = tl.load(p_flags + o_w, mask=o_w < w_end, other=0, cache_modifier=".cg")
                    m_sec = ((b_f[:, None] >> (8 * o_b[None, :])) & 0xFF) != 0  # [SUM_STEP, 4]
                    b_c = tl.sum(m_sec.to(tl.int32), 1)
                    b_at = (n_sec + tl.cumsum(b_c, 0) - b_c)[:, None] + tl.cumsum(m_sec.to(tl.int32), 1) - 1
                    tl.store(p_list + b_at, o_w[:, None] * 4 + o_b[None, :], mask=m_sec)
                    tl.debug_barrier()  # every thread has read its words before any is zeroed
                    tl.store(p_flags + o_w, tl.zeros([SUM_STEP], tl.int32), mask=b_f != 0)
                    n_sec += tl.sum(b_c, 0)
                tl.debug_barrier()  # the list is written before it is read
                # (b) Each listed sector's 8 words, SCAN // 8 sectors per step.
                o_r = tl.arange(0, SCAN_W)
                o_j = tl.arange(0, 8)
                for k in range(0, tl.cdiv(n_sec, SCAN_W)):
                    o_l = k * SCAN_W + o_r
                    m_l = o_l < n_sec
                    b_sec = tl.load(p_list + o_l, mask=m_l, other=0, cache_modifier=".cg")
                    o_x = b_sec[:, None] * 8 + o_j[None, :]
                    b_v = tl.load(p_bits + o_x, mask=m_l[:, None], other=0, cache_modifier=".cg")
                    count = _emit_words(b_v, o_x, count, p_bits, p_bt, p_gids, p_gmasks, num_blocks, PER_BLOCK,
                                        LATE_TABLE, SYNC_SCAN, PTX)
            else:
                # [SCAN // 8, 8]: whole 8-word sectors; a running count per sector, then within it.
                o_r = tl.arange(0, SCAN_W)
                o_j = tl.arange(0, 8)
                for k in range(0, tl.cdiv(x_end - x_lo, SCAN)):
                    s8 = tl.multiple_of(x_lo + k * SCAN, 8)
                    o_x = s8 + o_r[:, None] * 8 + o_j[None, :]
                    b_v = tl.load(p_bits + o_x, mask=(s8 + o_r * 8 < x_end)[:, None], other=0,
                                  cache_modifier=".cg")
                    count = _emit_words(b_v, o_x, count, p_bits, p_bt, p_gids, p_gmasks, num_blocks, PER_BLOCK,
                                        LATE_TABLE, SYNC_SCAN, PTX)
            tl.debug_barrier()

        _finish_group(count, g, g_counts_ptr, p_gids, p_gmasks, PAD)
        g += num_programs


# --- The grouped planner over a map in shared memory -------------------------------------------------------

_MAP_WORDS = settings.SHARED_MAP_MICROBLOCKS * 9 // 32 + settings.MAP_LIST_WORDS
SHARED_MAP_MICROBLOCKS = tl.constexpr(settings.SHARED_MAP_MICROBLOCKS)
"""Logical microblocks the shared-memory map of ``grouped_plan_map_kernel`` covers (144K tokens): a byte
and a flag bit per microblock, then a list of ``LIST_WORDS`` words, 47616 bytes of static shared memory
(the PTX limit is 48 KB). Both sizes are the shipped settings', fixed when this module is imported."""
LIST_WORDS = tl.constexpr(settings.MAP_LIST_WORDS)
SHARED_MAP_ASM = tl.constexpr(f".shared .align 16 .b32 qsa_plan_map[{_MAP_WORDS}];\n\tmov.u32 $0, qsa_plan_map;")


@triton.jit
def _shared_map_base(x, SHARED: tl.constexpr):
    """Shared-window address of the program's map (``SHARED``: a static ``.shared`` array of
    ``SHARED_MAP_MICROBLOCKS * 9 // 32 + LIST_WORDS`` words, declared once at the kernel's top); 0 otherwise."""
    if SHARED:
        return tl.inline_asm_elementwise(
            SHARED_MAP_ASM,
            "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return x * 0


@triton.jit
def _map_or(p_map, base, word, val, m, SHARED: tl.constexpr):
    """OR ``val`` into map word ``word`` where ``m`` (shared memory, or the global ``p_map``)."""
    if SHARED:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p red.shared.or.b32 [$1], $3; mov.b32 $0, 0; }",
            "=r,r,r,r", [base + 4 * word, m.to(tl.int32), val], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_or(p_map + word, val, mask=m, sem="relaxed")


@triton.jit
def _map_load(p_map, base, word, m, SHARED: tl.constexpr):
    """Map word ``word`` where ``m``, else 0."""
    if SHARED:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.shared.b32 $0, [$1]; }",
            "=r,r,r", [base + 4 * word, m.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.load(p_map + word, mask=m, other=0, cache_modifier=".cg")


@triton.jit
def _map_store(p_map, base, word, val, m, SHARED: tl.constexpr):
    """Store ``val`` to map word ``word`` where ``m``."""
    if SHARED:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.shared.b32 [$1], $3; mov.b32 $0, 0; }",
            "=r,r,r,r", [base + 4 * word, m.to(tl.int32), val], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(p_map + word, val, mask=m)


@triton.jit
def _map_zero(p_map, base, word, m, SHARED: tl.constexpr):
    """Zero map word ``word`` where ``m``."""
    _map_store(p_map, base, word, tl.zeros(word.shape, tl.int32), m, SHARED)


@triton.jit
def _row_bits_to_nibbles(b):
    """Byte ``b`` (bit q: row q's whole microblock) as the plan's mask: nibble q all ones where bit q is set."""
    b = (b | (b << 12)) & 0x000F000F
    b = (b | (b << 6)) & 0x03030303
    b = (b | (b << 3)) & 0x11111111
    return b * 15


@triton.jit
def _or_partial(p_bits, p_map, base, flag_off, b_x, b_nib, b_q, b_ok, SHARED: tl.constexpr):
    """Token bits ``b_nib`` of row ``b_q`` in microblock ``b_x`` that do not make a whole microblock: ORed
    into the global nibble word of ``b_x``, and ``b_x`` flagged in the map."""
    tl.atomic_or(p_bits + b_x, b_nib << (4 * b_q), mask=b_ok, sem="relaxed")
    _map_or(p_map, base, flag_off + (b_x >> 5), 1 << (b_x & 31), b_ok, SHARED)


@triton.jit
def _or_quads_map(p_bits, p_map, base, flag_off, t0, t1, t2, t3, k0, k1, k2, k3, b_q, XCAP, SHARED: tl.constexpr):
    """``_or_quads`` for the map: a quad whose kept tokens are one whole microblock (as select_tokens
    emits them) sets bit ``b_q`` of the microblock's map byte; other kept tokens take the partial path.
    Returns the lowest and highest logical microblock of each quad's kept tokens (XCAP, -1: none)."""
    x0 = t0 >> 2
    x1 = t1 >> 2
    x2 = t2 >> 2
    x3 = t3 >> 2
    lo = tl.minimum(tl.minimum(tl.where(k0, x0, XCAP), tl.where(k1, x1, XCAP)),
                    tl.minimum(tl.where(k2, x2, XCAP), tl.where(k3, x3, XCAP)))
    hi = tl.maximum(tl.maximum(tl.where(k0, x0, -1), tl.where(k1, x1, -1)),
                    tl.maximum(tl.where(k2, x2, -1), tl.where(k3, x3, -1)))
    one = lo == hi
    nib = (tl.where(k0, 1 << (t0 & 3), 0) | tl.where(k1, 1 << (t1 & 3), 0)
           | tl.where(k2, 1 << (t2 & 3), 0) | tl.where(k3, 1 << (t3 & 3), 0))
    whole = one & (nib == 15)
    _map_or(p_map, base, lo >> 2, (1 << b_q) << (8 * (lo & 3)), whole, SHARED)
    _or_partial(p_bits, p_map, base, flag_off, lo, nib, b_q, one & ~whole, SHARED)
    split = ~one
    _or_partial(p_bits, p_map, base, flag_off, x0, 1 << (t0 & 3), b_q, k0 & split, SHARED)
    _or_partial(p_bits, p_map, base, flag_off, x1, 1 << (t1 & 3), b_q, k1 & split, SHARED)
    _or_partial(p_bits, p_map, base, flag_off, x2, 1 << (t2 & 3), b_q, k2 & split, SHARED)
    _or_partial(p_bits, p_map, base, flag_off, x3, 1 << (t3 & 3), b_q, k3 & split, SHARED)
    return lo, hi


@triton.jit
def grouped_plan_map_kernel(
    idx_ptr,  # [rows, W] int32 token indices
    bt_ptr,  # [num_reqs, max_blocks] int32 block table
    req_ptr,  # [rows] int32|int64 token_to_req
    pos_ptr,  # [rows] int32|int64 positions
    seq_lens_ptr,  # [num_reqs] int32
    g_ids_ptr,  # [groups, cap_g] int32 out: physical microblock ids
    g_masks_ptr,  # [groups, cap_g] int32 out: bit 4q + t % 4
    g_counts_ptr,  # [groups] int32 out
    bits_ptr,  # [programs, stride_bits] int32 scratch: XCAP nibble words, zero between calls, and (not SHARED)
    # the map at map_off (zero between calls but for its list)
    idx_count_ptr,  # [rows] int32 index_counts with HAS_COUNTS; else None (no parameter)
    W,
    num_rows,
    num_groups,
    num_programs,
    num_reqs,
    max_blocks,
    num_blocks,
    XCAP,  # nibble words per program (a multiple of 512, at least the table's logical microblocks)
    map_off,  # without SHARED: the map's first scratch word (XCAP * 37 // 32, after grouped_plan_kernel's parts)
    flag_off,  # the map's first flag word: its microblocks (SHARED_MAP_MICROBLOCKS with SHARED, else XCAP) // 4
    list_off,  # the map's live-word list (LIST_WORDS words): flag_off + its microblocks // 32
    stride_bits,
    stride_idx_row,
    stride_bt_req,
    stride_g_ids,
    stride_g_masks,
    stride_idx_count,  # index_counts row stride with HAS_COUNTS; else None
    GROUP_ROWS: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # power of two >= GROUP_ROWS
    BLOCK_SIZE: tl.constexpr,
    QUADS: tl.constexpr,  # index quads per row per step
    SCAN: tl.constexpr,  # logical microblocks per listing step (a multiple of 32, at most 4 * LIST_WORDS)
    CH: tl.constexpr,  # live map words per emission step
    LIST: tl.constexpr,  # the list's words: LIST_WORDS (fewer only to test its flushes)
    PAD: tl.constexpr,
    SHARED: tl.constexpr,  # the map in static shared memory (GPU only; the table's microblocks must fit it)
    PTX: tl.constexpr = False,  # the emission's scattered stores as inline PTX (GPU only)
    HAS_COUNTS: tl.constexpr = False,  # each row reads only its first index_counts entries (_group_widths)
    PDL: tl.constexpr = 0,
):
    """``grouped_plan_kernel``'s union, with the rows' bits gathered in a map of a byte per logical
    microblock (bit q: row q keeps the whole microblock) in the program's shared memory.

    The bitmap pass of ``grouped_plan_kernel`` spends most of its time in the L2's atomic operations, one
    per index quad. Here a quad that is one whole microblock (every quad select_tokens emits but the causal
    tail's) ORs its row's bit into the map with a shared-memory reduction; only other kept tokens take a
    global atomic on the microblock's nibble word and flag the microblock in the map (a bit per
    microblock after the bytes). The scan reads the map over the touched range in ascending order, turns
    each byte into nibbles, ORs in the nibble word of a flagged microblock (and zeroes it), checks the
    block table and emits the entry, then zeroes the map. Plans are those of ``grouped_plan_kernel``: the
    map and words are ORed in any order, and the scan order is the microblocks'.

    Without ``SHARED`` (the interpreter) the map lives in the scratch after the nibble words, with
    global atomics: the same steps, testable on the CPU.
    """
    enter_launch(PDL)
    pid = tl.program_id(0)
    p_bits = bits_ptr + pid.to(tl.int64) * stride_bits
    p_map = p_bits + map_off
    base = _shared_map_base(pid, SHARED)
    o_q = tl.arange(0, BLOCK_Q)
    o_a = tl.arange(0, QUADS)
    PER_BLOCK: tl.constexpr = BLOCK_SIZE // 4
    SW: tl.constexpr = SCAN // 4
    o_s = tl.arange(0, SW)
    o_h = tl.arange(0, CH)
    o_j = tl.arange(0, 4)
    if SHARED:  # static shared memory starts undefined
        MAP_WORDS: tl.constexpr = SHARED_MAP_MICROBLOCKS * 9 // 32 + LIST_WORDS
        o_z = tl.arange(0, 1024)
        for z in range(0, MAP_WORDS, 1024):
            _map_zero(p_map, base, z + o_z, z + o_z < MAP_WORDS, SHARED)
        tl.debug_barrier()

    g = pid
    while g < num_groups:
        row0 = g.to(tl.int64) * GROUP_ROWS
        b_req, b_pos, b_pending = _group_rows(req_ptr, pos_ptr, row0, o_q, GROUP_ROWS, num_rows, num_reqs)
        p_gids = g_ids_ptr + g.to(tl.int64) * stride_g_ids
        p_gmasks = g_masks_ptr + g.to(tl.int64) * stride_g_masks
        p_idx = idx_ptr + (row0 + o_q[:, None]) * stride_idx_row
        n_w = _group_widths(idx_count_ptr, row0, o_q, stride_idx_count, W, num_rows, GROUP_ROWS, HAS_COUNTS)
        count = 0
        while tl.max(b_pending.to(tl.int32), 0) > 0:
            req, b_mine, b_pending = _next_request(b_pending, b_req, o_q, BLOCK_Q)
            seq_len = tl.load(seq_lens_ptr + req)
            p_bt = bt_ptr + req * stride_bt_req

            # Phase 1: the rows' bits into the map (next step's indices in flight).
            b_lo, x_hi = _bits_pass(p_idx, o_q, o_a, b_pos, b_mine, seq_len, max_blocks, W, n_w, XCAP, p_bits, p_bits,
                                    p_bt, num_blocks, p_map, base, flag_off, BLOCK_Q, QUADS, BLOCK_SIZE,
                                    False, True, True, SHARED)
            x_lo = b_lo // 32 * 32
            x_end = tl.where(x_hi >= 0, (x_hi // 32 + 1) * 32, 0)
            tl.debug_barrier()

            # Phase 2: the touched range in ascending order. Its live map words (a bit set, or a microblock
            # flagged) are listed, SCAN microblocks (SW words) a step; whenever the list may not take
            # another step, and at the end, its words are emitted CH at a time and zeroed.
            n_list = 0
            n_steps = tl.cdiv(x_end - x_lo, SCAN)
            for k in range(0, n_steps):
                o_w = (x_lo + k * SCAN) // 4 + o_s
                m_w = o_w * 4 < x_end
                b_w = _map_load(p_map, base, o_w, m_w, SHARED)
                b_f = _map_load(p_map, base, flag_off + o_w // 8, m_w, SHARED)
                m_nz = (b_w != 0) | (((b_f >> (4 * (o_w & 7))) & 0xF) != 0)
                _map_store(p_map, base, list_off + n_list + tl.cumsum(m_nz.to(tl.int32), 0) - 1, o_w, m_nz, SHARED)
                n_list += tl.sum(m_nz.to(tl.int32), 0)
                if (n_list > LIST - SW) | (k == n_steps - 1):
                    tl.debug_barrier()  # the list is written before it is read
                    for h in range(0, tl.cdiv(n_list, CH)):
                        m_l = h * CH + o_h < n_list
                        b_lw = _map_load(p_map, base, list_off + h * CH + o_h, m_l, SHARED)
                        b_lv = _map_load(p_map, base, b_lw, m_l, SHARED)
                        b_lf = _map_load(p_map, base, flag_off + b_lw // 8, m_l, SHARED)
                        o_x = b_lw[:, None] * 4 + o_j[None, :]  # [CH, 4]
                        m_part = (((b_lf[:, None] >> (o_x & 31)) & 1) != 0) & m_l[:, None]
                        b_v = _row_bits_to_nibbles((b_lv[:, None] >> (8 * o_j[None, :])) & 0xFF)
                        b_v = b_v | _load_i32(p_bits + o_x, m_part, PTX, CG=True)
                        m_live = b_v != 0
                        b_page = _load_i32(p_bt + _udiv(o_x, PER_BLOCK), m_live, PTX)
                        m_emit = m_live & (b_page >= 0) & (b_page < num_blocks)
                        b_n = tl.sum(m_emit.to(tl.int32), 1)
                        b_slot = (count + tl.cumsum(b_n, 0) - b_n)[:, None] + tl.cumsum(m_emit.to(tl.int32), 1) - 1
                        _store_i32(p_gids + b_slot, b_page * PER_BLOCK + _umod(o_x, PER_BLOCK), m_emit, PTX)
                        _store_i32(p_gmasks + b_slot, b_v, m_emit, PTX)
                        count += tl.sum(b_n, 0)
                        tl.debug_barrier()  # every thread has read its words before any is zeroed
                        _map_zero(p_map, base, b_lw, m_l & (b_lv != 0), SHARED)
                        _store_i32(p_bits + o_x, tl.zeros([CH, 4], tl.int32), m_part, PTX)
                    n_list = 0
                    tl.debug_barrier()  # the list is read before the next step writes it
            # The flags last: a flag word serves 8 map words, which two emission steps may share.
            o_f = tl.arange(0, 512)
            for z in range(x_lo // 32, x_end // 32, 512):
                _map_zero(p_map, base, flag_off + z + o_f, z + o_f < x_end // 32, SHARED)
            tl.debug_barrier()

        _finish_group(count, g, g_counts_ptr, p_gids, p_gmasks, PAD)
        g += num_programs
