"""Single-row ("XQA") attention: all G query heads of a KV head in one tile, the row's list cut at
fixed positions into splits, partials combined by ``merge_splits_kernel``.

Two kernels: ``xqa_attention_kernel`` reads the page4 single-row plan (microblocks, built by the
planner's own launch); ``xqa_direct_kernel`` builds each row's token list from ``indices`` itself, for
small batches whose rows come sorted (no plan launch). With its row check deferred, the direct kernel's
splits are merged by ``xqa_direct_merge_kernel``, which also recomputes a row found out of order."""

import triton
import triton.language as tl

from ..kernels import (ascending_limit, attend_kv, attend_kv_tokens, direct_row_list, enter_launch,
                       list_entries, load_query, load_split_partials, merge_split_partials, row_setup, row_width,
                       split_ascends, split_range, store_accumulator, store_partials, zero_accumulator)


@triton.jit
def xqa_attention_kernel(
    q_ptr,  # [rows, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,  # [num_blocks, block_size, Hkv, D]
    ids_ptr,  # [rows, cap] int32 physical microblock ids (single-row plan)
    masks_ptr,  # [rows, cap] uint8 bit t % 4
    counts_ptr,  # [rows] int32
    gate_ptr,  # [rows, Hq, D] or unused
    out_ptr,  # [rows, Hq, D]
    lse_ptr,  # [rows, Hq] fp32 or unused
    part_acc_ptr,  # [n, Hq, NUM_SPLITS, D] fp32 or unused
    part_ml_ptr,  # [n, Hq, NUM_SPLITS, 2] fp32 or unused
    row_offset,  # rows [row_offset, row_offset + n) are computed by this launch
    cut_tiles,  # splits cut max(cut_tiles, the row's tiles) tiles (0: the row's own; see launch.xqa_cut)
    Hq,
    qk_scale,
    v_scale,
    stride_q_row,
    stride_q_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    stride_ids,
    stride_masks,
    stride_o_row,
    stride_o_head,
    stride_g_row,
    stride_g_head,
    stride_lse_row,
    G: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # power of two >= max(G, 16)
    MB: tl.constexpr,  # microblocks per tile (tile = 4 * MB tokens)
    NUM_SPLITS: tl.constexpr,  # each row's tiles are cut into this many near-equal runs
    PREFETCH: tl.constexpr,  # load the next tile's plan entries one iteration ahead
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,  # K and V caches share their strides: one offset per token serves both
    DOT_DTYPE: tl.constexpr,
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    HALVES: tl.constexpr = False,  # scores over the head's column halves (attend_tile_halves), as the direct kernel
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    enter_launch(PDL)
    BLOCK_N: tl.constexpr = 4 * MB
    MB_PER_BLOCK: tl.constexpr = BLOCK_SIZE // 4
    i_local = tl.program_id(0).to(tl.int64)
    i_kvh = tl.program_id(1).to(tl.int64)
    i_split = tl.program_id(2)
    i_r = i_local + row_offset

    o_m = tl.arange(0, BLOCK_G)
    o_head = i_kvh * G + o_m
    m_row = o_m < G
    o_row = tl.zeros([BLOCK_G], tl.int64) + i_r
    b_q, b_q1 = load_query(q_ptr + i_r * stride_q_row + o_head[:, None] * stride_q_head, m_row, HEAD_DIM, HALVES,
                           DOT_DTYPE)

    o_n = tl.arange(0, BLOCK_N)
    o_slot = o_n % 4
    count = tl.load(counts_ptr + i_r)
    # Cut as the direct kernel cuts its W positions where the launch says so: a row of whole 4-token blocks
    # then gets the same splits of the same tiles from either kernel.
    n_tiles = tl.cdiv(count, MB)
    tile_start, tile_end = split_range(tl.maximum(n_tiles, cut_tiles), i_split, NUM_SPLITS)
    tile_end = tl.minimum(tile_end, n_tiles)
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc, b_acc1 = zero_accumulator(BLOCK_G, HEAD_DIM, HALVES)
    if PREFETCH:
        # Each tile's plan entries are loaded one iteration ahead, so the K/V loads do not wait on a
        # load of their own iteration and can be issued num_stages - 1 tiles ahead.
        o_e = tile_start * MB + o_n // 4
        b_id_next = tl.load(ids_ptr + i_r * stride_ids + o_e, mask=o_e < count, other=0)
        b_bits_next = tl.load(masks_ptr + i_r * stride_masks + o_e, mask=o_e < count, other=0)
    for i_t in range(tile_start, tile_end):
        o_e = i_t * MB + o_n // 4
        m_n = o_e < count
        if PREFETCH:
            b_id = b_id_next
            b_bits = b_bits_next.to(tl.int32)
            b_id_next = tl.load(ids_ptr + i_r * stride_ids + o_e + MB, mask=o_e + MB < count, other=0)
            b_bits_next = tl.load(masks_ptr + i_r * stride_masks + o_e + MB, mask=o_e + MB < count, other=0)
        else:
            b_id = tl.load(ids_ptr + i_r * stride_ids + o_e, mask=m_n, other=0)
            b_bits = tl.load(masks_ptr + i_r * stride_masks + o_e, mask=m_n, other=0).to(tl.int32)
        o_blk = (b_id // MB_PER_BLOCK).to(tl.int64)
        o_in = (b_id % MB_PER_BLOCK) * 4 + o_slot
        o_ktok = o_blk * stride_k_block + o_in * stride_k_tok + i_kvh * stride_k_head
        if SAME_KV_STRIDES:
            o_vtok = o_ktok
        else:
            o_vtok = o_blk * stride_v_block + o_in * stride_v_tok + i_kvh * stride_v_head
        m_used = m_n & (((b_bits >> o_slot) & 1) != 0)
        b_m, b_l, b_acc, b_acc1 = attend_kv(b_q, b_q1, o_ktok, o_vtok, m_used, m_used[None, :] & m_row[:, None], k_ptr,
                                            v_ptr, b_m, b_l, b_acc, b_acc1, qk_scale, HEAD_DIM, HALVES, KV_FP8,
                                            DOT_DTYPE)

    store_accumulator(b_acc, b_acc1, b_m, b_l, o_row, o_head, m_row, o_row - row_offset, i_split, out_ptr, gate_ptr,
                      lse_ptr, part_acc_ptr, part_ml_ptr, v_scale, Hq, stride_o_row, stride_o_head, stride_g_row,
                      stride_g_head, stride_lse_row, NUM_SPLITS, HEAD_DIM, HAS_GATE, RETURN_LSE, HALVES)


@triton.jit
def _previous_entries(p_idx, o_pos, n_pos):
    """The entry before each position ``o_pos`` (< ``n_pos``) of the row, as unsigned numbers (for
    ``split_ascends``)."""
    m_in = (o_pos >= 1) & (o_pos < n_pos)
    return tl.load(p_idx + o_pos - 1, mask=m_in, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def xqa_direct_kernel(
    q_ptr,  # [rows, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,  # [num_blocks, block_size, Hkv, D]
    idx_ptr,  # [rows, W] int32 token indices
    bt_ptr,  # [num_reqs, max_blocks] int32
    req_ptr,  # [rows] int32|int64
    pos_ptr,  # [rows] int64
    seq_lens_ptr,  # [num_reqs] int32
    scratch_ptr,  # [rows, >= BLOCK_W] int32 (rows not in ascending order)
    idx_count_ptr,  # [rows] int32 index_counts with HAS_COUNTS; else None (no parameter)
    gate_ptr,  # [rows, Hq, D] or unused
    out_ptr,  # [rows, Hq, D]
    lse_ptr,  # [rows, Hq] fp32 or unused
    part_acc_ptr,  # [n, Hq, NUM_SPLITS, D] fp32 or unused
    part_ml_ptr,  # [n, Hq, NUM_SPLITS, 2] fp32 or unused
    row_offset,  # rows [row_offset, row_offset + n) are computed by this launch
    W,
    num_reqs,
    max_blocks,
    num_blocks,
    Hq,
    qk_scale,
    v_scale,
    stride_q_row,
    stride_q_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    stride_idx_row,
    stride_scratch_row,
    stride_bt,
    stride_o_row,
    stride_o_head,
    stride_g_row,
    stride_g_head,
    stride_lse_row,
    stride_idx_count,  # index_counts row stride with HAS_COUNTS; else None
    G: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # power of two >= max(G, 16)
    BLOCK_N: tl.constexpr,  # tokens per K/V tile
    BLOCK_W: tl.constexpr,  # power of two >= W
    NUM_SPLITS: tl.constexpr,  # each row's tiles are cut into this many near-equal runs
    PREFETCH: tl.constexpr,  # load the next tile's tokens and pages one iteration ahead (the first: during the check)
    SPLIT_N: tl.constexpr,  # 0, or a power of two >= the split's entries: all of them resolved before the loop
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    DEFER_CHECK: tl.constexpr = False,  # (SPLIT_N > 0, NUM_SPLITS > 1) check only the split's positions
    HALVES: tl.constexpr = False,  # scores as two products over the head's column halves (attend_tile_halves)
    HAS_COUNTS: tl.constexpr = False,  # a row reads only its first index_counts entries (row_width)
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    """xqa without a planner launch: each program takes its split of the W positions of its row's
    list, which is the row of ``indices`` itself when it ascends and a sorted copy otherwise (see
    ``direct_row_list``), and gathers K/V token by token through the block table, dropping tokens the
    row does not keep and tokens whose table entry is not a block of the cache. With ``SPLIT_N`` the
    program reads all of its split's tokens and pages before its loop and each tile takes its own from
    registers; otherwise each tile loads its own (``PREFETCH``: one tile ahead).

    With ``DEFER_CHECK`` a program checks only its split's positions (``split_ascends``) and attends
    the split as given; a split that fails stores the sum -1 in its partial, and the merge
    (``xqa_direct_merge_kernel``) recomputes every split of such a row from its sorted list. The row
    check and the sort leave this kernel: no program checks the whole row before its first K/V load.

    Tiles and splits are cut from the ``W`` positions; the row's entries are its first ``n_w``
    (``row_width``: ``W``, or its count with ``HAS_COUNTS``), and no load reads one past them: a row with a
    count gets the bits of the same row with -1 past its count."""
    enter_launch(PDL)
    i_local = tl.program_id(0).to(tl.int64)
    i_kvh = tl.program_id(1).to(tl.int64)
    i_split = tl.program_id(2)
    i_r = i_local + row_offset

    o_m = tl.arange(0, BLOCK_G)
    o_head = i_kvh * G + o_m
    m_row = o_m < G
    o_row = tl.zeros([BLOCK_G], tl.int64) + i_r
    req, pos, seq_len, row_ok = row_setup(req_ptr, pos_ptr, seq_lens_ptr, i_r, num_reqs)
    p_idx = idx_ptr + i_r * stride_idx_row
    n_w = row_width(idx_count_ptr, i_r, stride_idx_count, W, HAS_COUNTS)
    p_bt = bt_ptr + req * stride_bt
    b_q, b_q1 = load_query(q_ptr + i_r * stride_q_row + o_head[:, None] * stride_q_head, m_row, HEAD_DIM, HALVES,
                           DOT_DTYPE)

    # Splits cut the W list positions, so they are known before the row is checked.
    o_n = tl.arange(0, BLOCK_N)
    tile_start, tile_end = split_range(tl.cdiv(W, BLOCK_N), i_split, NUM_SPLITS)
    if SPLIT_N > 0:
        # Every entry of the split (tokens and pages), read from the row as given while the row is
        # checked; the tiles then take theirs from registers, so no K/V load waits on a list or table
        # load of its own tile and the pipeline can issue them num_stages - 1 tiles ahead.
        o_s = tl.arange(0, SPLIT_N)
        n_split = tl.minimum(n_w, tile_end * BLOCK_N)
        if DEFER_CHECK:  # loaded first, so that they do not wait behind the table loads
            u_prev = _previous_entries(p_idx, tile_start * BLOCK_N + o_s, n_split)
        b_ts, b_ps = list_entries(p_idx, tile_start * BLOCK_N + o_s, n_split, p_bt, pos, seq_len, row_ok,
                                   max_blocks, BLOCK_SIZE)
    elif PREFETCH:  # the first tile's entries, read from the row as given while the row is checked
        b_t_next, b_phys_next = list_entries(p_idx, tile_start * BLOCK_N + o_n, n_w, p_bt, pos, seq_len, row_ok,
                                              max_blocks, BLOCK_SIZE)
    if DEFER_CHECK:
        tl.static_assert(SPLIT_N > 0 and NUM_SPLITS > 1, "DEFER_CHECK needs resolved splits")
    else:
        p_list, n_list, ascending = direct_row_list(p_idx, scratch_ptr + i_r * stride_scratch_row, pos, row_ok,
                                                     n_w, max_blocks, BLOCK_SIZE, BLOCK_W)
        if SPLIT_N > 0:
            if not ascending:
                b_ts, b_ps = list_entries(p_list, tile_start * BLOCK_N + o_s,
                                           tl.minimum(n_list, tile_end * BLOCK_N), p_bt, pos, seq_len, row_ok,
                                           max_blocks, BLOCK_SIZE)
        elif PREFETCH:
            if not ascending:
                b_t_next, b_phys_next = list_entries(p_list, tile_start * BLOCK_N + o_n, n_list, p_bt, pos,
                                                      seq_len, row_ok, max_blocks, BLOCK_SIZE)
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc, b_acc1 = zero_accumulator(BLOCK_G, HEAD_DIM, HALVES)
    for i_t in range(tile_start, tile_end):
        o_e = i_t * BLOCK_N + o_n
        if SPLIT_N > 0:
            # Clamped: the software pipeline also evaluates this for tiles past the split's end (whose
            # loads it masks off), and the gather must not read past its source there (unclamped, mtp-8
            # with 9 splits of 256 entries faulted on the H200; compute-sanitizer is clean with it).
            o_l = tl.minimum((i_t - tile_start) * BLOCK_N, SPLIT_N - BLOCK_N) + o_n
            b_t = tl.gather(b_ts, o_l, 0)
            b_phys = tl.gather(b_ps, o_l, 0)
        elif PREFETCH:
            b_t = b_t_next
            b_phys = b_phys_next
            b_t_next, b_phys_next = list_entries(p_list, o_e + BLOCK_N, n_list, p_bt, pos, seq_len, row_ok,
                                                  max_blocks, BLOCK_SIZE)
        else:
            b_t, b_phys = list_entries(p_list, o_e, n_list, p_bt, pos, seq_len, row_ok, max_blocks, BLOCK_SIZE)
        m_n = (b_phys >= 0) & (b_phys < num_blocks)
        b_m, b_l, b_acc, b_acc1 = attend_kv_tokens(b_q, b_q1, b_t, b_phys, m_n, m_row, i_kvh, k_ptr, v_ptr, b_m, b_l,
                                                   b_acc, b_acc1, qk_scale, stride_k_block, stride_k_tok,
                                                   stride_k_head, stride_v_block, stride_v_tok, stride_v_head,
                                                   BLOCK_SIZE, SAME_KV_STRIDES, HEAD_DIM, HALVES, KV_FP8, DOT_DTYPE)
    if DEFER_CHECK:
        # Checked after the loop, which does not wait for it: a split that fails stores the sum -1, and
        # the merge recomputes the row (a sum is never negative).
        ascending = split_ascends(b_ts, u_prev, tile_start * BLOCK_N + o_s, n_split,
                                   ascending_limit(pos, row_ok, max_blocks, BLOCK_SIZE))
        b_l = tl.where(ascending, b_l, -1.0)

    store_accumulator(b_acc, b_acc1, b_m, b_l, o_row, o_head, m_row, o_row - row_offset, i_split, out_ptr, gate_ptr,
                      lse_ptr, part_acc_ptr, part_ml_ptr, v_scale, Hq, stride_o_row, stride_o_head, stride_g_row,
                      stride_g_head, stride_lse_row, NUM_SPLITS, HEAD_DIM, HAS_GATE, RETURN_LSE, HALVES)


@triton.jit(noinline=True)  # out of line: inlined, the direct step was 0.4-1 us slower on the H200
def _recompute_splits(q_ptr, k_ptr, v_ptr, idx_ptr, bt_ptr, req_ptr, pos_ptr, seq_lens_ptr, scratch_ptr,
                      idx_count_ptr, redo_acc_ptr, redo_ml_ptr, i_local, i_h, row_offset, W, num_reqs, max_blocks,
                      num_blocks, Hq, qk_scale, stride_q_row, stride_q_head, stride_k_block, stride_k_tok,
                      stride_k_head, stride_v_block, stride_v_tok, stride_v_head, stride_idx_row, stride_scratch_row,
                      stride_bt, stride_idx_count, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_W: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, SAME_KV_STRIDES: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, HALVES: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """Every split of partial row ``i_local``, attended again from its sorted list as
    ``xqa_direct_kernel`` attends a row out of order (its tiles and steps, tile by tile), stored for
    head ``i_h`` only, into the redo partials (never the direct kernel's, which every program of the
    row and head reads first)."""
    i_r = i_local + row_offset
    i_kvh = i_h // G
    o_m = tl.arange(0, BLOCK_G)
    o_head = i_kvh * G + o_m
    m_row = o_m < G
    o_row = tl.zeros([BLOCK_G], tl.int64) + i_local
    req, pos, seq_len, row_ok = row_setup(req_ptr, pos_ptr, seq_lens_ptr, i_r, num_reqs)
    p_bt = bt_ptr + req * stride_bt
    b_q, b_q1 = load_query(q_ptr + i_r * stride_q_row + o_head[:, None] * stride_q_head, m_row, HEAD_DIM, HALVES,
                           DOT_DTYPE)
    n_w = row_width(idx_count_ptr, i_r, stride_idx_count, W, HAS_COUNTS)
    p_list, n_list, ascending = direct_row_list(idx_ptr + i_r * stride_idx_row,
                                                 scratch_ptr + i_r * stride_scratch_row, pos, row_ok, n_w,
                                                 max_blocks, BLOCK_SIZE, BLOCK_W)
    o_n = tl.arange(0, BLOCK_N)
    for i_split in range(NUM_SPLITS):
        tile_start, tile_end = split_range(tl.cdiv(W, BLOCK_N), i_split, NUM_SPLITS)
        b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_G], tl.float32)
        b_acc, b_acc1 = zero_accumulator(BLOCK_G, HEAD_DIM, HALVES)
        for i_t in range(tile_start, tile_end):
            b_t, b_phys = list_entries(p_list, i_t * BLOCK_N + o_n, n_list, p_bt, pos, seq_len, row_ok,
                                        max_blocks, BLOCK_SIZE)
            m_n = (b_phys >= 0) & (b_phys < num_blocks)
            b_m, b_l, b_acc, b_acc1 = attend_kv_tokens(b_q, b_q1, b_t, b_phys, m_n, m_row, i_kvh, k_ptr, v_ptr, b_m,
                                                       b_l, b_acc, b_acc1, qk_scale, stride_k_block, stride_k_tok,
                                                       stride_k_head, stride_v_block, stride_v_tok, stride_v_head,
                                                       BLOCK_SIZE, SAME_KV_STRIDES, HEAD_DIM, HALVES, KV_FP8,
                                                       DOT_DTYPE)
        store_partials(b_acc, b_acc1, b_m, b_l, o_row, o_head, m_row & (o_head == i_h), i_split, redo_acc_ptr,
                       redo_ml_ptr, Hq, NUM_SPLITS, HEAD_DIM, HALVES)


@triton.jit
def xqa_direct_merge_kernel(
    part_acc_ptr,  # [n, Hq, NUM_SPLITS, D] fp32
    part_ml_ptr,  # [n, Hq, NUM_SPLITS, 2] fp32
    redo_acc_ptr,  # [n, Hq, NUM_SPLITS, D] fp32: the partials of a row recomputed here
    redo_ml_ptr,  # [n, Hq, NUM_SPLITS, 2] fp32
    out_ptr,  # [rows, Hq, D]
    gate_ptr,  # [rows, Hq, D] or unused
    lse_ptr,  # [rows, Hq] fp32 or unused
    # xqa_direct_kernel's inputs, for a row whose splits found it out of order:
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    bt_ptr,
    req_ptr,
    pos_ptr,
    seq_lens_ptr,
    scratch_ptr,
    idx_count_ptr,
    row_offset,
    W,
    num_reqs,
    max_blocks,
    num_blocks,
    Hq,
    qk_scale,
    v_scale,
    stride_q_row,
    stride_q_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    stride_idx_row,
    stride_scratch_row,
    stride_bt,
    stride_o_row,
    stride_o_head,
    stride_g_row,
    stride_g_head,
    stride_lse_row,
    stride_idx_count,  # index_counts row stride with HAS_COUNTS; else None
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # power of two >= NUM_SPLITS
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    BLOCK_D: tl.constexpr,  # columns per program (a divisor of HEAD_DIM); grid axis 2 = HEAD_DIM // BLOCK_D
    HALVES: tl.constexpr = False,  # as the direct kernel was launched
    HAS_COUNTS: tl.constexpr = False,  # as the direct kernel was launched
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    """``merge_splits_kernel`` (one program per row, head and ``BLOCK_D`` columns) for ``xqa_direct_kernel`` with
    ``DEFER_CHECK``. A row none of whose splits stored a negative sum ascends and is merged as it is.
    Any other row is sorted (``direct_row_list``), and each of its splits is attended again from the
    sorted list, tile by tile, with the direct kernel's tiles and steps: the partials are bitwise those
    that the direct kernel computes for an unsorted row without the deferred check. The program stores
    them for its own head (all columns: a head's column programs store the same values) in the redo
    partials, then merges them as it would have merged the direct kernel's. The direct kernel's partials
    are only read here, so every column program of a head sees the same negative sum and takes the same
    branch in whatever order they run (rewritten in place, a program loading after another had rewritten
    some of the splits could merge a mix of old and recomputed ones)."""
    enter_launch(PDL)
    i_local = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    o_d = tl.program_id(2).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    b_ms, b_ls, b_a = load_split_partials(part_acc_ptr, part_ml_ptr, i_local, i_h, o_d, Hq, NUM_SPLITS, BLOCK_S,
                                          HEAD_DIM)
    if tl.min(b_ls, 0) < 0:
        _recompute_splits(q_ptr, k_ptr, v_ptr, idx_ptr, bt_ptr, req_ptr, pos_ptr, seq_lens_ptr, scratch_ptr,
                          idx_count_ptr, redo_acc_ptr, redo_ml_ptr, i_local, i_h, row_offset, W, num_reqs, max_blocks,
                          num_blocks, Hq, qk_scale, stride_q_row, stride_q_head, stride_k_block, stride_k_tok,
                          stride_k_head, stride_v_block, stride_v_tok, stride_v_head, stride_idx_row,
                          stride_scratch_row, stride_bt, stride_idx_count, G, BLOCK_G, BLOCK_N, BLOCK_W, NUM_SPLITS,
                          HEAD_DIM, BLOCK_SIZE, KV_FP8, SAME_KV_STRIDES, DOT_DTYPE, HALVES, HAS_COUNTS)
        tl.debug_barrier()  # the partials are written before they are read back
        b_ms, b_ls, b_a = load_split_partials(redo_acc_ptr, redo_ml_ptr, i_local, i_h, o_d, Hq, NUM_SPLITS,
                                              BLOCK_S, HEAD_DIM)
    merge_split_partials(b_ms, b_ls, b_a, i_local + row_offset, i_h, o_d, out_ptr, gate_ptr, lse_ptr, v_scale,
                         stride_o_row, stride_o_head, stride_g_row, stride_g_head, stride_lse_row, HAS_GATE,
                         RETURN_LSE)
