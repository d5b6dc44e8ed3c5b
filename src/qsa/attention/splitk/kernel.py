"""Generic split-K sparse paged attention over token lists: the baseline and fallback route.

Each program takes one row, one KV head and one fixed-size run of the row's token list, gathers
K/V token by token through the block table, and writes fp32 partials that ``merge_splits_kernel``
combines in a fixed order. Any G works (the head tile is padded to a power of two >= 16). With
``HALVES`` (``qsa.attention.splitk.launch.splitk_config``: head_dim 256) the scores are taken over the head's column halves,
as in the xqa kernels (``attend_tile_halves``)."""

import triton
import triton.language as tl

from ..kernels import attend_kv_tokens, enter_launch, load_query, split_range, store_accumulator, zero_accumulator


@triton.jit
def splitk_attention_kernel(
    q_ptr,  # [rows, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,  # [num_blocks, block_size, Hkv, D]
    tok_ptr,  # [rows, cap] int32 sorted distinct kept logical tokens
    tok_counts_ptr,  # [rows] int32
    bt_ptr,  # [num_reqs, max_blocks] int32
    req_ptr,  # [rows] int32|int64
    gate_ptr,  # [rows, Hq, D] or unused
    out_ptr,  # [rows, Hq, D]
    lse_ptr,  # [rows, Hq] fp32 or unused
    part_acc_ptr,  # [rows, Hq, NUM_SPLITS, D] fp32 or unused
    part_ml_ptr,  # [rows, Hq, NUM_SPLITS, 2] fp32 or unused
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
    stride_tok,
    stride_bt,
    stride_o_row,
    stride_o_head,
    stride_g_row,
    stride_g_head,
    stride_lse_row,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,  # power of two >= max(G, 16)
    BLOCK_N: tl.constexpr,  # tokens per tile
    NUM_SPLITS: tl.constexpr,  # each row's tiles are cut into this many near-equal runs
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,  # K and V caches share their strides: one offset per token serves both
    DOT_DTYPE: tl.constexpr,
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    HALVES: tl.constexpr = False,  # scores over the head's column halves (attend_tile_halves)
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    enter_launch(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_kvh = tl.program_id(1).to(tl.int64)
    i_split = tl.program_id(2)

    o_m = tl.arange(0, BLOCK_G)
    o_head = i_kvh * G + o_m
    m_row = o_m < G
    o_row = tl.zeros([BLOCK_G], tl.int64) + i_r
    b_q0, b_q1 = load_query(q_ptr + i_r * stride_q_row + o_head[:, None] * stride_q_head, m_row, HEAD_DIM, HALVES,
                            DOT_DTYPE)

    count = tl.load(tok_counts_ptr + i_r)
    req = tl.load(req_ptr + i_r).to(tl.int64)
    o_n = tl.arange(0, BLOCK_N)
    tile_start, tile_end = split_range(tl.cdiv(count, BLOCK_N), i_split, NUM_SPLITS)
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc0, b_acc1 = zero_accumulator(BLOCK_G, HEAD_DIM, HALVES)
    for i_t in range(tile_start, tile_end):
        o_e = i_t * BLOCK_N + o_n
        m_n = o_e < count
        b_t = tl.load(tok_ptr + i_r * stride_tok + o_e, mask=m_n, other=0)
        b_phys = tl.load(bt_ptr + req * stride_bt + b_t // BLOCK_SIZE, mask=m_n, other=0)
        b_m, b_l, b_acc0, b_acc1 = attend_kv_tokens(b_q0, b_q1, b_t, b_phys, m_n, m_row, i_kvh, k_ptr, v_ptr, b_m, b_l,
                                                    b_acc0, b_acc1, qk_scale, stride_k_block, stride_k_tok,
                                                    stride_k_head, stride_v_block, stride_v_tok, stride_v_head,
                                                    BLOCK_SIZE, SAME_KV_STRIDES, HEAD_DIM, HALVES, KV_FP8, DOT_DTYPE)

    store_accumulator(b_acc0, b_acc1, b_m, b_l, o_row, o_head, m_row, o_row, i_split, out_ptr, gate_ptr, lse_ptr,
                      part_acc_ptr, part_ml_ptr, v_scale, Hq, stride_o_row, stride_o_head, stride_g_row,
                      stride_g_head, stride_lse_row, NUM_SPLITS, HEAD_DIM, HAS_GATE, RETURN_LSE, HALVES)
