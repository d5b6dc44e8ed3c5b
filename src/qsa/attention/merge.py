"""Merging partial attention states: the exact LSE merge of outputs computed over disjoint token sets.

Decode context parallelism splits each row's tokens across ranks; rank ``i`` attends its share with
``qsa.sparse_paged_attention(..., return_lse=True)`` and returns ``(out_i, lse_i)``: ``out_i [rows, Hq, D]``
and the natural-log ``lse_i [rows, Hq]`` fp32 (``-inf`` and ``out_i = 0`` where its share is empty,
docs/spec.md section 4). Attention over the union of the shares is then

* ``lse = ln(sum_i exp(lse_i))``,
* ``out = sum_i w_i * out_i`` with ``w_i = exp(lse_i - lse)``,

which :func:`merge_attention_states` computes in one launch of :func:`merge_attention_states_kernel`
(docs/routes.md, "Merging partial attention (context parallelism)"). :func:`merge_reference` is the same
formula in fp64 PyTorch, the ground truth of the tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import backend, settings
from ..utils import check_bool, check_tensor, launch_options, next_pow2, overlaps_itself, same_device
from .kernels import enter_launch
from .replay import launch as launch_kernel

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MAX_POINTER_PARTS = 8
"""Most parts the kernel takes as separate tensors (one pointer argument each); more parts than this,
given as separate tensors, are stacked into one first (a copy)."""



# --------------------------------------------------------------------------------------------- kernel


@triton.jit
def part_pointer(i: tl.constexpr, p_0, p_1, p_2, p_3, p_4, p_5, p_6, p_7):
    """The pointer of part ``i`` (a compile-time index) among up to eight separate tensors."""
    if i == 0:
        p = p_0
    elif i == 1:
        p = p_1
    elif i == 2:
        p = p_2
    elif i == 3:
        p = p_3
    elif i == 4:
        p = p_4
    elif i == 5:
        p = p_5
    elif i == 6:
        p = p_6
    else:
        p = p_7
    return p


@triton.jit
def fold_part(b_acc, b_s, b_lse, b_shift, p_part, o_part, m_tile):
    """Fold one part into the running ``(b_acc, b_s)``: ``b_s += exp(lse - shift)``,
    ``b_acc = fma(exp(lse - shift), out_part, b_acc)``. A part with ``lse = -inf`` (an empty token set)
    changes nothing: its weight is not taken and its ``out`` is neither loaded nor multiplied (a select,
    not a multiply by 0), so whatever its buffer holds, NaN included, cannot reach the result. A NaN or
    ``+inf`` lse does count (``!= -inf``), so it shows in the result."""
    m_used = b_lse != float("-inf")
    b_w = tl.exp(b_lse - b_shift)
    b_o = tl.load(p_part + o_part, mask=m_tile & m_used[:, None], other=0.0).to(tl.float32)
    b_s = tl.where(m_used, b_s + b_w, b_s)
    b_acc = tl.where(m_used[:, None], tl.fma(b_w[:, None], b_o, b_acc), b_acc)
    return b_acc, b_s


@triton.jit
def merge_attention_states_kernel(
    o_0, o_1, o_2, o_3, o_4, o_5, o_6, o_7,  # each part's out [rows, Hq, D]; STACKED: o_0 is [P, rows, Hq, D]
    l_0, l_1, l_2, l_3, l_4, l_5, l_6, l_7,  # each part's lse [rows, Hq] fp32; STACKED: l_0 is [P, rows, Hq]
    out_ptr,  # [rows, Hq, D]
    lse_ptr,  # [rows, Hq] fp32, or unused (RETURN_LSE off)
    Hq,
    stride_op, stride_or, stride_oh,  # the parts' out strides: part (STACKED only), row, head
    stride_lp, stride_lr, stride_lh,  # the parts' lse strides: part (STACKED only), row, head
    stride_out_row, stride_out_head,
    stride_lse_row,
    NUM_PARTS: tl.constexpr,
    STACKED: tl.constexpr,  # the parts are slices of one tensor each (o_0, l_0) at the part strides
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_H: tl.constexpr,  # heads per program; grid (rows, cdiv(Hq, BLOCK_H))
    RETURN_LSE: tl.constexpr,
    PDL: tl.constexpr = 0,  # programmatic dependent launch (enter_launch)
):
    """Merge the parts of ``BLOCK_H`` heads of one row, all ``HEAD_DIM`` columns.

    Two passes over the parts, each in part order 0, 1, ..., P - 1: the largest lse ``m``, then
    ``s = sum_i exp(lse_i - m)`` and ``acc = sum_i exp(lse_i - m) * out_i`` (fp32, explicit fused
    multiply-adds), folded one part after another; ``out = acc / s`` rounded once, ``lse = m + ln(s)``.
    That is ``sum_i exp(lse_i - lse) * out_i``, with the weights taken relative to ``m`` so that the
    rounding of ``lse`` does not enter them. Every element's arithmetic is its own and in a fixed order,
    so the bits depend on the inputs' values alone (not on the tile, the batch, or how the parts are
    passed). Heads whose parts are all empty get ``s = 0``: out 0, lse ``-inf``."""
    enter_launch(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_h = o_h < Hq
    m_tile = m_h[:, None] & (o_d < HEAD_DIM)[None, :]
    o_lse = i_r * stride_lr + o_h * stride_lh
    o_out = i_r * stride_or + o_h[:, None] * stride_oh + o_d[None, :]

    # Pass 1: the largest lse (masked heads read -inf and stay empty).
    b_m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    if STACKED:
        p_l = l_0  # advanced by the part stride (a product of the part index could overflow int32)
        for i in range(NUM_PARTS):
            b_lse = tl.load(p_l + o_lse, mask=m_h, other=float("-inf"))
            b_m = tl.maximum(b_m, b_lse)
            p_l += stride_lp
    else:
        for i in tl.static_range(NUM_PARTS):
            p_l = part_pointer(i, l_0, l_1, l_2, l_3, l_4, l_5, l_6, l_7)
            b_lse = tl.load(p_l + o_lse, mask=m_h, other=float("-inf"))
            b_m = tl.maximum(b_m, b_lse)
    # Every part empty: shift by 0, so that the weights are exp(-inf) = 0, not NaN. A NaN lse makes b_m
    # NaN or is skipped by the max; either way its weight exp(NaN - shift) makes s and acc NaN.
    b_shift = tl.where(b_m == float("-inf"), 0.0, b_m)

    # Pass 2: the sum of the weights and the weighted outputs, part after part.
    b_s = tl.zeros([BLOCK_H], tl.float32)
    b_acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if STACKED:
        p_l = l_0
        p_o = o_0
        for i in range(NUM_PARTS):
            b_lse = tl.load(p_l + o_lse, mask=m_h, other=float("-inf"))
            b_acc, b_s = fold_part(b_acc, b_s, b_lse, b_shift, p_o, o_out, m_tile)
            p_l += stride_lp
            p_o += stride_op
    else:
        for i in tl.static_range(NUM_PARTS):
            p_l = part_pointer(i, l_0, l_1, l_2, l_3, l_4, l_5, l_6, l_7)
            p_o = part_pointer(i, o_0, o_1, o_2, o_3, o_4, o_5, o_6, o_7)
            b_lse = tl.load(p_l + o_lse, mask=m_h, other=float("-inf"))
            b_acc, b_s = fold_part(b_acc, b_s, b_lse, b_shift, p_o, o_out, m_tile)

    # s == 0 only where every part is empty (otherwise s >= 1, or NaN, which the division carries).
    m_empty = b_s == 0.0
    b_o = tl.where(m_empty[:, None], 0.0, b_acc / tl.where(m_empty, 1.0, b_s)[:, None])
    p_out = out_ptr + i_r * stride_out_row + o_h[:, None] * stride_out_head + o_d[None, :]
    tl.store(p_out, b_o.to(out_ptr.dtype.element_ty), mask=m_tile)
    if RETURN_LSE:
        b_l = tl.where(m_empty, float("-inf"), b_shift + tl.log(tl.where(m_empty, 1.0, b_s)))
        tl.store(lse_ptr + i_r * stride_lse_row + o_h, b_l, mask=m_h)


# ------------------------------------------------------------------------------------ inputs, launcher


def _parts(name: str, x, part_ndim: int, what: str) -> tuple[torch.Tensor | None, list]:
    """``(stacked, parts)`` of ``outs`` or ``lses``: a stacked tensor (``[P, ...]``) and its P views, or
    None and the sequence's P tensors."""
    if isinstance(x, torch.Tensor):
        if x.dim() != part_ndim + 1:
            raise ValueError(f"{name} must be a sequence of P {what} tensors or one stacked "
                             f"[P, {what[1:]} tensor, got a tensor of shape {tuple(x.shape)}")
        return x, list(x.unbind(0))
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise TypeError(f"{name} must be a sequence of P {what} tensors or one stacked [P, {what[1:]} tensor, "
                        f"got {type(x).__name__}")
    parts = list(x)
    for i, t in enumerate(parts):
        check_tensor(f"{name}[{i}]", t, ndim=part_ndim, what=what)
    return None, parts


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, end)`` that ``t``'s elements lie in."""
    if t.numel() == 0:
        return (0, 0)
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 1)
    first = t.data_ptr()
    return first, first + (last + 1) * t.element_size()


def _check_merge_args(outs, lses, out, return_lse):
    """Check the arguments of :func:`merge_attention_states`; ``(outs_stacked, out_parts, lses_stacked,
    lse_parts)``."""
    check_bool("return_lse", return_lse)
    outs_stacked, out_parts = _parts("outs", outs, 3, "[rows, Hq, D]")
    lses_stacked, lse_parts = _parts("lses", lses, 2, "[rows, Hq]")
    if not out_parts:
        raise ValueError("outs must hold at least one part (P >= 1), got none")
    if len(lse_parts) != len(out_parts):
        raise ValueError(f"lses must hold one [rows, Hq] tensor per part of outs (P = {len(out_parts)}), "
                         f"got {len(lse_parts)}")
    first = out_parts[0]
    check_tensor("outs[0]", first, dtypes=OUT_DTYPES, what="[rows, Hq, D]")
    rows, hq, d = first.shape
    device = first.device
    for i, t in enumerate(out_parts):
        check_tensor(f"outs[{i}]", t, dtypes=first.dtype, shape=(rows, hq, d), what="[rows, Hq, D] (outs[0]'s)")
        if not same_device(t.device, device):
            raise ValueError(f"outs[{i}] must be on {device} (outs[0]'s device), got {t.device}")
        if d > 1 and t.stride(2) != 1:
            raise ValueError(f"outs[{i}] must be contiguous in its last (D) dimension, got strides {t.stride()}")
    for i, t in enumerate(lse_parts):
        check_tensor(f"lses[{i}]", t, dtypes=torch.float32, shape=(rows, hq), what="[rows, Hq] fp32")
        if not same_device(t.device, device):
            raise ValueError(f"lses[{i}] must be on {device} (outs[0]'s device), got {t.device}")
    if torch.is_grad_enabled():
        for name, ts in (("outs", out_parts), ("lses", lse_parts)):
            if any(t.requires_grad for t in ts):
                raise ValueError(f"{name} requires grad, but merge_attention_states is forward-only (its "
                                 f"output would be detached from the graph): call it under torch.no_grad() or "
                                 f"torch.inference_mode(), or pass detached tensors")
    if out is not None:
        check_tensor("out", out, dtypes=first.dtype, shape=(rows, hq, d), what="[rows, Hq, D], outs' dtype")
        if not same_device(out.device, device):
            raise ValueError(f"out must be on {device} (outs' device), got {out.device}")
        if d > 1 and out.stride(2) != 1:
            raise ValueError(f"out must be contiguous in its last (D) dimension, got strides {out.stride()}")
        if overlaps_itself(out):
            raise ValueError(f"out must not have elements that share memory, got strides {tuple(out.stride())}")
        lo, hi = _span(out)
        for name, ts in (("outs", out_parts), ("lses", lse_parts)):
            for i, t in enumerate(ts):
                a, b = _span(t)
                if a < hi and lo < b:
                    raise ValueError(f"out must not share memory with {name}[{i}]")
    return outs_stacked, out_parts, lses_stacked, lse_parts


def _same_layout(parts: list) -> bool:
    return all(t.stride() == parts[0].stride() for t in parts)


def merge_states_config(num_q_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_H, BLOCK_D, num_warps)`` of a merge launch: every column of a head in one program, as many
    heads as fit ``settings.MERGE_STATES_TILE_ELEMENTS``."""
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_q_heads), max(1, settings.MERGE_STATES_TILE_ELEMENTS // block_d))
    return block_h, block_d, 4


def _merge_torch(out_parts, lse_parts, out, lse):
    """The kernel's arithmetic in fp32 PyTorch (same order, same selects; not its bits), for devices Triton
    cannot run on."""
    m = lse_parts[0]
    for b in lse_parts[1:]:
        m = torch.maximum(m, b)
    shift = torch.where(m == -math.inf, torch.zeros_like(m), m)
    s = torch.zeros_like(shift)
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for o, b in zip(out_parts, lse_parts):
        used = b != -math.inf
        w = torch.exp(b - shift)
        s = torch.where(used, s + w, s)
        acc = torch.where(used[..., None], torch.addcmul(acc, w[..., None], o.float()), acc)
    empty = s == 0
    safe = torch.where(empty, torch.ones_like(s), s)
    out.copy_(torch.where(empty[..., None], torch.zeros_like(acc), acc / safe[..., None]))
    if lse is not None:
        lse.copy_(torch.where(empty, torch.full_like(s, -math.inf), shift + torch.log(safe)))


def merge_attention_states(outs, lses, *, out=None, return_lse: bool = False):
    """Merge attention outputs computed over disjoint token sets of the same rows into attention over their
    union (decode context parallelism: each rank attends its share of every row's tokens).

    With ``P`` parts ``(out_i, lse_i)`` as ``qsa.sparse_paged_attention(..., return_lse=True)`` returns them
    (``lse_i`` the natural-log LSE, ``-inf`` and ``out_i = 0`` where part ``i``'s token set is empty):

    * ``lse = ln(sum_i exp(lse_i))``;
    * ``out = sum_i w_i * out_i``, ``w_i = exp(lse_i - lse)``,

    in fp32, rounded once to the outs' dtype. The kernel takes the weights relative to the largest
    ``lse_i``, ``out = sum_i exp(lse_i - m) out_i / sum_i exp(lse_i - m)``, the same weights without the
    rounding of ``lse`` in them. The parts are folded in a fixed order, part 0, 1, 2, ..., one after another
    (explicit fused multiply-adds), so the result is bitwise deterministic and depends on the inputs'
    values alone: not on the batch, a row's place in it, or whether the parts come as a sequence or
    stacked.
    Only for ungated parts: a gated output (``gate=``) is no longer the attention the LSE weighs.

    Empty parts: a part with ``lse_i = -inf`` contributes nothing; its weight is exactly 0 by a select, and
    its ``out_i`` is neither read nor multiplied, so a NaN or garbage there (the contract says 0) does not
    leak. A row and head with every part empty gets out 0 and lse ``-inf``, never NaN. Non-finite lse: a
    NaN or ``+inf`` ``lse_i`` makes that row and head's out and lse NaN (NaN propagates); values are not
    checked on the host (that would synchronise). A NaN or inf in a non-empty part's ``out_i`` reaches the
    result as arithmetic takes it. Merging is associative only up to rounding: merge all parts at once.

    How the parts reach the kernel, one launch and no copy in the usual cases: a stacked tensor is read in
    place through its part stride (a loop over parts of any count); up to ``MAX_POINTER_PARTS`` (8) separate
    tensors of one layout are passed as one pointer argument each (so a replayed eager step,
    :mod:`qsa.attention.replay`, can feed them new tensors); more separate tensors than that, or separate
    tensors of different strides, are stacked first (a copy). Every way gives the same bits. No host
    synchronisation, no ``.item()``: the call can be captured in a CUDA graph. Where Triton cannot run (a CPU
    without ``TRITON_INTERPRET=1``) the same arithmetic runs in PyTorch, logged once on the ``qsa`` logger.

    Args:
        outs: ``P >= 1`` tensors ``[rows, Hq, D]`` (fp16, bf16 or fp32; one dtype, shape and device; last dim
            contiguous), or one stacked tensor ``[P, rows, Hq, D]``.
        lses: ``P`` fp32 tensors ``[rows, Hq]`` or one stacked ``[P, rows, Hq]``, on the outs' device; any
            strides.
        out: optional ``[rows, Hq, D]`` in the outs' dtype, last dim contiguous, sharing memory with no
            input; every element is written.
        return_lse: also return the merged ``lse [rows, Hq]`` fp32.

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse``.

    Raises:
        TypeError, ValueError: naming the argument, for inputs that are not as described.
    """
    outs_stacked, out_parts, lses_stacked, lse_parts = _check_merge_args(outs, lses, out, return_lse)
    first = out_parts[0]
    rows, hq, d = first.shape
    num_parts = len(out_parts)
    if out is None:
        out = torch.empty((rows, hq, d), dtype=first.dtype, device=first.device)
    lse = torch.empty((rows, hq), dtype=torch.float32, device=first.device) if return_lse else None
    if rows * hq == 0:
        return (out, lse) if return_lse else out
    why = backend.triton_available(first.device)
    if why is not None:
        backend.log_once(f"qsa: merge_attention_states runs in PyTorch: {why}")
        _merge_torch(out_parts, lse_parts, out, lse)
        return (out, lse) if return_lse else out

    both_stacked = outs_stacked is not None and lses_stacked is not None
    stacked = both_stacked or num_parts > MAX_POINTER_PARTS or not (_same_layout(out_parts) and
                                                                    _same_layout(lse_parts))
    if stacked:
        # A stacked input is read in place; separate parts are stacked here (one copy).
        o_all = outs_stacked if outs_stacked is not None else torch.stack(out_parts)
        l_all = lses_stacked if lses_stacked is not None else torch.stack(lse_parts)
        o_ptrs, l_ptrs = [o_all] * MAX_POINTER_PARTS, [l_all] * MAX_POINTER_PARTS
        o_strides, l_strides = o_all.stride()[:3], l_all.stride()
    else:
        # Up to 8 parts of one layout, each its own pointer (a stacked input's parts are views of it).
        o_ptrs = out_parts + [out_parts[0]] * (MAX_POINTER_PARTS - num_parts)
        l_ptrs = lse_parts + [lse_parts[0]] * (MAX_POINTER_PARTS - num_parts)
        o_strides, l_strides = (0,) + out_parts[0].stride()[:2], (0,) + lse_parts[0].stride()
    block_h, block_d, warps = merge_states_config(hq, d)
    lse_t = lse if lse is not None else lse_parts[0]
    launch_kernel(merge_attention_states_kernel, (rows, triton.cdiv(hq, block_h)),
        *o_ptrs, *l_ptrs, out, lse_t, hq,
        *o_strides,
        *l_strides,
        out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
        NUM_PARTS=num_parts, STACKED=stacked, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=block_h,
        RETURN_LSE=lse is not None, num_warps=warps, **launch_options(out.device),
    )
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------- reference


def merge_reference(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge in fp64 PyTorch, the tests' ground truth: ``(out, lse)``, ``out [rows, Hq, D]`` and
    ``lse [rows, Hq]``, both fp64 (not rounded to the outs' dtype).

    ``lse = ln(sum_i exp(lse_i))``, ``out = sum_i exp(lse_i - lse) * out_i`` over the parts with
    ``lse_i != -inf`` (an empty part's ``out_i`` is never multiplied); every part empty gives out 0 and lse
    ``-inf``; a NaN or ``+inf`` lse gives NaN. Arguments as :func:`merge_attention_states` (checked alike).
    """
    _, out_parts, _, lse_parts = _check_merge_args(outs, lses, None, False)
    o = torch.stack([t.to(torch.float64) for t in out_parts])  # [P, rows, Hq, D]
    ls = torch.stack([t.to(torch.float64) for t in lse_parts])  # [P, rows, Hq]
    used = ls != -math.inf
    m = ls.max(dim=0).values  # NaN wins
    shift = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w = torch.where(used, torch.exp(ls - shift), torch.zeros_like(ls))
    s = w.sum(dim=0)
    empty = s == 0
    lse = torch.where(empty, torch.full_like(s, -math.inf), shift + torch.log(torch.where(empty, 1.0, s)))
    weighted = torch.where(used[..., None], (w / torch.where(empty, 1.0, s))[..., None] * o, torch.zeros_like(o))
    return weighted.sum(dim=0), lse
