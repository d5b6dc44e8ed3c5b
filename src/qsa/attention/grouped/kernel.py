"""Grouped page4 attention: each K/V microblock tile is loaded once for a group of adjacent rows x
all query heads of a KV head, with tensor-core QK^T and PV and per-row 4-bit masks from the plan."""

import triton
import triton.language as tl

from ..kernels import attend_tile, enter_launch, load_kv_microblocks, split_range, store_result


@triton.jit
def grouped_attention_kernel(
    q_ptr,  # [rows, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,  # [num_blocks, block_size, Hkv, D]
    ids_ptr,  # [groups, cap] int32 physical microblock ids (grouped plan)
    masks_ptr,  # [groups, cap] int32 bit 4q + t % 4
    counts_ptr,  # [groups] int32
    gate_ptr,  # [rows, Hq, D] or unused
    out_ptr,  # [rows, Hq, D]
    lse_ptr,  # [rows, Hq] fp32 or unused
    part_acc_ptr,  # [rows, Hq, NUM_SPLITS, D] fp32 or unused
    part_ml_ptr,  # [rows, Hq, NUM_SPLITS, 2] fp32 or unused
    num_rows,
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
    stride_plan,
    stride_o_row,
    stride_o_head,
    stride_g_row,
    stride_g_head,
    stride_lse_row,
    G: tl.constexpr,  # query heads per KV head
    GROUP_ROWS: tl.constexpr,  # rows per plan group
    ROWS_PER_PROG: tl.constexpr,  # rows of the group this program computes (divides GROUP_ROWS)
    BLOCK_M: tl.constexpr,  # power of two >= ROWS_PER_PROG * G
    MB: tl.constexpr,  # microblocks per tile (tile = 4 * MB tokens)
    NUM_SPLITS: tl.constexpr,  # each group's tiles are cut into this many near-equal runs
    PREFETCH: tl.constexpr,  # load the next tile's plan entries one iteration ahead
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    KV_FP8: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,  # K and V caches share their strides: one offset per token serves both
    LAZY_RESCALE: tl.constexpr,  # move a row's reference max only when its max grows by > RESCALE_SLACK
    DOT_DTYPE: tl.constexpr,  # operand dtype of both dots (fp32 under the interpreter for bf16)
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    PTX: tl.constexpr = False,  # GPU only: inline PTX where it helps (attend_tile)
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    enter_launch(PDL)
    SUBS: tl.constexpr = GROUP_ROWS // ROWS_PER_PROG
    BLOCK_N: tl.constexpr = 4 * MB
    MB_PER_BLOCK: tl.constexpr = BLOCK_SIZE // 4
    i_g = tl.program_id(0) // SUBS
    i_sub = tl.program_id(0) % SUBS
    i_kvh = tl.program_id(1).to(tl.int64)
    i_split = tl.program_id(2)

    # Matrix row m is (group row q, head h): q = i_sub * ROWS_PER_PROG + m // G.
    o_m = tl.arange(0, BLOCK_M)
    o_q = i_sub * ROWS_PER_PROG + o_m // G
    o_row = (i_g * GROUP_ROWS + o_q).to(tl.int64)
    o_head = i_kvh * G + o_m % G
    m_row = (o_m < ROWS_PER_PROG * G) & (o_row < num_rows)
    o_d = tl.arange(0, HEAD_DIM)
    p_q = q_ptr + o_row[:, None] * stride_q_row + o_head[:, None] * stride_q_head + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None], other=0).to(DOT_DTYPE)

    # Tokens of this program's rows: nibble q of the group mask, shifted by the token's slot.
    ROW_NIBBLES: tl.constexpr = (1 << (4 * ROWS_PER_PROG)) - 1
    o_n = tl.arange(0, BLOCK_N)
    o_slot = o_n % 4
    o_shift = 4 * tl.minimum(o_q, GROUP_ROWS - 1)[:, None] + o_slot[None, :]

    count = tl.load(counts_ptr + i_g)
    p_ids = ids_ptr + i_g.to(tl.int64) * stride_plan
    p_masks = masks_ptr + i_g.to(tl.int64) * stride_plan
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    tile_start, tile_end = split_range(tl.cdiv(count, MB), i_split, NUM_SPLITS)
    o_j = tl.arange(0, MB)
    if PREFETCH:
        # Each tile's plan entries are loaded one iteration ahead, so the K/V loads do not wait on a
        # load of their own iteration and the compiler issues them num_stages - 1 tiles ahead (with
        # num_stages K/V buffers: more shared memory, fewer programs per SM).
        o_e = tile_start * MB + o_j
        b_id_next = tl.load(p_ids + o_e, mask=o_e < count, other=0)
        b_gm_next = tl.load(p_masks + o_e, mask=o_e < count, other=0)
    # At least one trip, so no path skips the loop: ptxas serialises every wgmma of a kernel where a
    # path that bypasses the loop redefines the accumulator registers (sm_90 warning C7515). An empty
    # range starts at tile cdiv(count, MB) or later, so its one trip reads no entry and attends nothing.
    for j_t in range(0, tl.maximum(tile_end - tile_start, 1)):
        i_t = tile_start + j_t
        # Fixed tile boundaries: tile i_t is plan entries [i_t * MB, (i_t + 1) * MB).
        o_e = i_t * MB + o_j
        if PREFETCH:
            b_id = b_id_next
            b_gm = b_gm_next
            b_id_next = tl.load(p_ids + o_e + MB, mask=o_e + MB < count, other=0)
            b_gm_next = tl.load(p_masks + o_e + MB, mask=o_e + MB < count, other=0)
        else:
            b_id = tl.load(p_ids + o_e, mask=o_e < count, other=0)
            b_gm = tl.load(p_masks + o_e, mask=o_e < count, other=0)
        # Offsets and masks per microblock (entries past the count have mask 0: they load nothing).
        o_mb = (b_id // MB_PER_BLOCK).to(tl.int64) * stride_k_block \
            + (b_id % MB_PER_BLOCK) * 4 * stride_k_tok + i_kvh * stride_k_head
        m_used = (((b_gm[:, None] >> (4 * i_sub * ROWS_PER_PROG)) >> tl.arange(0, 4)[None, :])
                  & (ROW_NIBBLES & 0x11111111)) != 0
        b_k = load_kv_microblocks(k_ptr, o_mb, stride_k_tok, o_d, m_used, KV_FP8, DOT_DTYPE)
        if SAME_KV_STRIDES:
            b_v = load_kv_microblocks(v_ptr, o_mb, stride_k_tok, o_d, m_used, KV_FP8, DOT_DTYPE)
        else:
            o_vmb = (b_id // MB_PER_BLOCK).to(tl.int64) * stride_v_block \
                + (b_id % MB_PER_BLOCK) * 4 * stride_v_tok + i_kvh * stride_v_head
            b_v = load_kv_microblocks(v_ptr, o_vmb, stride_v_tok, o_d, m_used, KV_FP8, DOT_DTYPE)
        b_gm = tl.reshape(tl.broadcast_to(b_gm[:, None], [MB, 4]), [BLOCK_N])  # per token
        # Matrix rows past the program's rows are not stored; whatever they attend stays finite.
        m_attend = ((b_gm[None, :] >> o_shift) & 1) != 0
        b_m, b_l, b_acc = attend_tile(b_q, b_k, b_v, m_attend, b_m, b_l, b_acc, qk_scale, DOT_DTYPE,
                                      LAZY_RESCALE, PTX)

    store_result(b_acc, b_m, b_l, o_row, o_head, m_row, o_d, o_row, i_split, out_ptr, gate_ptr, lse_ptr,
                 part_acc_ptr, part_ml_ptr, v_scale, Hq, stride_o_row, stride_o_head, stride_g_row, stride_g_head,
                 stride_lse_row, NUM_SPLITS, HEAD_DIM, HAS_GATE, RETURN_LSE)
