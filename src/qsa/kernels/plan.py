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
def single_row_plan_kernel(
    idx_ptr,  # [rows, W] int32 token indices
    bt_ptr,  # [num_reqs, max_blocks] int32 block table
    req_ptr,  # [rows] int32|int64 token_to_req
    pos_ptr,  # [rows] int32|int64 positions
    seq_lens_ptr,  # [num_reqs] int32
    ids_ptr,  # [rows, cap] int32 out: physical microblock ids
    masks_ptr,  # [rows, cap] uint8 out: bit t % 4
    counts_ptr,  # [rows] int32 out
    W,
    num_reqs,
    max_blocks,
    num_blocks,
    stride_idx_row,
    stride_bt_req,
    stride_ids_row,
    stride_masks_row,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PAD: tl.constexpr,
    EMIT_TOKENS: tl.constexpr,  # emit distinct kept logical tokens instead of microblocks
):
    """One row: keep, sort (skipped when already ascending), merge by logical unit, compact."""
    UNIT_SHIFT: tl.constexpr = 0 if EMIT_TOKENS else 2
    i_r = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + i_r).to(tl.int64)
    pos = tl.load(pos_ptr + i_r).to(tl.int64)
    row_ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req = tl.where(row_ok, req, 0)
    seq_len = tl.load(seq_lens_ptr + req, mask=row_ok, other=0)

    o_w = tl.arange(0, BLOCK_W)
    b_t = tl.load(idx_ptr + i_r * stride_idx_row + o_w, mask=(o_w < W) & row_ok, other=-1)
    b_lb = b_t // BLOCK_SIZE
    m_keep = (b_t >= 0) & (b_t < seq_len) & (b_t <= pos) & (b_lb < max_blocks)
    b_phys = tl.load(bt_ptr + req * stride_bt_req + b_lb, mask=m_keep, other=-1)
    m_keep = m_keep & (b_phys >= 0) & (b_phys < num_blocks)
    # Dropped tokens sort last; kept tokens sort by logical token, which fixes the emission order.
    b_key = tl.where(m_keep, b_t, INT32_MAX)
    o_prev = tl.maximum(o_w - 1, 0)
    b_prev = tl.gather(b_key, o_prev, 0)
    if tl.min((b_prev <= b_key).to(tl.int32), 0) == 0:
        b_key = tl.sort(b_key)
    o_next = tl.minimum(o_w + 1, BLOCK_W - 1)
    b_next = tl.gather(b_key, o_next, 0)

    m_valid = b_key != INT32_MAX
    b_unit = b_key >> UNIT_SHIFT
    m_emit = m_valid & ((b_unit != (b_next >> UNIT_SHIFT)) | (o_w == BLOCK_W - 1))
    b_slot = tl.cumsum(m_emit.to(tl.int32), 0) - 1
    count = tl.sum(m_emit.to(tl.int32), 0)
    tl.store(counts_ptr + i_r, count)
    if EMIT_TOKENS:
        tl.store(ids_ptr + i_r * stride_ids_row + b_slot, b_key, mask=m_emit)
        return

    b_bits = tl.where(m_valid, 1 << (b_key & 3), 0)
    _, b_run_bits = tl.associative_scan((b_unit, b_bits), 0, _or_within_run)
    b_emit_phys = tl.load(bt_ptr + req * stride_bt_req + b_key // BLOCK_SIZE, mask=m_emit, other=0)
    b_id = b_emit_phys * (BLOCK_SIZE // 4) + (b_key % BLOCK_SIZE) // 4
    tl.store(ids_ptr + i_r * stride_ids_row + b_slot, b_id, mask=m_emit)
    tl.store(masks_ptr + i_r * stride_masks_row + b_slot, b_run_bits.to(tl.uint8), mask=m_emit)

    # Pad to a whole tile with (first id, mask 0): a real, used microblock.
    first_id = tl.sum(tl.where(m_emit & (b_slot == 0), b_id, 0), 0)
    o_pad = count + tl.arange(0, PAD)
    m_pad = o_pad < (count + PAD - 1) // PAD * PAD
    tl.store(ids_ptr + i_r * stride_ids_row + o_pad, tl.zeros([PAD], tl.int32) + first_id, mask=m_pad)
    tl.store(masks_ptr + i_r * stride_masks_row + o_pad, tl.zeros([PAD], tl.uint8), mask=m_pad)


@triton.jit
def _hash_slot(b_id, table_mask):
    h = b_id.to(tl.uint32) * 2654435761
    h = h ^ (h >> 15)
    return (h & table_mask.to(tl.uint32)).to(tl.int32)


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
    slot_ptr,  # [programs, GROUP_ROWS * cap_s] int32 scratch: table slot of each entry
    num_rows,
    num_groups,
    num_programs,
    stride_s_ids,
    stride_s_masks,
    stride_g_ids,
    stride_g_masks,
    cap_s,
    GROUP_ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    TABLE: tl.constexpr,
    PAD: tl.constexpr,
):
    """Union of each group's single-row lists by physical id, emitted by first-occurrence key (q, j).

    The key of an entry is (group row q, index j in q's list): logical data only. A hash table in
    per-program scratch collects, for every physical id, the minimum key (atomic_min) and the OR of
    row-shifted masks (atomic_or); both are order-independent, so the plan does not depend on which
    thread wins a slot or where pages live. Emission then walks the entries in key order and keeps
    those whose key is their id's minimum.
    """
    pid = tl.program_id(0)
    p_tab_id = tab_id_ptr + pid.to(tl.int64) * TABLE
    p_tab_key = tab_key_ptr + pid.to(tl.int64) * TABLE
    p_tab_mask = tab_mask_ptr + pid.to(tl.int64) * TABLE
    p_slot = slot_ptr + pid.to(tl.int64) * GROUP_ROWS * cap_s
    o_c = tl.arange(0, CHUNK)

    g = pid
    while g < num_groups:
        row0 = g.to(tl.int64) * GROUP_ROWS
        total = 0
        for q in range(GROUP_ROWS):
            total += tl.load(s_counts_ptr + row0 + q, mask=row0 + q < num_rows, other=0)
        # Power-of-two table at least twice the entries (entries >= distinct ids).
        table_size = 2
        while table_size < tl.minimum(2 * total, TABLE):
            table_size *= 2
        table_mask = table_size - 1

        # Phase 1: insert every entry; remember its slot.
        for q in range(GROUP_ROWS):
            r = row0 + q
            n_q = tl.load(s_counts_ptr + r, mask=r < num_rows, other=0)
            for c in range(0, n_q, CHUNK):
                o_j = c + o_c
                m_j = o_j < n_q
                b_id = tl.load(s_ids_ptr + r * stride_s_ids + o_j, mask=m_j, other=0)
                b_mask = tl.load(s_masks_ptr + r * stride_s_masks + o_j, mask=m_j, other=0).to(tl.int32)
                b_h = _hash_slot(b_id, table_mask)
                m_active = m_j
                while tl.max(m_active.to(tl.int32), 0) > 0:
                    # Inactive lanes compare against an impossible value: the CAS is a no-op read.
                    b_cmp = tl.where(m_active, EMPTY, -2)
                    b_old = tl.atomic_cas(p_tab_id + b_h, b_cmp, b_id)
                    m_hit = m_active & ((b_old == EMPTY) | (b_old == b_id))
                    tl.store(p_slot + q * cap_s + o_j, b_h, mask=m_hit)
                    m_active = m_active & ~m_hit
                    b_h = tl.where(m_active, (b_h + 1) & table_mask, b_h)
                tl.atomic_min(p_tab_key + b_h, (q << 24) | o_j, mask=m_j)
                tl.atomic_or(p_tab_mask + b_h, b_mask << (4 * q), mask=m_j)
        tl.debug_barrier()

        # Phase 2: emit in key order the entries that are their id's first occurrence.
        base = 0
        first_id = 0
        for q in range(GROUP_ROWS):
            r = row0 + q
            n_q = tl.load(s_counts_ptr + r, mask=r < num_rows, other=0)
            for c in range(0, n_q, CHUNK):
                o_j = c + o_c
                m_j = o_j < n_q
                b_id = tl.load(s_ids_ptr + r * stride_s_ids + o_j, mask=m_j, other=0)
                b_h = tl.load(p_slot + q * cap_s + o_j, mask=m_j, other=0, cache_modifier=".cg")
                b_min = tl.load(p_tab_key + b_h, mask=m_j, other=-1, cache_modifier=".cg")
                m_rep = m_j & (b_min == ((q << 24) | o_j))
                b_pos = base + tl.cumsum(m_rep.to(tl.int32), 0) - 1
                b_gmask = tl.load(p_tab_mask + b_h, mask=m_rep, other=0, cache_modifier=".cg")
                tl.store(g_ids_ptr + g * stride_g_ids + b_pos, b_id, mask=m_rep)
                tl.store(g_masks_ptr + g * stride_g_masks + b_pos, b_gmask, mask=m_rep)
                first_id = tl.where(base == 0, tl.sum(tl.where(m_rep & (b_pos == 0), b_id, 0), 0), first_id)
                base += tl.sum(m_rep.to(tl.int32), 0)
        tl.store(g_counts_ptr + g, base)
        o_pad = base + tl.arange(0, PAD)
        m_pad = o_pad < (base + PAD - 1) // PAD * PAD
        tl.store(g_ids_ptr + g * stride_g_ids + o_pad, tl.zeros([PAD], tl.int32) + first_id, mask=m_pad)
        tl.store(g_masks_ptr + g * stride_g_masks + o_pad, tl.zeros([PAD], tl.int32), mask=m_pad)
        tl.debug_barrier()

        # Phase 3: leave the table empty for the next group (only the touched slots).
        for q in range(GROUP_ROWS):
            r = row0 + q
            n_q = tl.load(s_counts_ptr + r, mask=r < num_rows, other=0)
            for c in range(0, n_q, CHUNK):
                o_j = c + o_c
                m_j = o_j < n_q
                b_h = tl.load(p_slot + q * cap_s + o_j, mask=m_j, other=0, cache_modifier=".cg")
                tl.store(p_tab_id + b_h, tl.zeros([CHUNK], tl.int32) + EMPTY, mask=m_j)
                tl.store(p_tab_key + b_h, tl.zeros([CHUNK], tl.int32) + INT32_MAX, mask=m_j)
                tl.store(p_tab_mask + b_h, tl.zeros([CHUNK], tl.int32), mask=m_j)
        tl.debug_barrier()
        g += num_programs
