"""The splitk route's launcher and settings: each row's distinct kept tokens, looked up in the block table.

The route takes any G and head dim and is the fallback of the page4 routes; its plan is the per-row
token lists of :func:`qsa.attention.planning.plan.token_lists`. Long rows are split over programs when
the rows alone do not fill the GPU, and the splits merged in order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ... import settings, utils
from ...utils import launch_options, next_pow2
from .. import routing
from ..launch import dot_dtype, kernel_args, merge_splits, partials, same_kv_strides, score_halves, scores_scale
from ..replay import launch as launch_kernel


def splitk_config(G: int, head_dim: int, lists: int | None = None, kv_fp8: bool = False,
                  sm_count: int | None = None) -> settings.SplitConfig:
    """splitk settings for a launch of ``lists`` = rows x KV heads (None: many), over an FP8 cache or not, on
    a GPU of ``sm_count`` SMs (None: not known).

    Two tile shapes: short (32 tokens, 4 stages, four programs per SM) and long (64 tokens, 2 stages, or 3
    over an FP8 cache, three per SM). Up to ``SPLITK_FEW_LISTS`` lists (``SPLITK_FP8_FEW_LISTS`` over an
    FP8 cache) the short tiles; past that, on a GPU of known SM count, the short tiles where the lists'
    splits fit one wave of short programs, else the long ones, in one split per list where two splits
    would spill past one wave of them. At head_dim 256 the scores are taken over the head's column halves."""
    halves = head_dim >= 256
    short = settings.SplitConfig(tile_tokens=32, num_warps=4, num_stages=4, qk_halves=halves)
    long = settings.SplitConfig(tile_tokens=64, num_warps=4, num_stages=3 if kv_fp8 else 2, qk_halves=halves)
    if lists is None:
        return long
    if kv_fp8:
        return short if lists <= settings.SPLITK_FP8_FEW_LISTS else long
    if lists <= settings.SPLITK_FEW_LISTS:
        return short
    if sm_count is None:
        return long
    target = short.programs_per_sm * sm_count  # split_count's programs
    if lists * -(-target // lists) <= settings.SPLITK_SHORT_PER_SM * sm_count:  # the splits fit one wave of short programs
        return short
    if lists < target:  # two splits would spill past one wave of long programs: one split each
        return replace(long, programs_per_sm=1)
    return long


@dataclass
class SplitkLaunch:
    """The splitk launch of one step, decided when it is planned."""

    config: settings.SplitConfig
    splits: int
    partials: tuple[torch.Tensor, torch.Tensor] | None  # fp32 split partials where splits > 1


def plan_launch(*, rows: int, index_width: int, num_q_heads: int, num_kv_heads: int, head_dim: int, kv_fp8: bool,
                device, config: settings.SplitConfig | None = None, num_splits: int | None = None,
                reuse: SplitkLaunch | None = None) -> SplitkLaunch | None:
    """Settings (default :func:`splitk_config` for the launch's lists on this GPU), splits and partials of
    the splitk launch of ``rows`` rows of token lists ``index_width`` wide; None for no rows."""
    if rows == 0:
        return None
    G = num_q_heads // num_kv_heads
    facts = utils.device_facts(str(device))
    cfg = config or splitk_config(G, head_dim, rows * num_kv_heads, kv_fp8=kv_fp8,
                                  sm_count=facts["sm_count"] if facts["kind"] == "cuda" else None)
    splits = num_splits or routing.split_count(rows * num_kv_heads, -(-index_width // cfg.tile_tokens),
                                               cfg.programs_per_sm, device)
    parts = partials(rows, num_q_heads, splits, head_dim, device,
                     reuse=reuse.partials if reuse is not None else None) if splits > 1 else None
    return SplitkLaunch(cfg, splits, parts)


def splitk_attention(q, k, v, tokens, counts, block_table, token_to_req, *, block_size: int, out, lse,
                     gate, softmax_scale, k_scale, v_scale, kv_fp8: bool,
                     config: settings.SplitConfig | None = None, num_splits: int | None = None,
                     launch: SplitkLaunch | None = None) -> None:
    """All rows of ``out`` (and ``lse``) from per-row token lists (``plan.token_lists``), as ``launch``
    (from :func:`plan_launch`) says; decided here when it is None."""
    from .kernel import splitk_attention_kernel

    rows, hq, d = q.shape
    if rows == 0:
        return
    hkv = k.shape[2]
    G = hq // hkv
    if launch is None:
        launch = plan_launch(rows=rows, index_width=tokens.shape[1], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             kv_fp8=kv_fp8, device=q.device, config=config, num_splits=num_splits)
    cfg, splits = launch.config, launch.splits
    q, qk_scale = scores_scale(q, softmax_scale, k_scale)
    strides, g, lse_t = kernel_args(q, k, v, out, gate, lse)
    part_acc, part_ml = launch.partials if splits > 1 else (out, out)
    launch_kernel(splitk_attention_kernel, (rows, hkv, splits),
        q, k, v, tokens, counts, block_table, token_to_req, g, out, lse_t, part_acc, part_ml,
        hq, qk_scale, float(v_scale),
        stride_tok=tokens.stride(0), stride_bt=block_table.stride(0), **strides,
        G=G, BLOCK_G=max(16, next_pow2(G)), BLOCK_N=cfg.tile_tokens, NUM_SPLITS=splits,
        HEAD_DIM=d, BLOCK_SIZE=block_size, KV_FP8=kv_fp8, SAME_KV_STRIDES=same_kv_strides(k, v),
        DOT_DTYPE=dot_dtype(q), HALVES=score_halves(cfg, d),
        HAS_GATE=gate is not None, RETURN_LSE=lse is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(q.device),
    )
    if splits > 1:
        merge_splits(part_acc, part_ml, out=out, lse=lse, gate=gate, row_offset=0, v_scale=v_scale,
                     num_splits=splits)
