"""What every attention launcher shares: kernel arguments, score scale, split partials and their merge.

Each route's own launcher (``qsa.attention.<route>.launch``) turns a plan and the activations into one
or two kernel launches; the helpers here are the parts they have in common. No math happens here.
"""

from __future__ import annotations

import math

import torch

from .. import settings
from ..utils import dot_in_fp32, launch_options, next_pow2, same_device
from .replay import launch as launch_kernel


def dot_dtype(q: torch.Tensor):
    """Operand dtype of the kernels' dots: q's, or fp32 where the interpreter mishandles bf16."""
    import triton.language as tl

    if dot_in_fp32(q.dtype):
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[q.dtype]


def kernel_args(q, k, v, out, gate, lse):
    """Strides every attention kernel takes, and the gate and lse tensors to pass (``out`` stands in
    for an absent one)."""
    g = gate if gate is not None else out
    lse_t = lse if lse is not None else out
    return dict(
        stride_q_row=q.stride(0), stride_q_head=q.stride(1),
        stride_k_block=k.stride(0), stride_k_tok=k.stride(1), stride_k_head=k.stride(2),
        stride_v_block=v.stride(0), stride_v_tok=v.stride(1), stride_v_head=v.stride(2),
        stride_o_row=out.stride(0), stride_o_head=out.stride(1),
        stride_g_row=g.stride(0), stride_g_head=g.stride(1),
        stride_lse_row=lse_t.stride(0) if lse is not None else 0,
    ), g, lse_t


def same_kv_strides(k, v) -> bool:
    """Whether K and V share their strides (views of one interleaved cache, or two caches of one layout):
    then the kernels compute each token's offset once for both."""
    return k.stride() == v.stride()


def scores_scale(q, softmax_scale: float, k_scale: float):
    """``(q, scale)`` for the kernels: the score scale in the log2 domain (softmax scale x k_scale x
    log2(e)), made positive. The kernels scale each row's max instead of every score, which takes a
    positive scale; a negative one negates q instead (exact), a zero one zeroes it (every score 0)."""
    scale = float(softmax_scale) * float(k_scale) * math.log2(math.e)
    if scale < 0:
        return -q, -scale
    if scale == 0:
        return torch.zeros_like(q), 1.0
    return q, scale



def merge_config(num_splits: int, head_dim: int, xqa_lists: int | None = None) -> tuple[int, int]:
    """(columns per program, warps) of the split merges (``merge_splits_kernel``, and
    ``xqa_direct_merge_kernel``): one program per row and head, all of its columns, 4 warps; after an xqa
    launch (``xqa_lists`` given) of at most ``settings.XQA_MERGE_FEW_LISTS`` lists, programs of
    ``settings.XQA_MERGE_FEW_COLUMNS`` columns. The planned and the direct xqa step take the same columns,
    so that a row gets the same bits from either (the column count changes how the splits' sum rounds)."""
    if xqa_lists is not None and xqa_lists <= settings.XQA_MERGE_FEW_LISTS:
        return min(head_dim, settings.XQA_MERGE_FEW_COLUMNS), 4
    return head_dim, 4


def merge_splits(part_acc, part_ml, *, out, lse, gate, row_offset, v_scale, num_splits, xqa_lists=None):
    """Fold the fp32 split partials of rows ``[row_offset, row_offset + n)`` into ``out`` (and ``lse``), in
    split order."""
    from .kernels import merge_splits_kernel

    n, hq, _, d = part_acc.shape
    strides, g, lse_t = kernel_args(out, out, out, out, gate, lse)
    block_d, warps = merge_config(num_splits, d, xqa_lists=xqa_lists)
    launch_kernel(merge_splits_kernel, (n, hq, d // block_d),
        part_acc, part_ml, out, g, lse_t, row_offset, hq, float(v_scale),
        strides["stride_o_row"], strides["stride_o_head"], strides["stride_g_row"],
        strides["stride_g_head"], strides["stride_lse_row"],
        NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), HEAD_DIM=d,
        HAS_GATE=gate is not None, RETURN_LSE=lse is not None, BLOCK_D=block_d, num_warps=warps,
        **launch_options(out.device),
    )


def partials(n, hq, splits, d, device, copies: int = 1, reuse=None):
    """fp32 split partials ``(acc [n, hq, splits, d], ml [n, hq, splits, 2])``; with ``copies`` > 1, that
    many such pairs cut from two allocations. ``reuse``: partials of an earlier plan, returned when they
    have this shape and device (a plan refilled with ``out=`` keeps its buffers, as CUDA graphs need)."""
    if reuse is not None and _same_partials(reuse, (n, hq, splits, d), copies, device):
        return reuse
    acc = torch.empty((copies, n, hq, splits, d), dtype=torch.float32, device=device)
    ml = torch.empty((copies, n, hq, splits, 2), dtype=torch.float32, device=device)
    if copies == 1:
        return acc[0], ml[0]
    return [(acc[i], ml[i]) for i in range(copies)]


def _same_partials(reuse, shape, copies: int, device) -> bool:
    pairs = reuse if copies > 1 else [reuse]
    return len(pairs) == copies and all(
        tuple(acc.shape) == shape and tuple(ml.shape) == shape[:3] + (2,) and same_device(acc.device, device)
        for acc, ml in pairs)


def score_halves(cfg: settings.SplitConfig | settings.InvariantConfig, head_dim: int) -> bool:
    """Whether an xqa, splitk or invariant launch takes its scores over the head's column halves: as ``cfg`` says,
    where a half (at least 16 columns) is deep enough for a dot; the planned and the direct xqa kernel
    decide alike."""
    return cfg.qk_halves and head_dim >= 32


def row_scratch(scratch, rows: int, block_w: int, device, reuse=None) -> torch.Tensor:
    """The scratch rows of the kernels that sort a row of ``indices`` themselves: ``scratch`` checked, or
    ``reuse`` (an earlier plan's) where it is ``[rows, block_w]`` on ``device``, or a new one."""
    if scratch is None and reuse is not None and tuple(reuse.shape) == (rows, block_w) \
            and same_device(reuse.device, device):
        return reuse
    if scratch is None:
        return torch.empty((rows, block_w), dtype=torch.int32, device=device)
    if scratch.dtype != torch.int32 or scratch.shape[0] != rows or scratch.shape[1] < block_w \
            or scratch.stride(1) != 1:
        raise ValueError(f"scratch must be a [{rows}, >= {block_w}] int32 tensor, got {tuple(scratch.shape)}")
    return scratch


def direct_tiles(index_width: int, tile_tokens: int) -> int:
    """Tiles of a row read straight from ``indices`` (direct xqa, invariant): ``index_width`` positions
    long whatever it keeps."""
    return max(1, -(-index_width // tile_tokens))
