"""Pieces shared by the attention kernels: K/V tile loads, the online-softmax step, the epilogue,
the fixed-order merge of split partials, each row's setup, and the row lists read straight from
``indices`` (direct xqa and invariant). Each route's kernel file imports what it needs from here;
no kernel file imports another's. Also the numerics the layer's and the indexer's kernels share: rounding
to a dtype as PyTorch rounds, and one head's RMSNorm and RoPE."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LN2 = tl.constexpr(0.6931471805599453)
INT32_MAX = tl.constexpr(2**31 - 1)
RESCALE_SLACK = tl.constexpr(8.0)
"""Lazy rescaling lets probabilities grow to 2**8 before the reference max moves."""


@triton.jit
def enter_launch(PDL: tl.constexpr):
    """First statement of every kernel. ``PDL``: 0, a plain launch; 1 or 2, a programmatic dependent
    launch: wait until the previous kernel on the stream has finished and its writes are visible,
    after letting the next kernel begin launching (1) or not (2: it launches as this one's programs
    exit). Nothing global is read or written before the wait, so such a launch is safe after any
    kernel, and the waits chain: a kernel's predecessor has itself waited for its own."""
    if PDL != 0:
        if PDL == 1:
            gdc_launch_dependents()
        gdc_wait()


# ------------------------------------------------------------------------------ shared numerics
# Rounding and the per-head RMSNorm + RoPE, shared by the layer's norm_rope kernel (qsa/model/kernels.py)
# and the indexer's store of compressed keys (qsa/selection/kernels.py).


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (round to nearest even) and returned as fp32.

    bfloat16 is rounded on the bits: add ``0x7FFF`` plus the lowest kept bit, drop the low 16 bits (a
    carry into the exponent gives the next binade or inf, as it should); NaN becomes the quiet NaN
    ``0x7FC0`` PyTorch gives. (The Triton interpreter truncates fp32 to bfloat16 in a plain cast; on the
    GPU this is the rounding the hardware conversion does.)"""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        rounded = tl.where(x != x, 0x7FC00000, rounded).to(tl.uint32)
        return rounded.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def norm_rope_head(
    x_ptr,  # this head's row of HEAD_DIM elements (contiguous)
    w_ptr,  # [HEAD_DIM] norm weight, any float dtype
    cos_ptr,  # this row's [HALF] fp32 cos
    sin_ptr,  # this row's [HALF] fp32 sin
    out_ptr,  # this head's output row (contiguous)
    stride_w,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotated pairs: dims [0, HALF) with [HALF, 2 * HALF); 0: no rotation
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    EXACT: tl.constexpr,  # fp32 throughout (one rounding, at the store), the mean of squares and the scale in fp64
):
    """RMSNorm (``1 + w``) of one head, rounded to the output's dtype, then its partial NeoX RoPE, rounded
    again (as the PyTorch functions of :mod:`qsa.model.functional` on a tensor of that dtype), with the mean
    of squares an fp32 sum in Triton's order and the scale the hardware's approximate rsqrt.

    With ``EXACT`` (the compressed keys' transform, :func:`qsa.selection.reference.norm_rope_keys`) the norm
    and the rotation stay fp32 and are rounded once, at the store; the mean of squares is the fp64 sum of
    the exact fp64 squares rounded once to fp32, which depends on the order only where that sum lies within
    its rounding error of an fp32 rounding boundary, and the scale is ``1 / sqrt`` in fp64 (IEEE on every
    device and in the interpreter) rounded once to fp32. Each element's rotation needs its partner's normalised value
    (``d + HALF`` for the first half, ``d - HALF`` for the second): the partner is loaded again and
    normalised with the same scale, which gives the very value the first pass computed for it."""
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    MID: tl.constexpr = tl.float32 if EXACT else OUT
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    b_x = tl.load(x_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_w = tl.load(w_ptr + o_d * stride_w, mask=m_d, other=0.0).to(tl.float32)
    if EXACT:
        b_x64 = b_x.to(tl.float64)
        mean_sq = (tl.sum(b_x64 * b_x64, axis=0) / HEAD_DIM).to(tl.float32)  # fp64 division: IEEE
        b_r = (1.0 / tl.sqrt((mean_sq + eps).to(tl.float64))).to(tl.float32)
    else:
        mean_sq = tl.div_rn(tl.sum(b_x * b_x, axis=0), HEAD_DIM * 1.0)
        b_r = tl.rsqrt(mean_sq + eps)
    b_y = round_to(b_x * b_r * (1.0 + b_w), MID)
    if HALF > 0:
        m_rot = o_d < 2 * HALF
        first = o_d < HALF
        o_p = tl.where(first, o_d + HALF, o_d - HALF)  # the partner's dim
        o_c = tl.where(first, o_d, o_d - HALF)  # the pair's frequency
        b_xp = tl.load(x_ptr + o_p, mask=m_rot, other=0.0).to(tl.float32)
        b_wp = tl.load(w_ptr + o_p * stride_w, mask=m_rot, other=0.0).to(tl.float32)
        b_yp = round_to(b_xp * b_r * (1.0 + b_wp), MID)
        b_c = tl.load(cos_ptr + o_c, mask=m_rot, other=1.0)
        b_s = tl.load(sin_ptr + o_c, mask=m_rot, other=0.0)
        b_rot = tl.where(first, b_y * b_c - b_yp * b_s, b_y * b_c + b_yp * b_s)
        b_y = round_to(tl.where(m_rot, b_rot, b_y), MID)
    if EXACT:
        b_y = round_to(b_y, OUT)
    tl.store(out_ptr + o_d, b_y.to(OUT), mask=m_d)


@triton.jit
def load_kv_tile(
    base_ptr,  # [num_blocks, block_size, Hkv, D] cache (fp16/bf16, or uint8 E4M3)
    o_tok,  # [BLOCK_N] int64 element offset of each token's head row
    o_d,  # [HEAD_DIM]
    m_n,  # [BLOCK_N] tokens to load
    KV_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """A [BLOCK_N, HEAD_DIM] tile in the dot's operand dtype; masked tokens read as 0.

    Callers mask every token no matrix row attends, so bytes of unselected slots (which may be
    NaN: 0 * NaN = NaN in P @ V) are never read.
    """
    b_x = tl.load(base_ptr + o_tok[:, None] + o_d[None, :], mask=m_n[:, None], other=0)
    if KV_FP8:
        b_x = b_x.to(tl.float8e4nv, bitcast=True)
    return b_x.to(DOT_DTYPE)


@triton.jit
def token_kv_offsets(
    b_t,  # [BLOCK_N] logical tokens
    b_phys,  # [BLOCK_N] their physical blocks
    i_kvh,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    BLOCK_SIZE: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,  # K and V caches share their strides: one offset serves both
):
    """int64 element offsets of each token's K and V head rows (for :func:`load_kv_tile`)."""
    b_phys = b_phys.to(tl.int64)
    o_ktok = b_phys * stride_k_block + (b_t % BLOCK_SIZE) * stride_k_tok + i_kvh * stride_k_head
    if SAME_KV_STRIDES:
        o_vtok = o_ktok
    else:
        o_vtok = b_phys * stride_v_block + (b_t % BLOCK_SIZE) * stride_v_tok + i_kvh * stride_v_head
    return o_ktok, o_vtok


@triton.jit
def load_kv_microblocks(
    base_ptr,  # [num_blocks, block_size, Hkv, D] cache (fp16/bf16, or uint8 E4M3)
    o_mb,  # [MB] int64 element offset of each microblock's first token's head row
    stride_tok,
    o_d,  # [HEAD_DIM]
    m_used,  # [MB, 4] tokens to load
    KV_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """A [4 * MB, HEAD_DIM] tile of MB microblocks (4 consecutive token slots each); masked tokens read
    as 0. Offsets are computed per microblock, not per token."""
    o_t = tl.arange(0, 4) * stride_tok
    p = base_ptr + (o_mb[:, None] + o_t[None, :])[:, :, None] + o_d[None, None, :]
    b_x = tl.load(p, mask=m_used[:, :, None], other=0)
    if KV_FP8:
        b_x = b_x.to(tl.float8e4nv, bitcast=True)
    MB: tl.constexpr = o_mb.shape[0]
    HEAD_DIM: tl.constexpr = o_d.shape[0]
    return tl.reshape(b_x.to(DOT_DTYPE), [4 * MB, HEAD_DIM])


@triton.jit
def split_range(n_tiles, i_split, NUM_SPLITS: tl.constexpr):
    """Tiles ``[start, end)`` of split ``i_split``: near-equal runs at positions fixed by the list
    length alone, so where pages live or how indices were ordered never moves a boundary."""
    per = tl.cdiv(n_tiles, NUM_SPLITS)
    start = i_split * per
    return start, tl.minimum(n_tiles, start + per)


_SCALE_PACK = 128  # accumulator elements per asm instance: all of a thread's at 64 x 256 per warpgroup


def _scale_asm(pack: int) -> str:
    """PTX for ``pack`` accumulator elements: copy them, and unless the warp's flag (the first flag
    operand) is 0, multiply them by their row's factor. The flag is uniform over the warp, so the
    branch is too: a warp whose rows keep their reference issues no multiply."""
    copy = "".join(f"mov.b32 ${i}, ${pack + i}; " for i in range(pack))
    mul = "".join(f"mul.f32 ${i}, ${pack + i}, ${2 * pack + i}; " for i in range(pack))
    return "{ .reg .pred p; " + copy + f"setp.ne.s32 p, ${3 * pack}, 0; @!p bra.uni SKIP; " + mul + "SKIP: }"


SCALE_PACK = tl.constexpr(_SCALE_PACK)
SCALE_ASM = tl.constexpr(_scale_asm(_SCALE_PACK))
SCALE_CONSTRAINTS = tl.constexpr(",".join(["=r"] * _SCALE_PACK + ["r"] * (3 * _SCALE_PACK)))
WARP_ANY_ASM = tl.constexpr("{ .reg .pred p; .reg .b32 t; or.b32 t, $2, $3; setp.ne.s32 p, t, 0; "
                            "vote.sync.any.pred p, p, -1; selp.s32 $0, 1, 0, p; mov.b32 $1, $0; }")


@triton.jit
def _rescale_rows(b_acc, b_alpha, b_move, PTX: tl.constexpr):
    """``b_acc * b_alpha[:, None]``, where every row without ``b_move`` has ``b_alpha`` 1 or an
    accumulator still 0 (so its multiply changes nothing). With ``PTX`` (GPU only) a warp none of
    whose rows moves skips the multiplies: the vote ORs a thread's two row flags (a wgmma or mma
    accumulator gives each thread two rows of its warp; ``tests/sm90.py`` checks one vote per tile)
    over the warp, and the accumulator's asm branches on the result."""
    if PTX:
        b_warp = tl.inline_asm_elementwise(WARP_ANY_ASM, "=r,=r,r,r", [b_move.to(tl.int32)], dtype=tl.int32,
                                           is_pure=False, pack=2)
        return tl.inline_asm_elementwise(
            SCALE_ASM, SCALE_CONSTRAINTS,
            [b_acc, tl.broadcast_to(b_alpha[:, None], b_acc.shape), tl.broadcast_to(b_warp[:, None], b_acc.shape)],
            dtype=tl.float32, is_pure=True, pack=SCALE_PACK)
    return b_acc * b_alpha[:, None]


@triton.jit
def attend_tile(
    b_q,  # [BLOCK_M, HEAD_DIM] in DOT_DTYPE
    b_k,  # [BLOCK_N, HEAD_DIM] in DOT_DTYPE
    b_v,  # [BLOCK_N, HEAD_DIM] in DOT_DTYPE
    m_attend,  # [BLOCK_M, BLOCK_N] which (matrix row, token) pairs attend
    b_m,  # [BLOCK_M] reference max (the shift of b_l and b_acc), log2 domain
    b_l,  # [BLOCK_M] running sum
    b_acc,  # [BLOCK_M, HEAD_DIM] fp32 running P @ V
    qk_scale,  # softmax scale * k_scale * log2(e), > 0 (the launchers see to it: attention.scores_scale)
    P_DTYPE: tl.constexpr,
    LAZY_RESCALE: tl.constexpr = False,
    PTX: tl.constexpr = False,  # GPU only: with LAZY_RESCALE, warps skip identity rescales (_rescale_rows)
):
    """One online-softmax step over a K/V tile: scores, masking, rescale, P @ V (fp32 accumulate).

    The scores stay unscaled: the row max is scaled (one multiply per row, exact for a positive scale)
    and each probability is ``exp2(s * qk_scale - shift)``, one fused multiply-add, not a multiply per
    score and a subtraction.

    With ``LAZY_RESCALE`` a row's reference max moves only when the row's max exceeds it by more than
    ``RESCALE_SLACK`` (as in FlashAttention 4); otherwise the tile's probabilities are taken against
    the old reference and stay below 2**RESCALE_SLACK, and the row's rescale factor is 1. The result
    is the same softmax (out = acc / l, lse = m + log2(l) hold for any reference), rounded at other
    points, and as deterministic: each row's decision depends on its own data in tile order only, and
    skipping a multiply by 1 (``PTX``) changes no bit.
    """
    b_s = tl.dot(b_q, tl.trans(b_k))
    if LAZY_RESCALE:
        b_s = tl.where(m_attend, b_s, float("-inf"))
        b_max = tl.max(b_s, 1) * qk_scale
        # Growth of each row's max past its reference: huge for a row's first scores (reference -inf,
        # floored to a finite value so that -inf - -inf never makes a NaN), -inf where nothing is new.
        b_move = b_max - tl.maximum(b_m, -3.0e38) > RESCALE_SLACK
        b_m_new = tl.where(b_move, tl.maximum(b_m, b_max), b_m)
        # A row that has attended nothing yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
        b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        # Rescaled before the probabilities are computed: in this order the sm_90 kernel with an FP8
        # cache ran 1.15-1.16 ms at prefill-64k-o80 on the H200, against 1.25 ms with the rescale after.
        b_alpha = tl.exp2(b_m - b_shift)
        b_l = b_l * b_alpha
        b_acc = _rescale_rows(b_acc, b_alpha, b_move, PTX)
        b_p = tl.exp2(b_s * qk_scale - b_shift[:, None])
        b_l = b_l + tl.sum(b_p, 1)
        b_acc = tl.dot(b_p.to(P_DTYPE), b_v, b_acc)
    else:
        b_m_new, b_l, b_p, b_alpha = softmax_weights(b_s, m_attend, b_m, b_l, qk_scale)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(P_DTYPE), b_v)
    return b_m_new, b_l, b_acc


@triton.jit
def softmax_weights(b_s, m_attend, b_m, b_l, qk_scale):
    """The online softmax's step on unscaled scores ``b_s`` (``attend_tile`` without the lazy rescale):
    (new reference max, new sum, probabilities, the factor that rescales the old sum and accumulator)."""
    b_s = tl.where(m_attend, b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * qk_scale)
    # A row that has attended nothing yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
    b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_p = tl.exp2(b_s * qk_scale - b_shift[:, None])
    b_alpha = tl.exp2(b_m - b_shift)
    return b_m_new, b_l * b_alpha + tl.sum(b_p, 1), b_p, b_alpha


@triton.jit
def store_output(
    b_acc,  # [BLOCK_M, HEAD_DIM] fp32 unnormalised P @ V
    b_m,  # [BLOCK_M] max, log2 domain
    b_l,  # [BLOCK_M] sum
    o_row,  # [BLOCK_M] int64 row of each matrix row
    o_head,  # [BLOCK_M] int64 query head of each matrix row
    m_row,  # [BLOCK_M] matrix rows to store
    o_d,  # [HEAD_DIM]
    out_ptr,  # [rows, Hq, D]
    gate_ptr,  # [rows, Hq, D] or unused
    lse_ptr,  # [rows, Hq] fp32 or unused
    v_scale,
    stride_o_row,
    stride_o_head,
    stride_g_row,
    stride_g_head,
    stride_lse_row,
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """Normalise, apply v_scale and the gate (docs/spec.md section 1), store out and the natural-log LSE."""
    m_any = b_l > 0
    b_inv = tl.where(m_any, v_scale / tl.where(m_any, b_l, 1.0), 0.0)
    b_o = (b_acc * b_inv[:, None]).to(out_ptr.dtype.element_ty)
    if HAS_GATE:
        p_g = gate_ptr + o_row[:, None] * stride_g_row + o_head[:, None] * stride_g_head + o_d[None, :]
        b_g = tl.load(p_g, mask=m_row[:, None], other=0).to(tl.float32)
        b_o = (b_o.to(tl.float32) * tl.sigmoid(b_g)).to(out_ptr.dtype.element_ty)
    p_o = out_ptr + o_row[:, None] * stride_o_row + o_head[:, None] * stride_o_head + o_d[None, :]
    tl.store(p_o, b_o, mask=m_row[:, None])
    if RETURN_LSE:
        b_lse = tl.where(m_any, (b_m + tl.log2(tl.where(m_any, b_l, 1.0))) * LN2, float("-inf"))
        tl.store(lse_ptr + o_row * stride_lse_row + o_head, b_lse, mask=m_row)


@triton.jit
def store_partial(
    b_acc,  # [BLOCK_M, HEAD_DIM] fp32
    b_m,  # [BLOCK_M]
    b_l,  # [BLOCK_M]
    o_row,  # [BLOCK_M] int64
    o_head,  # [BLOCK_M] int64
    m_row,  # [BLOCK_M]
    o_d,  # [HEAD_DIM]
    i_split,
    part_acc_ptr,  # [rows, Hq, NUM_SPLITS, D] fp32
    part_ml_ptr,  # [rows, Hq, NUM_SPLITS, 2] fp32
    Hq,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    o_part = (o_row * Hq + o_head) * NUM_SPLITS + i_split
    # A split past the end of the row's list stores (max, sum) = (-inf, 0) and a zero accumulator, so
    # the merge loads every split's accumulator without waiting for the sums (and weighs that one 0).
    tl.store(part_acc_ptr + o_part[:, None] * HEAD_DIM + o_d[None, :], b_acc, mask=m_row[:, None])
    tl.store(part_ml_ptr + o_part * 2, b_m, mask=m_row)
    tl.store(part_ml_ptr + o_part * 2 + 1, b_l, mask=m_row)


@triton.jit
def store_result(
    b_acc, b_m, b_l, o_row, o_head, m_row, o_d,
    o_part_row,  # [BLOCK_M] int64 row of each matrix row in the partial buffers
    i_split,
    out_ptr, gate_ptr, lse_ptr, part_acc_ptr, part_ml_ptr, v_scale, Hq,
    stride_o_row, stride_o_head, stride_g_row, stride_g_head, stride_lse_row,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """A program's result: the output itself when rows are not split, else its split's partial."""
    if NUM_SPLITS == 1:
        store_output(b_acc, b_m, b_l, o_row, o_head, m_row, o_d, out_ptr, gate_ptr, lse_ptr, v_scale,
                     stride_o_row, stride_o_head, stride_g_row, stride_g_head, stride_lse_row,
                     HAS_GATE, RETURN_LSE)
    else:
        store_partial(b_acc, b_m, b_l, o_part_row, o_head, m_row, o_d, i_split,
                      part_acc_ptr, part_ml_ptr, Hq, NUM_SPLITS, HEAD_DIM)


@triton.jit
def merge_splits_kernel(
    part_acc_ptr,  # [rows, Hq, NUM_SPLITS, D] fp32 unnormalised partial P @ V
    part_ml_ptr,  # [rows, Hq, NUM_SPLITS, 2] fp32 (max in log2 domain, sum)
    out_ptr,  # [rows, Hq, D]
    gate_ptr,  # [rows, Hq, D] or unused
    lse_ptr,  # [rows, Hq] fp32 or unused
    row_offset,  # first output row of this launch
    Hq,
    v_scale,
    stride_o_row,
    stride_o_head,
    stride_g_row,
    stride_g_head,
    stride_lse_row,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # power of two >= NUM_SPLITS
    HEAD_DIM: tl.constexpr,
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    BLOCK_D: tl.constexpr,  # columns per program (a divisor of HEAD_DIM); grid axis 2 = HEAD_DIM // BLOCK_D
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    """Combine the splits of one head of one row (``BLOCK_D`` of its columns). All splits are loaded at
    once and reduced by a fixed tree (the same for every call of a shape and setting), not one after
    another: a row's merge is one round of loads (the accumulators do not wait on the sums), whatever
    the split count. Every column program of a head computes the same weights and LSE from the same
    sums, so they store the same LSE bits."""
    enter_launch(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    o_d = tl.program_id(2).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    b_ms, b_ls, b_a = load_split_partials(part_acc_ptr, part_ml_ptr, i_r, i_h, o_d, Hq, NUM_SPLITS, BLOCK_S,
                                          HEAD_DIM)
    merge_split_partials(b_ms, b_ls, b_a, i_r + row_offset, i_h, o_d, out_ptr, gate_ptr, lse_ptr, v_scale,
                         stride_o_row, stride_o_head, stride_g_row, stride_g_head, stride_lse_row, HAS_GATE,
                         RETURN_LSE)


@triton.jit
def load_split_partials(part_acc_ptr, part_ml_ptr, i_r, i_h, o_d, Hq, NUM_SPLITS: tl.constexpr,
                        BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(max, sum, accumulator columns ``o_d``) of every split of head ``i_h`` of partial row ``i_r``, all
    loaded at once (the accumulators do not wait on the sums); splits past ``NUM_SPLITS`` read as
    (-inf, 0, 0)."""
    o_s = tl.arange(0, BLOCK_S)
    o_part = (i_r * Hq + i_h) * NUM_SPLITS + o_s
    m_s = o_s < NUM_SPLITS
    b_ms = tl.load(part_ml_ptr + o_part * 2, mask=m_s, other=float("-inf"))
    b_ls = tl.load(part_ml_ptr + o_part * 2 + 1, mask=m_s, other=0.0)
    b_a = tl.load(part_acc_ptr + o_part[:, None] * HEAD_DIM + o_d[None, :], mask=m_s[:, None], other=0.0)
    return b_ms, b_ls, b_a


@triton.jit
def merge_split_partials(b_ms, b_ls, b_a, i_row, i_h, o_d, out_ptr, gate_ptr, lse_ptr, v_scale, stride_o_row,
                         stride_o_head, stride_g_row, stride_g_head, stride_lse_row, HAS_GATE: tl.constexpr,
                         RETURN_LSE: tl.constexpr):
    """Reduce loaded splits (``load_split_partials``) by the fixed tree and store output row ``i_row``."""
    # A split that attended nothing stored (-inf, 0) and zeros: weight 0.
    m_used = b_ls > 0
    b_m = tl.max(tl.where(m_used, b_ms, float("-inf")), 0)
    b_w = tl.where(m_used, tl.exp2(b_ms - tl.where(b_m == float("-inf"), 0.0, b_m)), 0.0)
    b_l = tl.sum(b_ls * b_w, 0, keep_dims=True)
    b_acc = tl.sum(b_a * b_w[:, None], 0, keep_dims=True)
    o_one = tl.zeros([1], tl.int64)
    store_output(b_acc, o_one.to(tl.float32) + b_m, b_l, o_one + i_row, o_one + i_h, o_one == 0, o_d,
                 out_ptr, gate_ptr, lse_ptr, v_scale, stride_o_row, stride_o_head, stride_g_row, stride_g_head,
                 stride_lse_row, HAS_GATE, RETURN_LSE)


@triton.jit
def attend_tile_halves(
    b_q0, b_q1,  # [BLOCK_M, HEAD_DIM // 2] each: the query's two column halves, in DOT_DTYPE
    o_ktok, o_vtok,  # [BLOCK_N] int64 element offsets of each token's K and V head rows
    m_load,  # [BLOCK_N] tokens to load (every token some matrix row attends)
    m_attend,  # [BLOCK_M, BLOCK_N]
    k_ptr, v_ptr,
    o_h,  # [HEAD_DIM // 2]
    b_m, b_l,
    b_acc0, b_acc1,  # [BLOCK_M, HEAD_DIM // 2] each: the accumulator's two column halves
    qk_scale,
    KV_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """``attend_tile`` with the head dimension cut in two halves: K and V are loaded as four tiles of
    one layout, and the scores are the sum of two products of half the depth. Each warp's score tile is
    then two independent chains of mma steps, not one as deep as the head (sm_90 SASS at head_dim 256:
    two chains of 8 instead of one of 16, and 348 instead of 465 instructions per tile in the direct
    kernel's loop). The same softmax step as ``attend_tile`` (``softmax_weights``); the scores round differently,
    so every kernel that must give the same bits for a row (xqa planned and direct) takes the same form."""
    HALF: tl.constexpr = o_h.shape[0]
    b_k0 = load_kv_tile(k_ptr, o_ktok, o_h, m_load, KV_FP8, DOT_DTYPE)
    b_k1 = load_kv_tile(k_ptr + HALF, o_ktok, o_h, m_load, KV_FP8, DOT_DTYPE)
    b_v0 = load_kv_tile(v_ptr, o_vtok, o_h, m_load, KV_FP8, DOT_DTYPE)
    b_v1 = load_kv_tile(v_ptr + HALF, o_vtok, o_h, m_load, KV_FP8, DOT_DTYPE)
    # fma(x, 1, y) is x + y exactly; so written, the compiler does not fold the two products into one.
    b_s = tl.fma(tl.dot(b_q0, tl.trans(b_k0)), 1.0, tl.dot(b_q1, tl.trans(b_k1)))
    b_m_new, b_l, b_p, b_alpha = softmax_weights(b_s, m_attend, b_m, b_l, qk_scale)
    b_p = b_p.to(DOT_DTYPE)
    b_acc0 = b_acc0 * b_alpha[:, None] + tl.dot(b_p, b_v0)
    b_acc1 = b_acc1 * b_alpha[:, None] + tl.dot(b_p, b_v1)
    return b_m_new, b_l, b_acc0, b_acc1


# The xqa kernels hold a query tile and its accumulator either whole or, with HALVES, as two column halves
# (``attend_tile_halves``); these helpers take both forms, a whole one passed and returned twice.

@triton.jit
def load_query(p_q, m_row, HEAD_DIM: tl.constexpr, HALVES: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The query tile at ``p_q`` (``[BLOCK_M, 1]`` pointers to each matrix row's head row; rows outside
    ``m_row`` read as 0): (first half, second half) with ``HALVES``, else (tile, tile)."""
    if HALVES:
        o_h = tl.arange(0, HEAD_DIM // 2)
        b_q0 = tl.load(p_q + o_h[None, :], mask=m_row[:, None], other=0).to(DOT_DTYPE)
        b_q1 = tl.load(p_q + HEAD_DIM // 2 + o_h[None, :], mask=m_row[:, None], other=0).to(DOT_DTYPE)
    else:
        b_q0 = tl.load(p_q + tl.arange(0, HEAD_DIM)[None, :], mask=m_row[:, None], other=0).to(DOT_DTYPE)
        b_q1 = b_q0
    return b_q0, b_q1


@triton.jit
def zero_accumulator(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HALVES: tl.constexpr):
    """A zero accumulator in the form ``load_query`` gives the query."""
    if HALVES:
        b_acc0 = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
        b_acc1 = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    else:
        b_acc0 = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        b_acc1 = b_acc0
    return b_acc0, b_acc1


@triton.jit
def attend_kv(
    b_q0, b_q1, o_ktok, o_vtok,
    m_load,  # [BLOCK_N] tokens to load
    m_attend,  # [BLOCK_M, BLOCK_N]
    k_ptr, v_ptr, b_m, b_l, b_acc0, b_acc1, qk_scale,
    HEAD_DIM: tl.constexpr,
    HALVES: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One online-softmax step over the K/V head rows at ``o_ktok``/``o_vtok``: ``attend_tile_halves``
    with ``HALVES``, else ``attend_tile`` on the whole head."""
    if HALVES:
        b_m, b_l, b_acc0, b_acc1 = attend_tile_halves(b_q0, b_q1, o_ktok, o_vtok, m_load, m_attend, k_ptr, v_ptr,
                                                      tl.arange(0, HEAD_DIM // 2), b_m, b_l, b_acc0, b_acc1,
                                                      qk_scale, KV_FP8, DOT_DTYPE)
    else:
        o_d = tl.arange(0, HEAD_DIM)
        b_k = load_kv_tile(k_ptr, o_ktok, o_d, m_load, KV_FP8, DOT_DTYPE)
        b_v = load_kv_tile(v_ptr, o_vtok, o_d, m_load, KV_FP8, DOT_DTYPE)
        b_m, b_l, b_acc0 = attend_tile(b_q0, b_k, b_v, m_attend, b_m, b_l, b_acc0, qk_scale, DOT_DTYPE)
    return b_m, b_l, b_acc0, b_acc1


@triton.jit
def attend_kv_tokens(
    b_q0, b_q1, b_t, b_phys,
    m_n,  # [BLOCK_N] tokens to attend (the others are neither read nor weighed)
    m_row, i_kvh, k_ptr, v_ptr, b_m, b_l, b_acc0, b_acc1, qk_scale,
    stride_k_block, stride_k_tok, stride_k_head, stride_v_block, stride_v_tok, stride_v_head,
    BLOCK_SIZE: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALVES: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One tile of tokens ``b_t`` in physical blocks ``b_phys``: K/V of head ``i_kvh`` gathered token by
    token, attended by the query rows ``m_row`` (``attend_kv``, in either form)."""
    o_ktok, o_vtok = token_kv_offsets(b_t, b_phys, i_kvh, stride_k_block, stride_k_tok, stride_k_head,
                                      stride_v_block, stride_v_tok, stride_v_head, BLOCK_SIZE, SAME_KV_STRIDES)
    return attend_kv(b_q0, b_q1, o_ktok, o_vtok, m_n, m_n[None, :] & m_row[:, None], k_ptr, v_ptr, b_m, b_l, b_acc0,
                     b_acc1, qk_scale, HEAD_DIM, HALVES, KV_FP8, DOT_DTYPE)


@triton.jit
def store_accumulator(
    b_acc0, b_acc1, b_m, b_l, o_row, o_head, m_row, o_part_row, i_split,
    out_ptr, gate_ptr, lse_ptr, part_acc_ptr, part_ml_ptr, v_scale, Hq,
    stride_o_row, stride_o_head, stride_g_row, stride_g_head, stride_lse_row,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_GATE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    HALVES: tl.constexpr,
):
    """``store_result`` of an accumulator in either form (each half stores its columns)."""
    if HALVES:
        o_h = tl.arange(0, HEAD_DIM // 2)
        store_result(b_acc0, b_m, b_l, o_row, o_head, m_row, o_h, o_part_row, i_split, out_ptr, gate_ptr, lse_ptr,
                     part_acc_ptr, part_ml_ptr, v_scale, Hq, stride_o_row, stride_o_head, stride_g_row,
                     stride_g_head, stride_lse_row, NUM_SPLITS, HEAD_DIM, HAS_GATE, RETURN_LSE)
        store_result(b_acc1, b_m, b_l, o_row, o_head, m_row, o_h + HEAD_DIM // 2, o_part_row, i_split, out_ptr,
                     gate_ptr, lse_ptr, part_acc_ptr, part_ml_ptr, v_scale, Hq, stride_o_row, stride_o_head,
                     stride_g_row, stride_g_head, stride_lse_row, NUM_SPLITS, HEAD_DIM, HAS_GATE, RETURN_LSE)
    else:
        store_result(b_acc0, b_m, b_l, o_row, o_head, m_row, tl.arange(0, HEAD_DIM), o_part_row, i_split, out_ptr,
                     gate_ptr, lse_ptr, part_acc_ptr, part_ml_ptr, v_scale, Hq, stride_o_row, stride_o_head,
                     stride_g_row, stride_g_head, stride_lse_row, NUM_SPLITS, HEAD_DIM, HAS_GATE, RETURN_LSE)


@triton.jit
def store_partials(b_acc0, b_acc1, b_m, b_l, o_row, o_head, m_row, i_split, part_acc_ptr, part_ml_ptr, Hq,
                   NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HALVES: tl.constexpr):
    """``store_partial`` of an accumulator in either form."""
    if HALVES:
        o_h = tl.arange(0, HEAD_DIM // 2)
        store_partial(b_acc0, b_m, b_l, o_row, o_head, m_row, o_h, i_split, part_acc_ptr, part_ml_ptr, Hq,
                      NUM_SPLITS, HEAD_DIM)
        store_partial(b_acc1, b_m, b_l, o_row, o_head, m_row, o_h + HEAD_DIM // 2, i_split, part_acc_ptr,
                      part_ml_ptr, Hq, NUM_SPLITS, HEAD_DIM)
    else:
        store_partial(b_acc0, b_m, b_l, o_row, o_head, m_row, tl.arange(0, HEAD_DIM), i_split, part_acc_ptr,
                      part_ml_ptr, Hq, NUM_SPLITS, HEAD_DIM)


# --- Rows read straight from ``indices`` (direct xqa, invariant) and row setup (every row kernel) ---


@triton.jit
def row_setup(req_ptr, pos_ptr, seq_lens_ptr, i_r, num_reqs):
    """(request, position, seq_len, row is valid) of row ``i_r``; invalid rows keep nothing."""
    req = tl.load(req_ptr + i_r).to(tl.int64)
    pos = tl.load(pos_ptr + i_r).to(tl.int64)
    row_ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req = tl.where(row_ok, req, 0)
    seq_len = tl.load(seq_lens_ptr + req, mask=row_ok, other=0)
    return req, pos, seq_len, row_ok


@triton.jit
def row_width(count_ptr, i_r, stride_count, W, HAS_COUNTS: tl.constexpr):
    """How many leading entries of row ``i_r`` of ``indices`` a kernel may read: all ``W``, or with
    ``HAS_COUNTS`` the row's ``index_counts`` entry clamped to ``[0, W]`` (docs/spec.md section 4). Every
    load of an index is masked by it, so an entry past the count is never read; it acts as a -1 would.
    Without ``HAS_COUNTS`` this is ``W`` itself and the kernel compiles as it did without counts."""
    if HAS_COUNTS:
        n = tl.load(count_ptr + i_r * stride_count)
        return tl.minimum(tl.maximum(n, 0), W)
    else:
        return W


@triton.jit
def table_safe(b_t, pos, row_ok, max_blocks, BLOCK_SIZE: tl.constexpr):
    """The checks of docs/spec.md section 4 that need neither ``seq_len`` nor the table: a valid row, 0 <= t <=
    pos, t's block inside the table. Only ``t < seq_len`` is left, whose load waits on the request's: so
    the table entries of these tokens are loaded without waiting for it (they lie inside the table's row
    whatever they hold), and the tokens past ``seq_len`` are dropped before any K/V is read."""
    return row_ok & (b_t >= 0) & (b_t <= pos) & (b_t // BLOCK_SIZE < max_blocks)


@triton.jit
def ascending_limit(pos, row_ok, max_blocks, BLOCK_SIZE: tl.constexpr):
    """The row check's bound: ``table_safe`` keeps exactly the tokens with unsigned ``t < limit`` (a
    position past ``INT32_MAX`` keeps every int32 token, without ``pos + 1`` overflowing)."""
    lim = tl.minimum(tl.minimum(pos, INT32_MAX) + 1, tl.cast(max_blocks, tl.int64) * BLOCK_SIZE)
    lim = tl.where(row_ok, tl.minimum(lim, INT32_MAX), 0)
    return lim.to(tl.uint32)


@triton.jit
def split_ascends(b_t, u_prev, o_pos, n_pos, u_lim):
    """The row check of positions ``o_pos``: each entry ``b_t`` (read at ``o_pos < n_pos``) against the
    entry before it (``u_prev``, from ``_previous_entries`` or the row itself). ``direct_row_list``
    checks the whole row with it. A row ascends iff every position passes, and the splits' positions
    cover the row, with each split's first position compared to the last of the split before: so the
    row ascends iff every split's check passes (the deferred check)."""
    m_in = (o_pos >= 1) & (o_pos < n_pos)
    u_t = b_t.to(tl.uint32, bitcast=True)
    m_ok = ~m_in | (u_t >= u_lim) | (u_prev < u_t)
    return tl.min(m_ok.to(tl.int32), 0) != 0


@triton.jit
def direct_row_list(
    p_idx,  # the row of ``indices``: [W] int32 token indices
    p_scratch,  # the row's scratch row: [>= BLOCK_W] int32
    pos,
    row_ok,
    W,  # entries of the row that may be read (``row_width``: the index width, or the row's count)
    max_blocks,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_W: tl.constexpr,  # power of two >= W
):
    """(pointer to the row's list, its length, whether the row is its own list).

    The list holds the row's tokens that pass ``table_safe``, ascending, each once; ``list_entries``
    then drops those past ``seq_len``. Those are the list's largest, so its kept tokens are at the same
    positions (the i-th smallest at position i) whether ``seq_len`` is applied here or there, and the
    check does not wait for the ``seq_len`` load. A row that already ascends (as ``select_tokens`` emits
    it: tokens strictly ascending, dropped entries only at the end) is its own list of length W: nothing
    is written. Any other row is sorted, its duplicates dropped, and its tokens written to the row's
    scratch row (every program of the row writes the same values there), a list of their count. Both
    give the same entries at the same positions for the same token set. Entries at ``W`` and past it
    are never read (a row with ``index_counts`` passes its count as ``W``): they count as -1 would.
    """
    o_w = tl.arange(0, BLOCK_W)
    b_t = tl.load(p_idx + o_w, mask=o_w < W, other=-1)
    # ``table_safe`` keeps exactly the tokens 0 <= t < lim, that is unsigned t < lim (a negative t is
    # 2**31 or more as an unsigned number). The row ascends iff each kept entry b follows a kept a < b:
    # for every b after an a, b is dropped or 0 <= a < b, i.e. unsigned a < b. Two compares per entry
    # instead of the keep rule's six with its 64-bit position (docs/performance.md: the direct kernel).
    u_lim = ascending_limit(pos, row_ok, max_blocks, BLOCK_SIZE)
    u_prev = tl.gather(b_t.to(tl.uint32, bitcast=True), tl.maximum(o_w - 1, 0), 0)
    p_list = p_idx
    n_list = W
    ascending = split_ascends(b_t, u_prev, o_w, W, u_lim)
    if not ascending:
        b_key = tl.where(table_safe(b_t, pos, row_ok, max_blocks, BLOCK_SIZE), b_t, INT32_MAX)
        b_key = tl.sort(b_key)
        b_prev = tl.gather(b_key, tl.maximum(o_w - 1, 0), 0)
        m_first = (b_key != INT32_MAX) & ((o_w == 0) | (b_prev != b_key))
        p_list = p_scratch
        tl.store(p_list + tl.cumsum(m_first.to(tl.int32), 0) - 1, b_key, mask=m_first)
        n_list = tl.sum(m_first.to(tl.int32), 0)
        tl.debug_barrier()
    return p_list, n_list, ascending


@triton.jit
def list_entries(p_list, o_e, n_list, p_bt, pos, seq_len, row_ok, max_blocks, BLOCK_SIZE: tl.constexpr):
    """(token, physical block) of list entries ``o_e``; the block is -1 for an entry past the list or
    a token the row does not keep (the block-table check is the caller's). The table is read before
    ``seq_len`` is known (``table_safe``), so a K/V load waits on two loads (list, table), not three."""
    b_t = tl.load(p_list + o_e, mask=o_e < n_list, other=-1)
    m_safe = table_safe(b_t, pos, row_ok, max_blocks, BLOCK_SIZE)
    b_phys = tl.load(p_bt + b_t // BLOCK_SIZE, mask=m_safe, other=-1)
    return b_t, tl.where(m_safe & (b_t < seq_len), b_phys, -1)
