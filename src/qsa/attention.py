"""Launchers of the attention kernels: shape math, tile choice, grids, partial buffers. No math."""

from __future__ import annotations

import dataclasses
import math

import torch

from . import routes
from .plan import GroupedPlan, SingleRowPlan
from .utils import device_facts, dot_in_fp32, interpreter_enabled, launch_options, next_pow2

def _dot_dtype(q: torch.Tensor):
    """Operand dtype of the kernels' dots: q's, or fp32 where the interpreter mishandles bf16."""
    import triton.language as tl

    if dot_in_fp32(q.dtype):
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[q.dtype]


def _common(q, k, v, out, gate, lse):
    """Strides and flags every attention kernel takes (gate/lse fall back to ``out`` when absent)."""
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


def grouped_attention(q, k, v, plan: GroupedPlan, *, out, lse, gate, softmax_scale, k_scale, v_scale,
                      kv_fp8: bool, config: routes.GroupedConfig | None = None,
                      num_splits: int | None = None) -> None:
    """Rows ``[0, plan.num_rows)`` of ``out`` (and ``lse``) from the grouped plan."""
    from .kernels.grouped import grouped_attention_kernel

    if plan.num_groups == 0:
        return
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[2]
    G = hq // hkv
    cfg = config or routes.grouped_config(G, d, kv_fp8)
    if plan.group_rows % cfg.rows_per_prog:
        # A program computes whole sub-groups: the most rows that divide the plan's groups (plan_groups
        # takes 1..8 rows per group; the public routes plan 8).
        rows = max(r for r in range(1, cfg.rows_per_prog + 1) if plan.group_rows % r == 0)
        cfg = dataclasses.replace(cfg, rows_per_prog=rows)
    q, qk_scale = scores_scale(q, softmax_scale, k_scale)
    strides, g, lse_t = _common(q, k, v, out, gate, lse)
    subs = plan.group_rows // cfg.rows_per_prog
    programs = plan.num_groups * subs * hkv
    splits = num_splits or routes.split_count(programs, -(-plan.capacity // cfg.mb), cfg.programs_per_sm,
                                              q.device)
    part_acc, part_ml = _partials(plan.num_rows, hq, splits, d, q.device) if splits > 1 else (out, out)
    grouped_attention_kernel[(plan.num_groups * subs, hkv, splits)](
        q, k, v, plan.mb_ids, plan.masks, plan.counts, g, out, lse_t, part_acc, part_ml,
        plan.num_rows, hq, qk_scale, float(v_scale),
        stride_plan=plan.mb_ids.stride(0), **strides,
        G=G, GROUP_ROWS=plan.group_rows, ROWS_PER_PROG=cfg.rows_per_prog, BLOCK_M=cfg.block_m,
        MB=cfg.mb, NUM_SPLITS=splits, PREFETCH=cfg.prefetch, HEAD_DIM=d, BLOCK_SIZE=plan.block_size, KV_FP8=kv_fp8,
        SAME_KV_STRIDES=same_kv_strides(k, v), LAZY_RESCALE=cfg.lazy_rescale, DOT_DTYPE=_dot_dtype(q),
        HAS_GATE=gate is not None, RETURN_LSE=lse is not None, PTX=_rescale_ptx(q, cfg),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(q.device),
    )
    if splits > 1:
        _merge(part_acc, part_ml, out=out, lse=lse, gate=gate, row_offset=0, v_scale=v_scale,
               num_splits=splits)


def _rescale_ptx(q, cfg: routes.GroupedConfig) -> bool:
    """Whether the grouped kernel skips identity rescales by warp (``attend_tile``): on a GPU, for
    tiles of 16 rows per warp (one 64-row wgmma per 4 warps), where each thread holds two rows."""
    return q.is_cuda and not interpreter_enabled() and cfg.block_m == 16 * cfg.num_warps


def _merge(part_acc, part_ml, *, out, lse, gate, row_offset, v_scale, num_splits, xqa_lists=None):
    from .kernels.common import merge_splits_kernel

    n, hq, _, d = part_acc.shape
    strides, g, lse_t = _common(out, out, out, out, gate, lse)
    block_d, warps = routes.merge_config(num_splits, d, xqa_lists=xqa_lists)
    merge_splits_kernel[(n, hq, d // block_d)](
        part_acc, part_ml, out, g, lse_t, row_offset, hq, float(v_scale),
        strides["stride_o_row"], strides["stride_o_head"], strides["stride_g_row"],
        strides["stride_g_head"], strides["stride_lse_row"],
        NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), HEAD_DIM=d,
        HAS_GATE=gate is not None, RETURN_LSE=lse is not None, BLOCK_D=block_d, num_warps=warps,
        **launch_options(out.device),
    )


def _partials(n, hq, splits, d, device, copies: int = 1):
    """fp32 split partials ``(acc [n, hq, splits, d], ml [n, hq, splits, 2])``; with ``copies`` > 1, that
    many such pairs cut from two allocations."""
    acc = torch.empty((copies, n, hq, splits, d), dtype=torch.float32, device=device)
    ml = torch.empty((copies, n, hq, splits, 2), dtype=torch.float32, device=device)
    if copies == 1:
        return acc[0], ml[0]
    return [(acc[i], ml[i]) for i in range(copies)]


def _score_halves(cfg: routes.SplitConfig | routes.InvariantConfig, head_dim: int) -> bool:
    """Whether an xqa, splitk or invariant launch takes its scores over the head's column halves: as ``cfg`` says,
    where a half (at least 16 columns) is deep enough for a dot; the planned and the direct xqa kernel
    decide alike."""
    return cfg.qk_halves and head_dim >= 32


def xqa_attention(q, k, v, plan: SingleRowPlan, *, row_start: int, out, lse, gate, softmax_scale,
                  k_scale, v_scale, kv_fp8: bool, config: routes.SplitConfig | None = None,
                  num_splits: int | None = None, index_width: int | None = None) -> None:
    """Rows ``[row_start, rows)`` of ``out`` (and ``lse``) from the single-row plan; ``index_width`` (the
    columns of the ``indices`` it was planned from) cuts rows the direct kernel could take as it would
    (:func:`qsa.routes.xqa_cut`)."""
    from .kernels.xqa import xqa_attention_kernel

    rows, hq, d = q.shape
    n = rows - row_start
    if n <= 0:
        return
    hkv = k.shape[2]
    G = hq // hkv
    cfg = config or routes.xqa_config(G, d)
    mb = cfg.tile_tokens // 4
    cut = routes.xqa_cut(G, d, n, hkv, index_width, cfg.tile_tokens, kv_fp8, q.device)
    splits = num_splits or (cut[0] if cut else routes.split_count(n * hkv, -(-plan.capacity // mb),
                                                                  cfg.programs_per_sm, q.device))
    q, qk_scale = scores_scale(q, softmax_scale, k_scale)
    strides, g, lse_t = _common(q, k, v, out, gate, lse)
    part_acc, part_ml = _partials(n, hq, splits, d, q.device) if splits > 1 else (out, out)
    xqa_attention_kernel[(n, hkv, splits)](
        q, k, v, plan.mb_ids, plan.masks, plan.counts, g, out, lse_t, part_acc, part_ml,
        row_start, cut[1] if cut else 0, hq, qk_scale, float(v_scale),
        stride_ids=plan.mb_ids.stride(0), stride_masks=plan.masks.stride(0), **strides,
        G=G, BLOCK_G=max(16, next_pow2(G)), MB=mb, NUM_SPLITS=splits, PREFETCH=cfg.prefetch,
        HALVES=_score_halves(cfg, d),
        HEAD_DIM=d, BLOCK_SIZE=plan.block_size, KV_FP8=kv_fp8, SAME_KV_STRIDES=same_kv_strides(k, v),
        DOT_DTYPE=_dot_dtype(q),
        HAS_GATE=gate is not None, RETURN_LSE=lse is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(q.device),
    )
    if splits > 1:
        _merge(part_acc, part_ml, out=out, lse=lse, gate=gate, row_offset=row_start, v_scale=v_scale,
               num_splits=splits, xqa_lists=n * hkv)


def _row_scratch(scratch, rows: int, block_w: int, device) -> torch.Tensor:
    """The scratch rows of the kernels that sort a row of ``indices`` themselves: ``scratch`` checked, or a new
    ``[rows, block_w]`` int32 tensor."""
    if scratch is None:
        return torch.empty((rows, block_w), dtype=torch.int32, device=device)
    if scratch.dtype != torch.int32 or scratch.shape[0] != rows or scratch.shape[1] < block_w \
            or scratch.stride(1) != 1:
        raise ValueError(f"scratch must be a [{rows}, >= {block_w}] int32 tensor, got {tuple(scratch.shape)}")
    return scratch


def xqa_direct_attention(q, k, v, indices, block_table, token_to_req, positions, seq_lens, *, row_start: int,
                         out, lse, gate, softmax_scale, k_scale, v_scale, kv_fp8: bool,
                         config: routes.SplitConfig | None = None, num_splits: int | None = None,
                         scratch: torch.Tensor | None = None) -> None:
    """Rows ``[row_start, rows)`` of ``out`` (and ``lse``) straight from ``indices``: no plan launch.

    ``scratch`` (``[rows, >= next_pow2(W)]`` int32, allocated when None) receives the lists of rows that
    are not sorted; the rows of sorted ones are left untouched."""
    from .kernels.xqa import xqa_direct_kernel

    rows, hq, d = q.shape
    n = rows - row_start
    if n <= 0:
        return
    hkv = k.shape[2]
    G = hq // hkv
    width = indices.shape[1]
    cfg = config or routes.xqa_direct_config(G, d, n * hkv, kv_fp8=kv_fp8)
    block_w = max(16, next_pow2(width))
    cut_splits, tiles = routes.direct_cut(n * hkv, width, cfg, q.device)
    splits = num_splits or cut_splits
    q, qk_scale = scores_scale(q, softmax_scale, k_scale)
    strides, g, lse_t = _common(q, k, v, out, gate, lse)
    scratch = _row_scratch(scratch, rows, block_w, q.device)
    split_n = next_pow2(-(-tiles // splits) * cfg.tile_tokens)  # a split's entries, rounded up
    resolve = cfg.resolve_split and routes.direct_resolves(n * hkv, splits, split_n, cfg.programs_per_sm, q.device)
    defer = cfg.defer_check and resolve and splits > 1
    if defer:  # the merge recomputes a row out of order into partials of its own
        (part_acc, part_ml), redo = _partials(n, hq, splits, d, q.device, copies=2)
    else:
        part_acc, part_ml = _partials(n, hq, splits, d, q.device) if splits > 1 else (out, out)
    inputs = (q, k, v, indices, block_table, token_to_req, positions, seq_lens, scratch)
    sizes = (row_start, width, block_table.shape[0], block_table.shape[1], k.shape[0], hq, qk_scale, float(v_scale))
    shared = dict(stride_idx_row=indices.stride(0), stride_scratch_row=scratch.stride(0),
                  stride_bt=block_table.stride(0), **strides,
                  G=G, BLOCK_G=max(16, next_pow2(G)), BLOCK_N=cfg.tile_tokens, BLOCK_W=block_w, NUM_SPLITS=splits,
                  HEAD_DIM=d, BLOCK_SIZE=k.shape[1], KV_FP8=kv_fp8, SAME_KV_STRIDES=same_kv_strides(k, v),
                  DOT_DTYPE=_dot_dtype(q), HAS_GATE=gate is not None, RETURN_LSE=lse is not None)
    xqa_direct_kernel[(n, hkv, splits)](
        *inputs, g, out, lse_t, part_acc, part_ml, *sizes, **shared,
        PREFETCH=cfg.prefetch and not resolve, SPLIT_N=split_n if resolve else 0, DEFER_CHECK=defer,
        HALVES=_score_halves(cfg, d),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
        # The merge launched as this kernel starts, only with the deferred check (164-166 registers: the
        # merge's programs can wait beside it). On the H200, plan + run: mtp-16 16.94-17.44 -> 16.85-16.99
        # us, but decode-64 (the whole-row check, 210 registers) 52.1-52.7 -> 53.2-53.5, as for every
        # direct kernel before the deferral (decode-64 58.0 -> 61.4); with the trigger for the deferred
        # check only, mtp-16 16.99-17.44 -> 16.90-17.25, mtp-5 and decode-1 0.4-0.5 us faster
        # (benchmarks/results/experiments/2026-11-30-1819-direct-step-variants, -1832-direct-early-merge).
        **launch_options(q.device, early_trigger=defer),
    )
    if defer:
        from .kernels.xqa import xqa_direct_merge_kernel

        block_d, warps = routes.merge_config(splits, d, xqa_lists=n * hkv)
        cap = routes.direct_merge_registers(n * hkv * splits, cfg.programs_per_sm, q.device)
        xqa_direct_merge_kernel[(n, hq, d // block_d)](
            part_acc, part_ml, *redo, out, g, lse_t, *inputs, *sizes, **shared, BLOCK_S=next_pow2(splits),
            BLOCK_D=block_d, HALVES=_score_halves(cfg, d), num_warps=warps, **({"maxnreg": cap} if cap else {}),
            **launch_options(q.device))
    elif splits > 1:
        _merge(part_acc, part_ml, out=out, lse=lse, gate=gate, row_offset=row_start, v_scale=v_scale,
               num_splits=splits, xqa_lists=n * hkv)


def invariant_attention(q, k, v, indices, block_table, token_to_req, positions, seq_lens, *, out, lse, gate,
                        softmax_scale, k_scale, v_scale, kv_fp8: bool, config: routes.InvariantConfig | None = None,
                        fold: bool | None = None, scratch: torch.Tensor | None = None) -> None:
    """All rows of ``out`` (and ``lse``) on the batch-invariant route, straight from ``indices``.

    ``fold`` (default :func:`qsa.routes.invariant_folds`) picks one program per row and KV head that folds
    the row's splits itself, or one per split and a merge launch; the two give the same bits, so the
    choice, made from the batch's size, changes none. ``scratch`` as in :func:`xqa_direct_attention`."""
    from .kernels.invariant import invariant_attention_kernel, invariant_merge_kernel

    rows, hq, d = q.shape
    if rows == 0:
        return
    hkv = k.shape[2]
    G = hq // hkv
    width = indices.shape[1]
    cfg = config or routes.invariant_config(G, d, rows * hkv, kv_fp8)
    block_w = max(16, next_pow2(width))
    if fold is None:
        fold = routes.invariant_folds(rows * hkv)
    splits = -(-routes.direct_tiles(width, cfg.tile_tokens) // cfg.split_tiles)
    q, qk_scale = scores_scale(q, softmax_scale, k_scale)
    strides, g, lse_t = _common(q, k, v, out, gate, lse)
    scratch = _row_scratch(scratch, rows, block_w, q.device)
    part_acc, part_ml = (out, out) if fold else _partials(rows, hq, splits, d, q.device)
    block_g = max(16, next_pow2(G))
    shared = dict(G=G, BLOCK_G=block_g, NUM_SPLITS=splits, HEAD_DIM=d, HAS_GATE=gate is not None,
                  RETURN_LSE=lse is not None)
    invariant_attention_kernel[(rows, hkv, 1 if fold else splits)](
        q, k, v, indices, block_table, token_to_req, positions, seq_lens, scratch, g, out, lse_t, part_acc, part_ml,
        width, block_table.shape[0], block_table.shape[1], k.shape[0], hq, qk_scale, float(v_scale),
        stride_idx_row=indices.stride(0), stride_scratch_row=scratch.stride(0), stride_bt=block_table.stride(0),
        **strides, **shared, BLOCK_N=cfg.tile_tokens, BLOCK_W=block_w, SPLIT_TILES=cfg.split_tiles,
        SPLIT_N=next_pow2(cfg.split_tiles * cfg.tile_tokens), FOLD=fold,
        BLOCK_SIZE=k.shape[1], KV_FP8=kv_fp8, SAME_KV_STRIDES=same_kv_strides(k, v), DOT_DTYPE=_dot_dtype(q),
        HALVES=_score_halves(cfg, d), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}), **launch_options(q.device))
    if not fold:
        block_d = routes.invariant_merge_columns(splits, d, block_g)
        invariant_merge_kernel[(rows, hkv, d // block_d)](
            part_acc, part_ml, g, out, lse_t, hq, float(v_scale), strides["stride_o_row"], strides["stride_o_head"],
            strides["stride_g_row"], strides["stride_g_head"], strides["stride_lse_row"], **shared,
            BLOCK_D=block_d, num_warps=4, **launch_options(q.device))


def splitk_attention(q, k, v, tokens, counts, block_table, token_to_req, *, block_size: int, out, lse,
                     gate, softmax_scale, k_scale, v_scale, kv_fp8: bool,
                     config: routes.SplitConfig | None = None, num_splits: int | None = None) -> None:
    """All rows of ``out`` (and ``lse``) from per-row token lists (``plan.token_lists``)."""
    from .kernels.splitk import splitk_attention_kernel

    rows, hq, d = q.shape
    if rows == 0:
        return
    hkv = k.shape[2]
    G = hq // hkv
    facts = device_facts(str(q.device))
    cfg = config or routes.splitk_config(G, d, rows * hkv, kv_fp8=kv_fp8,
                                         sm_count=facts["sm_count"] if facts["kind"] == "cuda" else None)
    splits = num_splits or routes.split_count(rows * hkv, -(-tokens.shape[1] // cfg.tile_tokens),
                                              cfg.programs_per_sm, q.device)
    q, qk_scale = scores_scale(q, softmax_scale, k_scale)
    strides, g, lse_t = _common(q, k, v, out, gate, lse)
    part_acc, part_ml = _partials(rows, hq, splits, d, q.device) if splits > 1 else (out, out)
    splitk_attention_kernel[(rows, hkv, splits)](
        q, k, v, tokens, counts, block_table, token_to_req, g, out, lse_t, part_acc, part_ml,
        hq, qk_scale, float(v_scale),
        stride_tok=tokens.stride(0), stride_bt=block_table.stride(0), **strides,
        G=G, BLOCK_G=max(16, next_pow2(G)), BLOCK_N=cfg.tile_tokens, NUM_SPLITS=splits,
        HEAD_DIM=d, BLOCK_SIZE=block_size, KV_FP8=kv_fp8, SAME_KV_STRIDES=same_kv_strides(k, v),
        DOT_DTYPE=_dot_dtype(q), HALVES=_score_halves(cfg, d),
        HAS_GATE=gate is not None, RETURN_LSE=lse is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(q.device),
    )
    if splits > 1:
        _merge(part_acc, part_ml, out=out, lse=lse, gate=gate, row_offset=0, v_scale=v_scale,
               num_splits=splits)
