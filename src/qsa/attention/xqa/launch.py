"""The xqa route's launcher and settings: one row, all G query heads of a KV head per program.

Two kernels (:mod:`.kernel`): the planned one reads the row's :class:`~qsa.attention.planning.plan.SingleRowPlan`
list; the direct one reads the row's entries straight from ``indices`` (rows sorted as ``select_tokens``
emits them, at most ``settings.DIRECT_MAX_ROWS``; see :mod:`qsa.attention.routing`), checks that they
ascend and sorts a row that does not. Both split long rows over programs and merge the splits in order;
a row that either kernel could take is cut the same way by both (:func:`xqa_cut`), so it gets the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import settings, utils
from ...utils import launch_options, next_pow2
from .. import routing
from .. import launch as common
from ..launch import (direct_tiles, dot_dtype, kernel_args, merge_splits, partials, row_scratch, same_kv_strides,
                      score_halves, scores_scale)
from ..planning.plan import SingleRowPlan, count_args
from ..replay import launch as launch_kernel


def xqa_config(G: int, head_dim: int) -> settings.SplitConfig:
    """Settings of the planned xqa kernel: 32-token tiles, four K/V buffers fed by the plan-entry prefetch,
    one program per SM; the scores over column halves at head_dim 256, as in the direct kernel, so that a
    row gets the same bits from either kernel."""
    return settings.SplitConfig(tile_tokens=32, num_warps=4, num_stages=4, programs_per_sm=1, prefetch=True,
                                qk_halves=head_dim >= 256)


def xqa_direct_config(G: int, head_dim: int, lists: int = 1, kv_fp8: bool = False) -> settings.SplitConfig:
    """Settings of the direct kernel for ``lists`` = rows x KV heads.

    32-token tiles, 3 stages, about two programs per SM (three over an FP8 cache past
    ``DIRECT_CAP_LISTS`` lists). Each split's tokens and pages are read while its row is checked
    (``resolve_split``, where :func:`direct_resolves` allows). Up to ``DIRECT_CAP_LISTS`` lists, or over
    an FP8 cache, the kernel is capped at ``DIRECT_MAX_REGISTERS`` (three programs per SM; the spills
    fall before the tile loop), and up to ``DIRECT_CAP_LISTS`` lists each split checks only its own
    positions (``defer_check``: the merge recomputes a row found out of order). At head_dim 256 the
    scores are taken over the head's two column halves."""
    capped = lists <= settings.DIRECT_CAP_LISTS or kv_fp8
    return settings.SplitConfig(tile_tokens=32, num_warps=4, num_stages=3,
                                programs_per_sm=3 if kv_fp8 and lists > settings.DIRECT_CAP_LISTS else 2,
                                prefetch=lists <= 16, resolve_split=True, defer_check=lists <= settings.DIRECT_CAP_LISTS,
                                max_registers=settings.DIRECT_MAX_REGISTERS if capped else None, qk_halves=head_dim >= 256)


def direct_merge_registers(programs: int, programs_per_sm: int, device: torch.device) -> int | None:
    """Register cap of ``xqa_direct_merge_kernel`` after a direct launch of ``programs`` programs, or None.

    The deferred merge is launched as the direct kernel starts (programmatic dependent launch) and waits
    for it; capped at ``DIRECT_MAX_REGISTERS`` its programs fit beside two direct programs. Capped only
    where the direct launch fills its programs per SM (where programs are left free, the cap was slower)."""
    facts = utils.device_facts(str(device))
    if facts["kind"] != "cuda" or programs < programs_per_sm * facts["sm_count"]:
        return None
    return settings.DIRECT_MAX_REGISTERS


def direct_split_count(programs: int, tiles: int, programs_per_sm: int, device: torch.device) -> int:
    """Splits of the direct xqa kernel, whose rows are ``tiles`` tiles long whatever they keep.

    :func:`~qsa.attention.routing.split_count` up to ``DIRECT_MAX_SPLITS``, unless that puts more than
    1/``DIRECT_WAVE_SLACK`` of a wave of programs into a second wave: then the most splits that fit one
    wave. Then as few splits as hold the same most tiles per split, so that no split is empty. Up to
    ``DIRECT_ALONE_LISTS`` lists the count aims at one program per SM (a program then has its SM to itself
    beside the waiting merge), else at the config's programs per SM."""
    if programs <= settings.DIRECT_ALONE_LISTS:
        programs_per_sm = 1
    want = routing.split_count(programs, tiles, programs_per_sm, device, cap=settings.DIRECT_MAX_SPLITS)
    facts = utils.device_facts(str(device))
    slots = programs_per_sm * facts["sm_count"]
    if facts["kind"] == "cuda" and programs * want > slots + slots // settings.DIRECT_WAVE_SLACK and programs <= slots:
        want = slots // programs
    return -(-tiles // -(-tiles // want))


def direct_cut(lists: int, index_width: int, cfg: settings.SplitConfig, device: torch.device) -> tuple[int, int]:
    """(splits, tiles) of a direct xqa launch of ``lists`` lists with settings ``cfg``: its rows' tiles
    (:func:`direct_tiles`) cut by :func:`direct_split_count`."""
    tiles = direct_tiles(index_width, cfg.tile_tokens)
    return direct_split_count(lists, tiles, cfg.programs_per_sm, device), tiles


def xqa_cut(G: int, head_dim: int, rows: int, hkv: int, index_width: int | None, tile_tokens: int,
            kv_fp8: bool, device: torch.device) -> tuple[int, int] | None:
    """(splits, tiles cut) of a planned xqa launch of ``rows`` rows that the direct kernel could have
    taken (:func:`~qsa.attention.routing.direct_admits`), or None for any other launch (then
    :func:`~qsa.attention.routing.split_count` over the plan's capacity, and each row cut by its own
    tile count).

    Such rows are cut as the direct kernel cuts them: its split count, over its tile count of the index
    width, so that the ``rows_sorted`` hint, which picks between the two kernels, changes no bit of a row
    whose selection is whole 4-token blocks and a tail (the tiles then hold the same tokens in both).
    Only where the planned tiles are the direct kernel's size (``tile_tokens``)."""
    if index_width is None or not routing.direct_admits(rows, index_width):
        return None
    cfg = xqa_direct_config(G, head_dim, rows * hkv, kv_fp8=kv_fp8)
    if cfg.tile_tokens != tile_tokens:
        return None
    return direct_cut(rows * hkv, index_width, cfg, device)


def direct_resolves(programs: int, splits: int, split_entries: int, programs_per_sm: int,
                    device: torch.device) -> bool:
    """Whether the direct kernel reads all ``split_entries`` (a power of two) of each split before its
    loop: up to ``DIRECT_RESOLVE_MAX`` always, up to ``DIRECT_RESOLVE_WAVE_MAX`` where the launch fits
    one wave (a larger resolve in a second wave was slower than reading tile by tile)."""
    if split_entries <= settings.DIRECT_RESOLVE_MAX:
        return True
    facts = utils.device_facts(str(device))
    return split_entries <= settings.DIRECT_RESOLVE_WAVE_MAX and programs * splits <= programs_per_sm * facts["sm_count"]


@dataclass
class XqaLaunch:
    """The planned xqa launch of one step, decided when it is planned."""

    config: settings.SplitConfig
    splits: int
    cut_tiles: int  # each split cut at most this many tiles (0: the row's own tile count; :func:`xqa_cut`)
    partials: tuple[torch.Tensor, torch.Tensor] | None  # fp32 split partials where splits > 1


def plan_launch(plan: SingleRowPlan, *, rows: int, row_start: int, num_q_heads: int, num_kv_heads: int,
                head_dim: int, kv_fp8: bool, device, index_width: int | None = None,
                config: settings.SplitConfig | None = None, num_splits: int | None = None,
                reuse: XqaLaunch | None = None) -> XqaLaunch | None:
    """Settings (default :func:`xqa_config`), cut and partials of the planned xqa launch of rows
    ``[row_start, rows)``; None when there are none."""
    n = rows - row_start
    if n <= 0:
        return None
    G = num_q_heads // num_kv_heads
    cfg = config or xqa_config(G, head_dim)
    cut = xqa_cut(G, head_dim, n, num_kv_heads, index_width, cfg.tile_tokens, kv_fp8, device)
    splits = num_splits or (cut[0] if cut else routing.split_count(n * num_kv_heads,
                                                                   -(-plan.capacity // (cfg.tile_tokens // 4)),
                                                                   cfg.programs_per_sm, device))
    parts = partials(n, num_q_heads, splits, head_dim, device,
                     reuse=reuse.partials if reuse is not None else None) if splits > 1 else None
    return XqaLaunch(cfg, splits, cut[1] if cut else 0, parts)


def xqa_attention(q, k, v, plan: SingleRowPlan, *, row_start: int, out, lse, gate, softmax_scale,
                  k_scale, v_scale, kv_fp8: bool, config: settings.SplitConfig | None = None,
                  num_splits: int | None = None, index_width: int | None = None,
                  launch: XqaLaunch | None = None) -> None:
    """Rows ``[row_start, rows)`` of ``out`` (and ``lse``) from the single-row plan, as ``launch`` (from
    :func:`plan_launch`) says; decided here when it is None (``index_width``, the columns of the
    ``indices`` planned from, cuts rows the direct kernel could take as it would: :func:`xqa_cut`)."""
    from .kernel import xqa_attention_kernel

    rows, hq, d = q.shape
    n = rows - row_start
    if n <= 0:
        return
    hkv = k.shape[2]
    G = hq // hkv
    if launch is None:
        launch = plan_launch(plan, rows=rows, row_start=row_start, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             kv_fp8=kv_fp8, device=q.device, index_width=index_width, config=config,
                             num_splits=num_splits)
    cfg, splits = launch.config, launch.splits
    q, qk_scale = scores_scale(q, softmax_scale, k_scale)
    strides, g, lse_t = kernel_args(q, k, v, out, gate, lse)
    part_acc, part_ml = launch.partials if splits > 1 else (out, out)
    launch_kernel(xqa_attention_kernel, (n, hkv, splits),
        q, k, v, plan.mb_ids, plan.masks, plan.counts, g, out, lse_t, part_acc, part_ml,
        row_start, launch.cut_tiles, hq, qk_scale, float(v_scale),
        stride_ids=plan.mb_ids.stride(0), stride_masks=plan.masks.stride(0), **strides,
        G=G, BLOCK_G=max(16, next_pow2(G)), MB=cfg.tile_tokens // 4, NUM_SPLITS=splits, PREFETCH=cfg.prefetch,
        HALVES=score_halves(cfg, d),
        HEAD_DIM=d, BLOCK_SIZE=plan.block_size, KV_FP8=kv_fp8, SAME_KV_STRIDES=same_kv_strides(k, v),
        DOT_DTYPE=dot_dtype(q),
        HAS_GATE=gate is not None, RETURN_LSE=lse is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(q.device),
    )
    if splits > 1:
        merge_splits(part_acc, part_ml, out=out, lse=lse, gate=gate, row_offset=row_start, v_scale=v_scale,
                     num_splits=splits, xqa_lists=n * hkv)


@dataclass
class DirectLaunch:
    """The direct xqa launch of one step (and its deferred merge), decided when it is planned."""

    config: settings.SplitConfig
    splits: int
    block_w: int  # power of two >= the index width
    split_n: int  # a split's entries, rounded up to a power of two
    resolve: bool  # each split's entries all read before its loop (:func:`direct_resolves`)
    defer: bool  # each split checks its own positions; the deferred merge recomputes a row out of order
    partials: tuple[torch.Tensor, torch.Tensor] | None  # fp32 split partials where splits > 1
    redo: tuple[torch.Tensor, torch.Tensor] | None  # the deferred merge's partials of rows it recomputes
    scratch: torch.Tensor  # [rows, block_w] int32 lists of rows that are not sorted
    merge: tuple[int, int, int | None] | None  # the deferred merge's (columns, warps, register cap)


def plan_direct_launch(*, rows: int, row_start: int, index_width: int, num_q_heads: int, num_kv_heads: int,
                       head_dim: int, kv_fp8: bool, device, config: settings.SplitConfig | None = None,
                       num_splits: int | None = None, reuse: DirectLaunch | None = None) -> DirectLaunch | None:
    """Settings (default :func:`xqa_direct_config`), splits (:func:`direct_cut`), workspace and merge of
    the direct xqa launch of rows ``[row_start, rows)``; None when there are none."""
    n = rows - row_start
    if n <= 0:
        return None
    G = num_q_heads // num_kv_heads
    lists = n * num_kv_heads
    cfg = config or xqa_direct_config(G, head_dim, lists, kv_fp8=kv_fp8)
    block_w = max(16, next_pow2(index_width))
    cut_splits, tiles = direct_cut(lists, index_width, cfg, device)
    splits = num_splits or cut_splits
    split_n = next_pow2(-(-tiles // splits) * cfg.tile_tokens)  # a split's entries, rounded up
    resolve = cfg.resolve_split and direct_resolves(lists, splits, split_n, cfg.programs_per_sm, device)
    defer = cfg.defer_check and resolve and splits > 1
    parts = redo = merge = None
    if defer:  # the merge recomputes a row out of order into partials of its own
        old = (reuse.partials, reuse.redo) if reuse is not None and reuse.redo is not None else None
        parts, redo = partials(n, num_q_heads, splits, head_dim, device, copies=2, reuse=old)
        block_d, warps = common.merge_config(splits, head_dim, xqa_lists=lists)
        merge = (block_d, warps, direct_merge_registers(lists * splits, cfg.programs_per_sm, device))
    elif splits > 1:
        parts = partials(n, num_q_heads, splits, head_dim, device,
                         reuse=reuse.partials if reuse is not None and reuse.redo is None else None)
    scratch = row_scratch(None, rows, block_w, device, reuse=reuse.scratch if reuse is not None else None)
    return DirectLaunch(cfg, splits, block_w, split_n, resolve, defer, parts, redo, scratch, merge)


def xqa_direct_attention(q, k, v, indices, block_table, token_to_req, positions, seq_lens, *, row_start: int,
                         out, lse, gate, softmax_scale, k_scale, v_scale, kv_fp8: bool,
                         config: settings.SplitConfig | None = None, num_splits: int | None = None,
                         scratch: torch.Tensor | None = None, launch: DirectLaunch | None = None,
                         index_counts: torch.Tensor | None = None) -> None:
    """Rows ``[row_start, rows)`` of ``out`` (and ``lse``) straight from ``indices``: no plan launch.

    As ``launch`` (from :func:`plan_direct_launch`) says; decided here when it is None. ``scratch``
    (``[rows, >= next_pow2(W)]`` int32; default the launch's) receives the lists of rows that are not
    sorted; the rows of sorted ones are left untouched. ``index_counts`` (``[rows]`` int32, checked by the
    caller): each row is its first ``min(max(count, 0), W)`` entries, the others never read."""
    from .kernel import xqa_direct_kernel

    rows, hq, d = q.shape
    n = rows - row_start
    if n <= 0:
        return
    hkv = k.shape[2]
    G = hq // hkv
    width = indices.shape[1]
    if launch is None:
        launch = plan_direct_launch(rows=rows, row_start=row_start, index_width=width, num_q_heads=hq,
                                    num_kv_heads=hkv, head_dim=d, kv_fp8=kv_fp8, device=q.device, config=config,
                                    num_splits=num_splits)
    cfg, splits, block_w, resolve, defer = launch.config, launch.splits, launch.block_w, launch.resolve, launch.defer
    q, qk_scale = scores_scale(q, softmax_scale, k_scale)
    strides, g, lse_t = kernel_args(q, k, v, out, gate, lse)
    scratch = launch.scratch if scratch is None else row_scratch(scratch, rows, block_w, q.device)
    part_acc, part_ml = launch.partials if splits > 1 else (out, out)
    has_counts, idx_counts, stride_counts = count_args(index_counts)
    inputs = (q, k, v, indices, block_table, token_to_req, positions, seq_lens, scratch, idx_counts)
    sizes = (row_start, width, block_table.shape[0], block_table.shape[1], k.shape[0], hq, qk_scale, float(v_scale))
    shared = dict(stride_idx_row=indices.stride(0), stride_scratch_row=scratch.stride(0),
                  stride_bt=block_table.stride(0), **strides, stride_idx_count=stride_counts,
                  G=G, BLOCK_G=max(16, next_pow2(G)), BLOCK_N=cfg.tile_tokens, BLOCK_W=block_w, NUM_SPLITS=splits,
                  HEAD_DIM=d, BLOCK_SIZE=k.shape[1], KV_FP8=kv_fp8, SAME_KV_STRIDES=same_kv_strides(k, v),
                  DOT_DTYPE=dot_dtype(q), HAS_GATE=gate is not None, RETURN_LSE=lse is not None,
                  HAS_COUNTS=has_counts)
    launch_kernel(xqa_direct_kernel, (n, hkv, splits),
        *inputs, g, out, lse_t, part_acc, part_ml, *sizes, **shared,
        PREFETCH=cfg.prefetch and not resolve, SPLIT_N=launch.split_n if resolve else 0, DEFER_CHECK=defer,
        HALVES=score_halves(cfg, d),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
        # The deferred merge is launched as this kernel starts (programmatic dependent launch).
        **launch_options(q.device, early_trigger=defer),
    )
    if defer:
        from .kernel import xqa_direct_merge_kernel

        block_d, warps, cap = launch.merge
        launch_kernel(xqa_direct_merge_kernel, (n, hq, d // block_d),
            part_acc, part_ml, *launch.redo, out, g, lse_t, *inputs, *sizes, **shared, BLOCK_S=next_pow2(splits),
            BLOCK_D=block_d, HALVES=score_halves(cfg, d), num_warps=warps, **({"maxnreg": cap} if cap else {}),
            **launch_options(q.device))
    elif splits > 1:
        merge_splits(part_acc, part_ml, out=out, lse=lse, gate=gate, row_offset=row_start, v_scale=v_scale,
                     num_splits=splits, xqa_lists=n * hkv)
