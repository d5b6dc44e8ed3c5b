"""The batch-invariant route's launcher and settings: a row's output bits depend on its own inputs only.

Every row is read straight from ``indices`` and cut into splits of a fixed number of tiles at fixed
positions of its list, with settings fixed by the shape alone (:func:`invariant_config`); the splits are
folded in list order, either by the program that computed them (``fold``) or by a merge launch. Both
give the same bits, so the choice, made from the batch's size, changes none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ... import settings
from ...utils import launch_options, next_pow2
from ..launch import (direct_tiles, dot_dtype, kernel_args, partials, row_scratch, same_kv_strides, score_halves,
                      scores_scale)
from ..planning.plan import count_args
from ..replay import launch as launch_kernel


def invariant_config(G: int, head_dim: int, lists: int | None = None, kv_fp8: bool = False) -> settings.InvariantConfig:
    """Settings of the batch-invariant route for a shape and a launch of ``lists`` lists (rows x KV heads;
    None: not known) over an FP8 cache or not. What decides a row's bits comes from the shape alone.

    The tile of the direct xqa kernel (32 tokens, 4 warps, the scores over column halves at head_dim 256)
    and splits of 4 tiles: a 2051-wide row is 17 splits of 128 list positions. From
    ``INVARIANT_CAP_LISTS`` lists at head_dim 256 (G <= 8, a cache in q's dtype) the kernel is capped at
    ``DIRECT_MAX_REGISTERS`` on 2 stages: three programs per SM instead of two, its spills outside the tile
    loop. Bits unchanged."""
    cfg = settings.InvariantConfig(tile_tokens=32, split_tiles=4, num_warps=4, num_stages=3, qk_halves=head_dim >= 256)
    if lists is not None and lists >= settings.INVARIANT_CAP_LISTS and head_dim == 256 and G <= 8 and not kv_fp8:
        cfg = replace(cfg, num_stages=2, max_registers=settings.DIRECT_MAX_REGISTERS)  # three 128-thread programs per SM
    return cfg


def invariant_folds(lists: int) -> bool:
    """Whether a batch-invariant launch of ``lists`` lists folds each row's splits in one program (from
    ``INVARIANT_FOLD_LISTS`` lists: a program per list then fills the GPU, and no partials are written)
    rather than running a program per split and a merge. Either gives the same bits."""
    return lists >= settings.INVARIANT_FOLD_LISTS


def invariant_merge_columns(num_splits: int, head_dim: int, block_g: int = 16) -> int:
    """Columns per program of the batch-invariant merge, whose programs fold every split's partial tile of
    ``block_g`` matrix rows: the most (a power of two dividing ``head_dim``, at least 16 where the head has
    them) within ``INVARIANT_MERGE_ELEMENTS``. Changes no bit (the fold is column by column)."""
    cols = max(1, settings.INVARIANT_MERGE_ELEMENTS // (block_g * max(num_splits, 1)))
    cols = 1 << (cols.bit_length() - 1)
    return max(min(16, head_dim), min(head_dim, cols))


@dataclass
class InvariantLaunch:
    """The batch-invariant launch of one step, decided when it is planned."""

    config: settings.InvariantConfig
    fold: bool  # one program per row and KV head folds the row's splits (else a program per split and a merge)
    splits: int
    block_w: int  # power of two >= the index width
    merge_columns: int  # columns per program of the merge (fold False)
    partials: tuple[torch.Tensor, torch.Tensor] | None  # fp32 split partials (fold False)
    scratch: torch.Tensor  # [rows, block_w] int32 lists of rows that are not sorted


def plan_launch(*, rows: int, index_width: int, num_q_heads: int, num_kv_heads: int, head_dim: int, kv_fp8: bool,
                device, config: settings.InvariantConfig | None = None, fold: bool | None = None,
                reuse: InvariantLaunch | None = None) -> InvariantLaunch | None:
    """Settings (default :func:`invariant_config`), fold (default :func:`invariant_folds`), splits and
    workspace of the batch-invariant launch of ``rows`` rows; None for no rows."""
    if rows == 0:
        return None
    G = num_q_heads // num_kv_heads
    cfg = config or invariant_config(G, head_dim, rows * num_kv_heads, kv_fp8)
    block_w = max(16, next_pow2(index_width))
    if fold is None:
        fold = invariant_folds(rows * num_kv_heads)
    splits = -(-direct_tiles(index_width, cfg.tile_tokens) // cfg.split_tiles)
    parts = None if fold else partials(rows, num_q_heads, splits, head_dim, device,
                                       reuse=reuse.partials if reuse is not None else None)
    scratch = row_scratch(None, rows, block_w, device, reuse=reuse.scratch if reuse is not None else None)
    columns = invariant_merge_columns(splits, head_dim, max(16, next_pow2(G)))
    return InvariantLaunch(cfg, fold, splits, block_w, columns, parts, scratch)


def invariant_attention(q, k, v, indices, block_table, token_to_req, positions, seq_lens, *, out, lse, gate,
                        softmax_scale, k_scale, v_scale, kv_fp8: bool, config: settings.InvariantConfig | None = None,
                        fold: bool | None = None, scratch: torch.Tensor | None = None,
                        launch: InvariantLaunch | None = None, index_counts: torch.Tensor | None = None) -> None:
    """All rows of ``out`` (and ``lse``) on the batch-invariant route, straight from ``indices``, as
    ``launch`` (from :func:`plan_launch`) says; decided here when it is None.

    ``fold`` (default :func:`invariant_folds`) picks one program per row and KV head that folds
    the row's splits itself, or one per split and a merge launch; the two give the same bits, so the
    choice, made from the batch's size, changes none. ``scratch`` and ``index_counts`` as in
    :func:`qsa.attention.xqa.launch.xqa_direct_attention`."""
    from .kernel import invariant_attention_kernel, invariant_merge_kernel

    rows, hq, d = q.shape
    if rows == 0:
        return
    hkv = k.shape[2]
    G = hq // hkv
    width = indices.shape[1]
    if launch is None:
        launch = plan_launch(rows=rows, index_width=width, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             kv_fp8=kv_fp8, device=q.device, config=config, fold=fold)
    cfg, fold, splits, block_w = launch.config, launch.fold, launch.splits, launch.block_w
    q, qk_scale = scores_scale(q, softmax_scale, k_scale)
    strides, g, lse_t = kernel_args(q, k, v, out, gate, lse)
    scratch = launch.scratch if scratch is None else row_scratch(scratch, rows, block_w, q.device)
    part_acc, part_ml = (out, out) if fold else launch.partials
    block_g = max(16, next_pow2(G))
    has_counts, idx_counts, stride_counts = count_args(index_counts)
    shared = dict(G=G, BLOCK_G=block_g, NUM_SPLITS=splits, HEAD_DIM=d, HAS_GATE=gate is not None,
                  RETURN_LSE=lse is not None)
    launch_kernel(invariant_attention_kernel, (rows, hkv, 1 if fold else splits),
        q, k, v, indices, block_table, token_to_req, positions, seq_lens, scratch, idx_counts, g, out, lse_t, part_acc,
        part_ml, width, block_table.shape[0], block_table.shape[1], k.shape[0], hq, qk_scale, float(v_scale),
        stride_idx_row=indices.stride(0), stride_scratch_row=scratch.stride(0), stride_bt=block_table.stride(0),
        stride_idx_count=stride_counts, **strides, **shared, HAS_COUNTS=has_counts,
        BLOCK_N=cfg.tile_tokens, BLOCK_W=block_w, SPLIT_TILES=cfg.split_tiles,
        SPLIT_N=next_pow2(cfg.split_tiles * cfg.tile_tokens), FOLD=fold,
        BLOCK_SIZE=k.shape[1], KV_FP8=kv_fp8, SAME_KV_STRIDES=same_kv_strides(k, v), DOT_DTYPE=dot_dtype(q),
        HALVES=score_halves(cfg, d), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}), **launch_options(q.device))
    if not fold:
        block_d = launch.merge_columns
        launch_kernel(invariant_merge_kernel, (rows, hkv, d // block_d),
            part_acc, part_ml, g, out, lse_t, hq, float(v_scale), strides["stride_o_row"], strides["stride_o_head"],
            strides["stride_g_row"], strides["stride_g_head"], strides["stride_lse_row"], **shared,
            BLOCK_D=block_d, num_warps=4, **launch_options(q.device))
