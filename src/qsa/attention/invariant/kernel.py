"""Batch-invariant attention: every row on its own, its list cut into splits of a fixed number of tiles at
fixed positions, the splits folded into the result one after another in list order. Nothing a row's bits
depend on comes from the batch (its size, the other rows, the row's place in it, the SM count).

Two kernels that give the same bits: ``invariant_attention_kernel`` either folds its row's splits itself
(``FOLD``: one program per row and KV head) or stores each split's partial (one program per split), which
``invariant_merge_kernel`` then folds in the same order with the same arithmetic (``fold_weights``,
``fold_accumulator``)."""

import triton
import triton.language as tl

from ..kernels import (attend_kv_tokens, direct_row_list, enter_launch, list_entries, load_query, row_setup,
                       row_width, store_accumulator, store_output, store_partials, zero_accumulator)


@triton.jit
def fold_weights(b_m, b_l, b_ms, b_ls):
    """Folding a split's (max ``b_ms``, sum ``b_ls``) into a running (``b_m``, ``b_l``), log2 domain:
    (new max, new sum, weight of the running accumulator, weight of the split's, whether the split counts).

    A split that attended nothing (sum exactly 0) leaves the running values as they are, so splits past a
    row's list change no bit. The products are explicit fused multiply-adds, so every kernel that folds
    rounds alike."""
    m_new = tl.maximum(b_m, b_ms)
    # Nothing attended yet on either side: shift by 0 so that exp2 gives 0, not NaN.
    b_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    w_old = tl.exp2(b_m - b_shift)
    w_new = tl.exp2(b_ms - b_shift)
    m_used = b_ls != 0  # a NaN sum counts, so that a non-finite split shows in the result
    l_new = tl.fma(b_l, w_old, b_ls * w_new)
    return tl.where(m_used, m_new, b_m), tl.where(m_used, l_new, b_l), w_old, w_new, m_used


@triton.jit
def fold_accumulator(b_acc, b_as, w_old, w_new, m_used):
    """The running accumulator ``b_acc`` after folding a split's ``b_as`` with ``fold_weights``' weights."""
    return tl.where(m_used[:, None], tl.fma(b_acc, w_old[:, None], b_as * w_new[:, None]), b_acc)


@triton.jit
def invariant_attention_kernel(
    q_ptr,  # [rows, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,  # [num_blocks, block_size, Hkv, D]
    idx_ptr,  # [rows, W] int32 token indices
    bt_ptr,  # [num_reqs, max_blocks] int32
    req_ptr,  # [rows] int32|int64
    pos_ptr,  # [rows] int64
    seq_lens_ptr,  # [num_reqs] int32
    scratch_ptr,  # [rows, >= BLOCK_W] int32 (lists of rows not in ascending order)
    idx_count_ptr,  # [rows] int32 index_counts with HAS_COUNTS; else None (no parameter)
    gate_ptr,  # [rows, Hq, D] or unused
    out_ptr,  # [rows, Hq, D]
    lse_ptr,  # [rows, Hq] fp32 or unused
    part_acc_ptr,  # [rows, Hq, NUM_SPLITS, D] fp32 (without FOLD)
    part_ml_ptr,  # [rows, Hq, NUM_SPLITS, 2] fp32 (without FOLD)
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
    SPLIT_TILES: tl.constexpr,  # tiles per split: split s is list tiles [s * SPLIT_TILES, (s + 1) * SPLIT_TILES)
    NUM_SPLITS: tl.constexpr,  # splits of a W-long list (grid axis 2 without FOLD)
    SPLIT_N: tl.constexpr,  # power of two >= SPLIT_TILES * BLOCK_N: a split's entries, held in registers
    FOLD: tl.constexpr,  # one program per row and KV head folds every split itself and stores the output
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    HALVES: tl.constexpr = False,  # scores over the head's column halves (attend_tile_halves)
    HAS_COUNTS: tl.constexpr = False,  # a row reads only its first index_counts entries (row_width)
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    """Each program reads its row's list from ``indices`` (the row itself when it ascends, else its tokens
    sorted into the row's scratch row, as ``xqa_direct_kernel`` does) and gathers K/V token by token
    through the block table, dropping what the row does not keep. A list's tiles sit at positions fixed by
    the list alone, and the split geometry (``BLOCK_N``, ``SPLIT_TILES``) and the tile's layout
    (``BLOCK_G``, the warps, ``HALVES``) by the shape alone. The row is its first ``n_w`` entries
    (``row_width``: ``W``, or its count with ``HAS_COUNTS``), none past them read: a count changes the bits
    no more than a narrower ``indices`` would, that is not at all."""
    enter_launch(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_kvh = tl.program_id(1).to(tl.int64)
    i_split = tl.program_id(2)

    o_m = tl.arange(0, BLOCK_G)
    o_head = i_kvh * G + o_m
    m_row = o_m < G
    o_row = tl.zeros([BLOCK_G], tl.int64) + i_r
    req, pos, seq_len, row_ok = row_setup(req_ptr, pos_ptr, seq_lens_ptr, i_r, num_reqs)
    p_bt = bt_ptr + req * stride_bt
    b_q0, b_q1 = load_query(q_ptr + i_r * stride_q_row + o_head[:, None] * stride_q_head, m_row, HEAD_DIM, HALVES,
                            DOT_DTYPE)
    p_row = idx_ptr + i_r * stride_idx_row
    n_w = row_width(idx_count_ptr, i_r, stride_idx_count, W, HAS_COUNTS)
    o_n = tl.arange(0, BLOCK_N)
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc0, b_acc1 = zero_accumulator(BLOCK_G, HEAD_DIM, HALVES)
    if FOLD:
        p_list, n_list, _ = direct_row_list(p_row, scratch_ptr + i_r * stride_scratch_row, pos, row_ok, n_w,
                                             max_blocks, BLOCK_SIZE, BLOCK_W)
        n_tiles = tl.cdiv(n_list, BLOCK_N)
        # The split being attended, from a fresh online softmax; folded into (b_m, b_l, b_acc) at its last tile.
        b_ms = tl.full([BLOCK_G], float("-inf"), tl.float32)
        b_ls = tl.zeros([BLOCK_G], tl.float32)
        b_as0, b_as1 = zero_accumulator(BLOCK_G, HEAD_DIM, HALVES)
        # One loop over all the tiles (each tile's entries read a tile ahead), so that the K/V pipeline does
        # not restart at every split.
        b_t_next, b_phys_next = list_entries(p_list, o_n, n_list, p_bt, pos, seq_len, row_ok, max_blocks, BLOCK_SIZE)
        for i_t in range(0, n_tiles):
            b_t = b_t_next
            b_phys = b_phys_next
            b_t_next, b_phys_next = list_entries(p_list, (i_t + 1) * BLOCK_N + o_n, n_list, p_bt, pos, seq_len,
                                                  row_ok, max_blocks, BLOCK_SIZE)
            m_n = (b_phys >= 0) & (b_phys < num_blocks)
            b_ms, b_ls, b_as0, b_as1 = attend_kv_tokens(b_q0, b_q1, b_t, b_phys, m_n, m_row, i_kvh, k_ptr, v_ptr, b_ms,
                                                        b_ls, b_as0, b_as1, qk_scale, stride_k_block, stride_k_tok,
                                                        stride_k_head, stride_v_block, stride_v_tok, stride_v_head,
                                                        BLOCK_SIZE, SAME_KV_STRIDES, HEAD_DIM, HALVES, KV_FP8,
                                                        DOT_DTYPE)
            if ((i_t + 1) % SPLIT_TILES == 0) | (i_t + 1 == n_tiles):
                b_m, b_l, w_old, w_new, m_used = fold_weights(b_m, b_l, b_ms, b_ls)
                b_acc0 = fold_accumulator(b_acc0, b_as0, w_old, w_new, m_used)
                if HALVES:
                    b_acc1 = fold_accumulator(b_acc1, b_as1, w_old, w_new, m_used)
                b_ms = tl.full([BLOCK_G], float("-inf"), tl.float32)
                b_ls = tl.zeros([BLOCK_G], tl.float32)
                b_as0, b_as1 = zero_accumulator(BLOCK_G, HEAD_DIM, HALVES)
        store_accumulator(b_acc0, b_acc1, b_m, b_l, o_row, o_head, m_row, o_row, 0, out_ptr, gate_ptr, lse_ptr,
                          part_acc_ptr, part_ml_ptr, v_scale, Hq, stride_o_row, stride_o_head, stride_g_row,
                          stride_g_head, stride_lse_row, 1, HEAD_DIM, HAS_GATE, RETURN_LSE, HALVES)
    else:
        # The split's tokens and pages, all read before its loop (from the row as given while the row is
        # checked, again from the sorted list if it does not ascend); each tile takes its own from registers.
        start = i_split * SPLIT_TILES
        o_s = start * BLOCK_N + tl.arange(0, SPLIT_N)
        n_split = tl.minimum(n_w, (start + SPLIT_TILES) * BLOCK_N)
        b_ts, b_ps = list_entries(p_row, o_s, n_split, p_bt, pos, seq_len, row_ok, max_blocks, BLOCK_SIZE)
        p_list, n_list, ascending = direct_row_list(p_row, scratch_ptr + i_r * stride_scratch_row, pos, row_ok, n_w,
                                                     max_blocks, BLOCK_SIZE, BLOCK_W)
        if not ascending:
            b_ts, b_ps = list_entries(p_list, o_s, tl.minimum(n_list, (start + SPLIT_TILES) * BLOCK_N), p_bt, pos,
                                       seq_len, row_ok, max_blocks, BLOCK_SIZE)
        for i_t in range(start, tl.minimum(tl.cdiv(n_list, BLOCK_N), start + SPLIT_TILES)):
            # Clamped: the software pipeline also evaluates this past the split's last tile (its loads masked).
            o_l = tl.minimum((i_t - start) * BLOCK_N, SPLIT_N - BLOCK_N) + o_n
            b_t = tl.gather(b_ts, o_l, 0)
            b_phys = tl.gather(b_ps, o_l, 0)
            m_n = (b_phys >= 0) & (b_phys < num_blocks)
            b_m, b_l, b_acc0, b_acc1 = attend_kv_tokens(b_q0, b_q1, b_t, b_phys, m_n, m_row, i_kvh, k_ptr, v_ptr, b_m,
                                                        b_l, b_acc0, b_acc1, qk_scale, stride_k_block, stride_k_tok,
                                                        stride_k_head, stride_v_block, stride_v_tok, stride_v_head,
                                                        BLOCK_SIZE, SAME_KV_STRIDES, HEAD_DIM, HALVES, KV_FP8,
                                                        DOT_DTYPE)
        # A split past the end of the list stores (-inf, 0) and zeros, which the merge skips.
        store_partials(b_acc0, b_acc1, b_m, b_l, o_row, o_head, m_row, i_split, part_acc_ptr, part_ml_ptr, Hq,
                       NUM_SPLITS, HEAD_DIM, HALVES)


@triton.jit
def invariant_merge_kernel(
    part_acc_ptr,  # [rows, Hq, NUM_SPLITS, D] fp32 unnormalised partial P @ V
    part_ml_ptr,  # [rows, Hq, NUM_SPLITS, 2] fp32 (max in log2 domain, sum)
    gate_ptr,  # [rows, Hq, D] or unused
    out_ptr,  # [rows, Hq, D]
    lse_ptr,  # [rows, Hq] fp32 or unused
    Hq,
    v_scale,
    stride_o_row,
    stride_o_head,
    stride_g_row,
    stride_g_head,
    stride_lse_row,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # columns per program (a divisor of HEAD_DIM); grid axis 2 = HEAD_DIM // BLOCK_D
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """The splits of one row and KV head (``BLOCK_D`` of their columns) folded in split order, as
    ``invariant_attention_kernel`` with ``FOLD`` folds them: the same bits. The loop is unrolled, so the
    loads do not wait on the folds (sm_90: ptxas issues them 2-3 splits ahead of the fold that uses them)."""
    enter_launch(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_kvh = tl.program_id(1).to(tl.int64)
    o_d = tl.program_id(2).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    o_m = tl.arange(0, BLOCK_G)
    o_head = i_kvh * G + o_m
    m_row = o_m < G
    o_part = (i_r * Hq + o_head) * NUM_SPLITS
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for i_s in tl.static_range(NUM_SPLITS):
        b_ms = tl.load(part_ml_ptr + (o_part + i_s) * 2, mask=m_row, other=float("-inf"))
        b_ls = tl.load(part_ml_ptr + (o_part + i_s) * 2 + 1, mask=m_row, other=0.0)
        b_as = tl.load(part_acc_ptr + (o_part + i_s)[:, None] * HEAD_DIM + o_d[None, :], mask=m_row[:, None],
                       other=0.0)
        b_m, b_l, w_old, w_new, m_used = fold_weights(b_m, b_l, b_ms, b_ls)
        b_acc = fold_accumulator(b_acc, b_as, w_old, w_new, m_used)
    store_output(b_acc, b_m, b_l, tl.zeros([BLOCK_G], tl.int64) + i_r, o_head, m_row, o_d, out_ptr, gate_ptr,
                 lse_ptr, v_scale, stride_o_row, stride_o_head, stride_g_row, stride_g_head, stride_lse_row,
                 HAS_GATE, RETURN_LSE)
