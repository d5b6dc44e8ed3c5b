"""The grouped route's launcher and settings: 8 adjacent rows x all their heads share each K/V load.

The kernel (:mod:`.kernel`) walks a group's :class:`~qsa.attention.planning.plan.GroupedPlan` list
(the union of the rows' kept tokens by request and logical microblock) tile by tile; each program
computes ``rows_per_prog`` rows of one KV head's query heads, with an online softmax per row and the
row's bit of each microblock's mask. Long lists are split when the groups alone do not fill the GPU
(:func:`qsa.attention.routing.split_count`), and the splits merged in order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ... import settings
from ...utils import interpreter_enabled, launch_options, next_pow2
from .. import routing
from ..launch import dot_dtype, kernel_args, merge_splits, partials, same_kv_strides, scores_scale
from ..planning.plan import GroupedPlan
from ..replay import launch as launch_kernel


def grouped_config(G: int, head_dim: int, kv_fp8: bool = False) -> settings.GroupedConfig:
    """Grouped-kernel settings for G query heads per KV head at ``head_dim``, over an FP8 cache or not.

    head_dim 256 up to 8 heads per KV head: 8 rows fill a 64-row tile on 4 warps, 3 stages. More heads
    (12/1, 24/2): 128-row tiles on 8 warps with the plan-entry prefetch and the lazy rescale, which keep
    all 8 rows per program. An FP8 cache, whose tiles are converted in registers, takes the prefetch (and
    the lazy rescale on 64-row tiles). ``docs/tuning.md`` says how these were chosen."""
    wide = head_dim == 256 and settings.GROUP_ROWS * G > 64  # 12/1, 24/2: 128-row tiles, 8 warps, prefetch
    tile_rows = 64 if head_dim == 256 and not wide else routing.MAX_TILE_ROWS
    rows = settings.GROUP_ROWS
    while rows > 1 and rows * G > tile_rows:
        rows //= 2
    block_m = max(16, next_pow2(rows * G))
    return settings.GroupedConfig(rows_per_prog=rows, block_m=block_m, mb=8,
                                  num_warps=8 if wide else 4, num_stages=3, prefetch=wide or kv_fp8,
                                  lazy_rescale=wide or (kv_fp8 and block_m == 64))


@dataclass
class GroupedLaunch:
    """The grouped launch of one step, decided when it is planned: settings, split count, partials."""

    config: settings.GroupedConfig
    splits: int
    partials: tuple[torch.Tensor, torch.Tensor] | None  # fp32 split partials where splits > 1


def plan_launch(plan: GroupedPlan, *, num_q_heads: int, num_kv_heads: int, head_dim: int, kv_fp8: bool, device,
                config: settings.GroupedConfig | None = None, num_splits: int | None = None,
                reuse: GroupedLaunch | None = None) -> GroupedLaunch | None:
    """Settings (default :func:`grouped_config`), splits (default
    :func:`~qsa.attention.routing.split_count` over the plan's capacity) and partials of the grouped
    launch of ``plan``; None for a plan of no groups. ``reuse``: an earlier plan's launch, whose partials
    are kept where they fit."""
    if plan.num_groups == 0:
        return None
    G = num_q_heads // num_kv_heads
    cfg = config or grouped_config(G, head_dim, kv_fp8)
    if plan.group_rows % cfg.rows_per_prog:
        # A program computes whole sub-groups: the most rows that divide the plan's groups (plan_groups
        # takes 1..8 rows per group; the public routes plan 8).
        rows = max(r for r in range(1, cfg.rows_per_prog + 1) if plan.group_rows % r == 0)
        cfg = dataclasses.replace(cfg, rows_per_prog=rows)
    programs = plan.num_groups * (plan.group_rows // cfg.rows_per_prog) * num_kv_heads
    splits = num_splits or routing.split_count(programs, -(-plan.capacity // cfg.mb), cfg.programs_per_sm, device)
    parts = partials(plan.num_rows, num_q_heads, splits, head_dim, device,
                     reuse=reuse.partials if reuse is not None else None) if splits > 1 else None
    return GroupedLaunch(cfg, splits, parts)


def grouped_attention(q, k, v, plan: GroupedPlan, *, out, lse, gate, softmax_scale, k_scale, v_scale,
                      kv_fp8: bool, config: settings.GroupedConfig | None = None,
                      num_splits: int | None = None, launch: GroupedLaunch | None = None) -> None:
    """Rows ``[0, plan.num_rows)`` of ``out`` (and ``lse``) from the grouped plan, as ``launch`` (from
    :func:`plan_launch`) says; decided here from ``config`` and ``num_splits`` when it is None."""
    from .kernel import grouped_attention_kernel

    if plan.num_groups == 0:
        return
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[2]
    G = hq // hkv
    if launch is None:
        launch = plan_launch(plan, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_fp8=kv_fp8, device=q.device,
                             config=config, num_splits=num_splits)
    cfg, splits = launch.config, launch.splits
    q, qk_scale = scores_scale(q, softmax_scale, k_scale)
    strides, g, lse_t = kernel_args(q, k, v, out, gate, lse)
    subs = plan.group_rows // cfg.rows_per_prog
    part_acc, part_ml = launch.partials if splits > 1 else (out, out)
    launch_kernel(grouped_attention_kernel, (plan.num_groups * subs, hkv, splits),
        q, k, v, plan.mb_ids, plan.masks, plan.counts, g, out, lse_t, part_acc, part_ml,
        plan.num_rows, hq, qk_scale, float(v_scale),
        stride_plan=plan.mb_ids.stride(0), **strides,
        G=G, GROUP_ROWS=plan.group_rows, ROWS_PER_PROG=cfg.rows_per_prog, BLOCK_M=cfg.block_m,
        MB=cfg.mb, NUM_SPLITS=splits, PREFETCH=cfg.prefetch, HEAD_DIM=d, BLOCK_SIZE=plan.block_size, KV_FP8=kv_fp8,
        SAME_KV_STRIDES=same_kv_strides(k, v), LAZY_RESCALE=cfg.lazy_rescale, DOT_DTYPE=dot_dtype(q),
        HAS_GATE=gate is not None, RETURN_LSE=lse is not None, PTX=rescale_ptx(q, cfg),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(q.device),
    )
    if splits > 1:
        merge_splits(part_acc, part_ml, out=out, lse=lse, gate=gate, row_offset=0, v_scale=v_scale,
                     num_splits=splits)


def rescale_ptx(q, cfg: settings.GroupedConfig) -> bool:
    """Whether the grouped kernel skips identity rescales by warp (``attend_tile``): on a GPU, for
    tiles of 16 rows per warp (one 64-row wgmma per 4 warps), where each thread holds two rows."""
    return q.is_cuda and not interpreter_enabled() and cfg.block_m == 16 * cfg.num_warps
