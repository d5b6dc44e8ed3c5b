"""Page4 planner kernels: single-row microblock lists and grouped unions by physical microblock."""

import triton
import triton.language as tl

INT32_MAX = tl.constexpr(2**31 - 1)
EMPTY = tl.constexpr(-1)


@triton.jit
def _or_within_run(lm_a, bits_a, lm_b, bits_b):
    # Inclusive scan over ascending logical microblocks: OR of the bits of the current run.
    return lm_b, tl.where(lm_a == lm_b, bits_a | bits_b, bits_b)


@triton.jit
def _row_setup(req_ptr, pos_ptr, seq_lens_ptr, i_r, num_reqs):
    """(request, position, seq_len, row is valid) of row ``i_r``; invalid rows keep nothing."""
    req = tl.load(req_ptr + i_r).to(tl.int64)
    pos = tl.load(pos_ptr + i_r).to(tl.int64)
    row_ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req = tl.where(row_ok, req, 0)
    seq_len = tl.load(seq_lens_ptr + req, mask=row_ok, other=0)
    return req, pos, seq_len, row_ok


@triton.jit
def _kept_keys(p_idx, o_w, W, req, pos, seq_len, row_ok, bt_ptr, stride_bt_req, max_blocks, num_blocks,
               BLOCK_SIZE: tl.constexpr):
    """(token ``t`` where it is kept (SPEC section 4), INT32_MAX where it is dropped; its block)."""
    b_t = tl.load(p_idx + o_w, mask=(o_w < W) & row_ok, other=-1)
    b_lb = b_t // BLOCK_SIZE
    m_keep = (b_t >= 0) & (b_t < seq_len) & (b_t <= pos) & (b_lb < max_blocks)
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
    m_emit = m_valid & (b_unit != (b_next >> UNIT_SHIFT))
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
def _finish_row(count, p_ids, p_masks, counts_ptr, i_r, PAD: tl.constexpr, EMIT_TOKENS: tl.constexpr):
    """Store the count; pad the list to a whole tile with (first id, mask 0), a real used microblock."""
    tl.store(counts_ptr + i_r, count)
    if not EMIT_TOKENS:
        tl.debug_barrier()
        first_id = tl.load(p_ids, mask=count > 0, other=0, cache_modifier=".cg")
        o_pad = count + tl.arange(0, PAD)
        m_pad = o_pad < (count + PAD - 1) // PAD * PAD
        tl.store(p_ids + o_pad, tl.zeros([PAD], tl.int32) + first_id, mask=m_pad)
        tl.store(p_masks + o_pad, tl.zeros([PAD], tl.uint8), mask=m_pad)


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
    W,
    num_reqs,
    max_blocks,
    num_blocks,
    stride_idx_row,
    stride_bt_req,
    stride_ids_row,
    stride_masks_row,
    BLOCK_SIZE: tl.constexpr,
    CH: tl.constexpr,  # tokens per step
    PAD: tl.constexpr,
    EMIT_TOKENS: tl.constexpr,  # emit distinct kept logical tokens instead of microblocks
):
    """One row whose kept tokens already ascend (as select_tokens emits them): one streaming pass.

    Kept tokens are read CH at a time; each logical unit is emitted where its run ends, with the OR
    of its bits. A row found out of order is handed to ``single_row_sort_plan_kernel``.
    """
    i_r = tl.program_id(0).to(tl.int64)
    req, pos, seq_len, row_ok = _row_setup(req_ptr, pos_ptr, seq_lens_ptr, i_r, num_reqs)
    p_idx = idx_ptr + i_r * stride_idx_row
    p_ids = ids_ptr + i_r * stride_ids_row
    p_masks = masks_ptr + i_r * stride_masks_row
    o_c = tl.arange(0, CH)

    b_key, b_phys = _kept_keys(p_idx, o_c, W, req, pos, seq_len, row_ok, bt_ptr, stride_bt_req, max_blocks,
                               num_blocks, BLOCK_SIZE)
    prev_key = -1
    carry = 0
    count = 0
    ordered = W >= 0
    c = 0
    while (c < W) & ordered:
        b_key_next, b_phys_next = _kept_keys(p_idx, c + CH + o_c, W, req, pos, seq_len, row_ok, bt_ptr,
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
    num_programs,
    W,
    num_reqs,
    max_blocks,
    num_blocks,
    stride_idx_row,
    stride_bt_req,
    stride_ids_row,
    stride_masks_row,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_W: tl.constexpr,  # power of two >= W
    CH: tl.constexpr,
    PAD: tl.constexpr,
    EMIT_TOKENS: tl.constexpr,
):
    """Rows whose indices are not in ascending order: sort the kept tokens, then stream as above."""
    pid = tl.program_id(0)
    p_keys = keys_ptr + pid.to(tl.int64) * BLOCK_W
    o_w = tl.arange(0, BLOCK_W)
    o_c = tl.arange(0, CH)
    n = tl.load(num_unsorted_ptr)
    i = pid
    while i < n:
        i_r = tl.load(unsorted_ptr + i).to(tl.int64)
        req, pos, seq_len, row_ok = _row_setup(req_ptr, pos_ptr, seq_lens_ptr, i_r, num_reqs)
        p_ids = ids_ptr + i_r * stride_ids_row
        p_masks = masks_ptr + i_r * stride_masks_row
        b_all, _ = _kept_keys(idx_ptr + i_r * stride_idx_row, o_w, W, req, pos, seq_len, row_ok, bt_ptr,
                              stride_bt_req, max_blocks, num_blocks, BLOCK_SIZE)
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
        tl.debug_barrier()
        i += num_programs


@triton.jit
def _hash_slot(b_id, table_mask):
    h = b_id.to(tl.uint32) * 2654435761
    h = h ^ (h >> 15)
    return (h & table_mask.to(tl.uint32)).to(tl.int32)


@triton.jit
def _flat_entry(o_f, b_start, BLOCK_Q: tl.constexpr):
    """Entry ``o_f`` of a group's rows laid end to end: its row q and index j in that row's list."""
    o_q = tl.arange(0, BLOCK_Q)
    # b_start[q] = entries of rows < q (rows past the group hold 0 entries and start at the total).
    q = tl.sum((o_f[:, None] >= b_start[None, :]).to(tl.int32), 1) - 1
    start = tl.sum(tl.where(o_q[None, :] == q[:, None], b_start[None, :], 0), 1)
    return q, o_f - start


@triton.jit
def grouped_plan_kernel(
    s_ids_ptr,  # [rows, cap_s] int32 single-row plan ids
    s_masks_ptr,  # [rows, cap_s] uint8 single-row plan masks
    s_counts_ptr,  # [rows] int32
    g_ids_ptr,  # [groups, cap_g] int32 out
    g_masks_ptr,  # [groups, cap_g] int32 out: bit 4q + t % 4
    g_counts_ptr,  # [groups] int32 out
    tab_id_ptr,  # [programs, TABLE] int32 scratch, EMPTY between groups
    tab_key_ptr,  # [programs, TABLE] int32 scratch, INT32_MAX between groups
    tab_mask_ptr,  # [programs, TABLE] int32 scratch, 0 between groups
    slot_ptr,  # [programs, >= GROUP_ROWS * cap_s] int32 scratch: table slot of each entry
    num_rows,
    num_groups,
    num_programs,
    stride_s_ids,
    stride_s_masks,
    stride_g_ids,
    stride_g_masks,
    stride_slot,
    GROUP_ROWS: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # power of two >= GROUP_ROWS
    CHUNK: tl.constexpr,  # entries per step, over the group's rows laid end to end
    TABLE: tl.constexpr,
    PAD: tl.constexpr,
):
    """Union of each group's single-row lists by physical id, emitted by first-occurrence key (q, j).

    The key of an entry is (group row q, index j in q's list): logical data only. Laying the rows'
    lists end to end puts the entries in key order, so an entry's position among the emitted ones is
    a running count. A hash table in per-program scratch collects, for every physical id, the minimum
    key (atomic_min) and the OR of row-shifted masks (atomic_or); both are order-independent, so the
    plan does not depend on which thread wins a slot or where pages live. The atomics are relaxed:
    barriers order the phases, and later phases read the table with L1-bypassing loads.
    """
    pid = tl.program_id(0)
    p_tab_id = tab_id_ptr + pid.to(tl.int64) * TABLE
    p_tab_key = tab_key_ptr + pid.to(tl.int64) * TABLE
    p_tab_mask = tab_mask_ptr + pid.to(tl.int64) * TABLE
    p_slot = slot_ptr + pid.to(tl.int64) * stride_slot
    o_q = tl.arange(0, BLOCK_Q)
    o_c = tl.arange(0, CHUNK)

    g = pid
    while g < num_groups:
        row0 = g.to(tl.int64) * GROUP_ROWS
        b_n = tl.load(s_counts_ptr + row0 + o_q, mask=(o_q < GROUP_ROWS) & (row0 + o_q < num_rows), other=0)
        b_start = tl.cumsum(b_n, 0) - b_n
        total = tl.sum(b_n, 0)
        table_size = 2
        while table_size < tl.minimum(2 * total, TABLE):
            table_size *= 2
        table_mask = table_size - 1

        # Phase 1: insert every entry; remember its slot.
        for f in range(0, total, CHUNK):
            o_f = f + o_c
            m_e = o_f < total
            b_q, b_j = _flat_entry(o_f, b_start, BLOCK_Q)
            o_src = (row0 + b_q) * stride_s_ids + b_j
            b_id = tl.load(s_ids_ptr + o_src, mask=m_e, other=0)
            b_bits = tl.load(s_masks_ptr + (row0 + b_q) * stride_s_masks + b_j, mask=m_e, other=0).to(tl.int32)
            b_h = _hash_slot(b_id, table_mask)
            m_active = m_e
            while tl.max(m_active.to(tl.int32), 0) > 0:
                # Inactive lanes compare against an impossible value: the CAS is a no-op read.
                b_old = tl.atomic_cas(p_tab_id + b_h, tl.where(m_active, EMPTY, -2), b_id, sem="relaxed")
                m_hit = m_active & ((b_old == EMPTY) | (b_old == b_id))
                m_active = m_active & ~m_hit
                b_h = tl.where(m_active, (b_h + 1) & table_mask, b_h)
            tl.store(p_slot + o_f, b_h, mask=m_e)
            tl.atomic_min(p_tab_key + b_h, o_f, mask=m_e, sem="relaxed")
            tl.atomic_or(p_tab_mask + b_h, b_bits << (4 * b_q), mask=m_e, sem="relaxed")
        tl.debug_barrier()

        # Phase 2: emit, in key order, the entries that are their id's first occurrence.
        p_gids = g_ids_ptr + g.to(tl.int64) * stride_g_ids
        p_gmasks = g_masks_ptr + g.to(tl.int64) * stride_g_masks
        base = 0
        for f in range(0, total, CHUNK):
            o_f = f + o_c
            m_e = o_f < total
            b_h = tl.load(p_slot + o_f, mask=m_e, other=0, cache_modifier=".cg")
            m_rep = m_e & (tl.load(p_tab_key + b_h, mask=m_e, other=-1, cache_modifier=".cg") == o_f)
            b_pos = base + tl.cumsum(m_rep.to(tl.int32), 0) - 1
            b_q, b_j = _flat_entry(o_f, b_start, BLOCK_Q)
            b_id = tl.load(s_ids_ptr + (row0 + b_q) * stride_s_ids + b_j, mask=m_rep, other=0)
            b_gmask = tl.load(p_tab_mask + b_h, mask=m_rep, other=0, cache_modifier=".cg")
            tl.store(p_gids + b_pos, b_id, mask=m_rep)
            tl.store(p_gmasks + b_pos, b_gmask, mask=m_rep)
            base += tl.sum(m_rep.to(tl.int32), 0)
        tl.store(g_counts_ptr + g, base)
        tl.debug_barrier()

        # Pad to a whole tile with (first id, mask 0); then leave the table empty for the next group.
        first_id = tl.load(p_gids, mask=base > 0, other=0, cache_modifier=".cg")
        o_pad = base + tl.arange(0, PAD)
        m_pad = o_pad < (base + PAD - 1) // PAD * PAD
        tl.store(p_gids + o_pad, tl.zeros([PAD], tl.int32) + first_id, mask=m_pad)
        tl.store(p_gmasks + o_pad, tl.zeros([PAD], tl.int32), mask=m_pad)
        for f in range(0, total, CHUNK):
            o_f = f + o_c
            m_e = o_f < total
            b_h = tl.load(p_slot + o_f, mask=m_e, other=0, cache_modifier=".cg")
            tl.store(p_tab_id + b_h, tl.zeros([CHUNK], tl.int32) + EMPTY, mask=m_e)
            tl.store(p_tab_key + b_h, tl.zeros([CHUNK], tl.int32) + INT32_MAX, mask=m_e)
            tl.store(p_tab_mask + b_h, tl.zeros([CHUNK], tl.int32), mask=m_e)
        tl.debug_barrier()
        g += num_programs
