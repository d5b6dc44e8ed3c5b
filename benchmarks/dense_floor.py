"""Dense attention on the grouped step's work: how fast the work the grouped kernel issues can run when
nothing is gathered, timed as ``qsa bench`` times a step (medians of CUDA-graph replays, L2 flushed).

The grouped kernel of a prefill scenario runs one 64-row tile (8 rows x 6 query heads, padded) over
each group's union of microblocks: it issues ``4 * 64 * D * tokens`` FLOPs per group, ``tokens`` the
group's tiles x 32. This module runs the same work without the gather, in one process, on one K and one
V buffer that every group shares (so the L2 serves them, as it serves most of the grouped kernel's
loads):

* ``triton-dense``: the grouped kernel's tile loop (``attend_tile``, 64-row tile, the kernel's tile,
  warps and stages) over contiguous K/V, every token attended: the kernel without its gather and masks.
* ``triton-masked``: the same with the group's row masks from the plan (the kernel without its gather).
* ``triton-dense-128``: the same tile loop as a dense attention kernel would run it, a 128-row tile on 8
  warps (``128 // G`` query rows with all their heads), every program over the mean group's tokens.
* ``sdpa-<backend>``: ``torch.nn.functional.scaled_dot_product_attention`` with one backend (FlashAttention,
  cuDNN, memory-efficient) on ``[groups x 64, D]`` queries against ``tokens`` shared keys: the same FLOPs
  as the grouped kernel; ``-48`` with the 48 real rows per group only (the tile's padding free).

Beside them the grouped step itself: the planner alone, the attention kernel alone (plan made once), and
the products probe of :mod:`benchmarks.floors` (the kernel's loads and products, no softmax). Every
dense variant is checked against an fp32 reference under the benchmark's gate before it is timed; one
that fails is recorded without a time.

The tables go to stdout; with ``--out DIR`` also to ``DIR/dense-floor-<device>.json`` and ``.md`` (a later run
into the same directory replaces them).

    python -m benchmarks.dense_floor prefill-64k-o98 prefill-64k-o80 --out /tmp/dense
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from qsa.attention.kernels import attend_tile, load_kv_microblocks

from .breakdown import check_output
from .floors import GroupedProbe, is_prefill, time_grouped_parts
from .registry import SCENARIOS
from .report import slug
from .timing import Timer, TimingConfig, measure_ceilings

LOG2E = 1.4426950408889634


@triton.jit
def dense_attention_kernel(
    q_ptr,  # [rows, Hq, D]
    k_ptr,  # [tokens, D]: one K for every group and KV head
    v_ptr,  # [tokens, D]
    masks_ptr,  # [groups, cap] int32 bit 4q + t % 4 (the grouped plan's masks); MASKED only
    counts_ptr,  # [groups] int32: the group's plan entries (its tiles: cdiv(count, MB))
    out_ptr,  # [rows, Hq, D]
    num_rows,
    qk_scale,  # softmax scale * log2(e)
    stride_q_row,
    stride_q_head,
    stride_plan,
    stride_o_row,
    stride_o_head,
    G: tl.constexpr,  # query heads per KV head
    GROUP_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # power of two >= GROUP_ROWS * G
    MB: tl.constexpr,  # microblocks per tile (tile = 4 * MB tokens)
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One program per (group, KV head), as the grouped attention kernel: the same query tile and the same
    number of tiles, tile ``i`` being tokens ``[i * 4 * MB, (i + 1) * 4 * MB)`` of the shared K and V
    (contiguous rows, no block table). Every token is attended, or with ``MASKED`` the tokens whose bit
    the plan sets for the row (the grouped kernel's masks, entry ``e`` covering tokens ``4e .. 4e + 3``)."""
    BLOCK_N: tl.constexpr = 4 * MB
    i_g = tl.program_id(0)
    i_kvh = tl.program_id(1).to(tl.int64)
    o_m = tl.arange(0, BLOCK_M)
    o_q = o_m // G
    o_row = (i_g * GROUP_ROWS + o_q).to(tl.int64)
    o_head = i_kvh * G + o_m % G
    m_row = (o_m < GROUP_ROWS * G) & (o_row < num_rows)
    o_d = tl.arange(0, HEAD_DIM)
    p_q = q_ptr + o_row[:, None] * stride_q_row + o_head[:, None] * stride_q_head + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None], other=0).to(DOT_DTYPE)
    o_n = tl.arange(0, BLOCK_N)
    o_shift = 4 * tl.minimum(o_q, GROUP_ROWS - 1)[:, None] + (o_n % 4)[None, :]
    o_j = tl.arange(0, MB)
    count = tl.load(counts_ptr + i_g)
    p_masks = masks_ptr + i_g.to(tl.int64) * stride_plan
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_all = tl.full([MB, 4], 1, tl.int1)
    for i_t in range(0, tl.maximum(tl.cdiv(count, MB), 1)):
        # Loaded as the grouped kernel loads its microblocks (its load's form: one offset per
        # microblock), the microblocks of tile i_t lying one after another.
        o_mb = (i_t * MB + o_j).to(tl.int64) * (4 * HEAD_DIM)
        b_k = load_kv_microblocks(k_ptr, o_mb, HEAD_DIM, o_d, m_all, False, DOT_DTYPE)
        b_v = load_kv_microblocks(v_ptr, o_mb, HEAD_DIM, o_d, m_all, False, DOT_DTYPE)
        if MASKED:
            o_e = i_t * MB + o_j
            b_gm = tl.load(p_masks + o_e, mask=o_e < count, other=0)
            b_gm = tl.reshape(tl.broadcast_to(b_gm[:, None], [MB, 4]), [BLOCK_N])
            m_attend = ((b_gm[None, :] >> o_shift) & 1) != 0
        else:
            m_attend = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)  # every (matrix row, token) pair
        b_m, b_l, b_acc = attend_tile(b_q, b_k, b_v, m_attend, b_m, b_l, b_acc, qk_scale, DOT_DTYPE)
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    p_o = out_ptr + o_row[:, None] * stride_o_row + o_head[:, None] * stride_o_head + o_d[None, :]
    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_row[:, None])


def dense_attention(q, k, v, masks, counts, *, group_rows: int, num_kv_heads: int, mb: int, masked: bool,
                    block_m: int = 64, num_warps: int = 4, num_stages: int = 2, out=None, info=None):
    """Launch :func:`dense_attention_kernel`; ``k``, ``v``: ``[tokens, D]`` holding at least the longest
    group's tiles. Returns ``out`` ``[rows, Hq, D]``; ``info``, a dict, receives the compiled kernel's shared
    memory and registers on the GPU. ``num_stages`` 2 gives it the grouped kernel's two K/V buffers (that
    kernel's 3 stages hold one for its plan entries), 98 KB: two programs per SM."""
    rows, hq, d = q.shape
    if q.stride(-1) != 1:
        raise ValueError(f"q must have a contiguous last dimension, got strides {q.stride()}")
    if k.shape != v.shape or k.dim() != 2 or k.shape[1] != d or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"k and v must be contiguous [tokens, {d}], got {tuple(k.shape)} and {tuple(v.shape)}")
    groups = counts.shape[0]
    if masks.shape[0] != groups:
        raise ValueError(f"masks must have one row per group ({groups}), got {tuple(masks.shape)}")
    tiles = int((counts.max().item() + mb - 1) // mb) if groups else 0
    if k.shape[0] < max(tiles, 1) * 4 * mb:
        raise ValueError(f"k and v hold {k.shape[0]} tokens; the longest group needs {max(tiles, 1) * 4 * mb}")
    g = hq // num_kv_heads
    if group_rows * g > block_m:
        raise ValueError(f"block_m {block_m} is less than group_rows x heads per KV head ({group_rows * g})")
    out = torch.empty_like(q) if out is None else out
    dot = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[q.dtype]
    if k.device.type == "cpu" and dot == tl.bfloat16:
        dot = tl.float32  # the interpreter's dots do not take bf16 operands
    compiled = dense_attention_kernel[(groups, num_kv_heads)](
        q, k, v, masks, counts, out, rows, d ** -0.5 * LOG2E, q.stride(0), q.stride(1), masks.stride(0),
        out.stride(0), out.stride(1), G=g, GROUP_ROWS=group_rows, BLOCK_M=block_m, MB=mb, HEAD_DIM=d,
        MASKED=masked, DOT_DTYPE=dot, num_warps=num_warps, num_stages=num_stages)
    if info is not None and k.device.type == "cuda":
        info.update(shared=compiled.metadata.shared, regs=compiled.n_regs, spills=compiled.n_spills)
    return out


def dense_reference(q, k, v, masks, counts, *, group_rows: int, num_kv_heads: int, mb: int, masked: bool,
                    chunk: int = 64) -> torch.Tensor:
    """fp32 result of :func:`dense_attention`: row ``r`` of group ``r // group_rows`` attends the group's
    tokens ``[0, tiles x 4 x mb)`` of ``k``/``v`` (with ``masked``: those whose plan bit the row has)."""
    rows, hq, d = q.shape
    groups = counts.shape[0]
    n_tok = int((counts.max().item() + mb - 1) // mb) * 4 * mb if groups else 0
    n_tok = max(n_tok, 4 * mb)
    kf, vf = k[:n_tok].float(), v[:n_tok].float()
    tok = torch.arange(n_tok, device=q.device)
    out = torch.zeros(rows, hq, d, dtype=torch.float32, device=q.device)
    for g0 in range(0, groups, chunk):
        g1 = min(groups, g0 + chunk)
        r0, r1 = g0 * group_rows, min(rows, g1 * group_rows)
        qq = q[r0:r1].float()  # [r, hq, d]
        s = torch.einsum("rhd,td->rht", qq, kf) * d ** -0.5
        grp = torch.arange(r0, r1, device=q.device) // group_rows
        limit = ((counts[grp].long() + mb - 1) // mb * 4 * mb)  # tokens of the group's tiles
        keep = tok[None, :] < limit[:, None]  # [r, t]
        if masked:
            e = tok // 4
            live = e[None, :] < counts[grp].long()[:, None]
            words = masks[grp][:, e.clamp(max=masks.shape[1] - 1)].long()  # [r, t]
            bit = 4 * (torch.arange(r0, r1, device=q.device) % group_rows)[:, None] + tok[None, :] % 4
            keep = keep & live & (((words >> bit) & 1) != 0)
        s = s.masked_fill(~keep[:, None, :], float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out[r0:r1] = torch.einsum("rht,td->rhd", p, vf)
    return out


SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def sdpa_fn(backend: str, q, k, v, out):
    """A step of ``scaled_dot_product_attention`` restricted to ``backend``, into ``out``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = getattr(SDPBackend, backend)

    def fn():
        with sdpa_kernel([b]):
            out.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v))

    return fn


def sdpa_reference(q, k, v, chunk: int = 4096) -> torch.Tensor:
    """fp32 ``softmax(q k^T / sqrt(d)) v`` for ``q`` ``[1, 1, n, d]`` and ``k``, ``v`` ``[1, 1, t, d]``."""
    d = q.shape[-1]
    kf, vf = k[0, 0].float(), v[0, 0].float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(0, q.shape[2], chunk):
        s = q[0, 0, i:i + chunk].float() @ kf.T * d ** -0.5
        out[0, 0, i:i + chunk] = torch.softmax(s, -1) @ vf
    return out


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def _check_and_time(entry: dict, f, o, want, label: str, dtype, timer: Timer) -> None:
    """Run ``f`` into the NaN-filled ``o``, check it against ``want()`` under the benchmark's gate, then time
    it: ``entry`` gets ``errors`` and ``median_ms``, or ``error`` and no time where any of it fails."""
    try:
        o.fill_(float("nan"))
        f()
        entry["errors"] = check_output(o, want(), dtype, label)
        entry["median_ms"] = timer.time(f).median_ms
    except Exception as e:  # recorded, not timed
        entry["error"] = f"{type(e).__name__}: {e}"[:400]
        entry["median_ms"] = None
    entry["tflops"] = tflops(entry["flops"], entry["median_ms"])
    print(f"{label}: {entry['median_ms']}", file=sys.stderr, flush=True)


def run_scenario(scn, timer: Timer, *, quick: bool) -> dict:
    from .baselines import reference_attention_fp32
    from .generators import attention_workload

    dev = timer.device
    w = attention_workload(scn, dev)
    probe = GroupedProbe(w, scn)
    gp = probe.grouped
    mb, group_rows, hkv = 8, gp.group_rows, scn.num_kv_heads
    tiles = (gp.counts.long() + mb - 1) // mb
    tokens_exec = int(tiles.sum()) * 4 * mb  # token slots the grouped kernel's tiles run, over all groups
    flops_64 = 4 * 64 * scn.head_dim * tokens_exec * hkv
    rec = dict(scenario=scn.name, groups=gp.num_groups, group_rows=group_rows,
               mean_union_microblocks=float(gp.counts.float().mean()), tokens_executed=tokens_exec,
               flops_executed=flops_64, variants=[])

    # The grouped step and its parts, as benchmarks.floors measures them.
    ref = reference_attention_fp32(w.q, *w.args, **w.cache_kwargs)
    rec.update(time_grouped_parts(scn, w, probe, ref, timer))
    del ref
    fn, ok = probe.checked(64, mb, 4, 3)
    rec["products_ms"] = timer.time(fn).median_ms if ok else None
    rec["attention_tflops"] = tflops(flops_64, rec["attention_ms"])
    rec["products_tflops"] = tflops(flops_64, rec["products_ms"])

    # One K and one V for every group, N(0, 1) as the cache's data (the cache's first block is NaN: the
    # null block).
    n_tok = int(tiles.max()) * 4 * mb
    d = scn.head_dim
    if w.cache.k.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{scn.name}: the dense floor takes fp16 or bf16 caches, got {w.cache.k.dtype}")
    gen = torch.Generator(device=dev).manual_seed(scn.seed + 5)
    k, v = (torch.randn(n_tok, d, generator=gen, device=dev).to(w.cache.k.dtype) for _ in range(2))
    settings = [(8, 4, 2)] if quick else [(8, 4, 2), (8, 4, 3), (16, 4, 2)]
    live = torch.arange(gp.masks.shape[1], device=dev)[None, :] < gp.counts[:, None]
    plan_masks = torch.where(live, gp.masks, 0)  # entries past a group's count: no token
    for masked in (False, True):
        for tile_mb, nw, st in settings:
            # The kernel's tiles of 8 microblocks; tiles of 16 run them in pairs (a group's last one half empty).
            counts = (tiles * mb).to(torch.int32)
            width = int((tiles.max() * mb + tile_mb - 1) // tile_mb * tile_mb)
            masks = torch.nn.functional.pad(plan_masks, (0, max(width - plan_masks.shape[1], 0)))
            kk, vv = k, v
            if 4 * width > kk.shape[0]:
                kk = torch.nn.functional.pad(k, (0, 0, 0, 4 * width - k.shape[0])).contiguous()
                vv = torch.nn.functional.pad(v, (0, 0, 0, 4 * width - v.shape[0])).contiguous()
            flops = 4 * 64 * d * hkv * int(((counts.long() + tile_mb - 1) // tile_mb).sum()) * 4 * tile_mb
            o = torch.empty_like(w.q)
            kw = dict(group_rows=group_rows, num_kv_heads=hkv, mb=tile_mb, masked=masked, num_warps=nw,
                      num_stages=st, out=o)

            name = "triton-masked" if masked else "triton-dense"
            entry = dict(variant=name, mb=tile_mb, num_warps=nw, stages=st, flops=flops)

            def f(kw=kw, masks=masks, counts=counts, kk=kk, vv=vv, entry=entry):
                dense_attention(w.q, kk, vv, masks, counts, info=entry, **kw)

            def want(masks=masks, counts=counts, kk=kk, vv=vv, tile_mb=tile_mb, masked=masked):
                return dense_reference(w.q, kk, vv, masks, counts, group_rows=group_rows, num_kv_heads=hkv,
                                       mb=tile_mb, masked=masked)

            _check_and_time(entry, f, o, want, f"{scn.name}:{name} {tile_mb}/{nw}/{st}", w.q.dtype, timer)
            rec["variants"].append(entry)

    # SDPA: every group's rows against one shared K/V of the mean tile count (the same FLOPs).
    t_mean = int(round(tokens_exec / gp.num_groups / (4 * mb))) * 4 * mb

    # The Triton tile of a dense attention kernel (128 rows on 8 warps, 32- or 64-token tiles): the rows
    # in programs of 128 // G query rows (all their heads), each over the first t_mean shared tokens.
    wide_rows = 128 // (scn.num_q_heads // hkv)
    programs = (scn.rows + wide_rows - 1) // wide_rows
    wide_settings = [(8, 8, 2)] if quick else [(8, 8, 2), (8, 8, 3), (16, 8, 2)]
    for tile_mb, nw, st in wide_settings:
        t_wide = max(t_mean // (4 * tile_mb), 1) * 4 * tile_mb  # whole tiles
        counts = torch.full((programs,), t_wide // 4, dtype=torch.int32, device=dev)
        masks = torch.zeros(programs, t_wide // 4, dtype=torch.int32, device=dev)
        flops = 4 * 128 * d * hkv * programs * t_wide
        o = torch.empty_like(w.q)
        kw = dict(group_rows=wide_rows, num_kv_heads=hkv, mb=tile_mb, masked=False, block_m=128,
                  num_warps=nw, num_stages=st, out=o)
        entry = dict(variant="triton-dense-128", mb=tile_mb, num_warps=nw, stages=st, flops=flops,
                     rows_per_program=wide_rows, tokens=t_wide)

        def f(kw=kw, masks=masks, counts=counts, entry=entry):
            dense_attention(w.q, k, v, masks, counts, info=entry, **kw)

        def want(masks=masks, counts=counts, tile_mb=tile_mb):
            return dense_reference(w.q, k, v, masks, counts, group_rows=wide_rows, num_kv_heads=hkv,
                                   mb=tile_mb, masked=False)

        _check_and_time(entry, f, o, want, f"{scn.name}:triton-dense-128 {tile_mb}/{nw}/{st}", w.q.dtype, timer)
        rec["variants"].append(entry)

    ks = k[:t_mean].reshape(1, 1, t_mean, d) if t_mean <= k.shape[0] else None
    if ks is not None:
        vs = v[:t_mean].reshape(1, 1, t_mean, d)
        rows_all = None
        if hkv == 1:  # the last group's missing rows as zero queries
            rows_all = torch.zeros(gp.num_groups * group_rows, *w.q.shape[1:], dtype=w.q.dtype, device=dev)
            rows_all[:scn.rows] = w.q
            rows_all = rows_all.reshape(gp.num_groups, -1, d)
        real = 0 if rows_all is None else rows_all.shape[1]
        for rows_per_group in sorted({triton.next_power_of_2(max(real, 1)), real}, reverse=True):
            if rows_all is None:
                break
            qs = torch.zeros(gp.num_groups, rows_per_group, d, dtype=w.q.dtype, device=dev)
            qs[:, :rows_all.shape[1]] = rows_all
            qs = qs.reshape(1, 1, -1, d)
            expected = sdpa_reference(qs, ks, vs)
            flops = 4 * qs.shape[2] * t_mean * d
            for backend in SDPA_BACKENDS:
                o = torch.empty_like(qs)
                f = sdpa_fn(backend, qs, ks, vs, o)
                name = f"sdpa-{backend.split('_')[0].lower()}" + ("" if rows_per_group > real else f"-{real}")
                entry = dict(variant=name, rows_per_group=rows_per_group, tokens=t_mean, flops=flops)
                _check_and_time(entry, f, o, lambda: expected, f"{scn.name}:{name}", w.q.dtype, timer)
                rec["variants"].append(entry)
            del expected
    return rec


def markdown(report: dict) -> str:
    def us(x):
        return "-" if x is None else f"{x * 1e3:.1f}"

    def tf(x):
        return "-" if x is None else f"{x:.0f}"

    lines = [f"Dense attention on the grouped step's work, {report['device']}, {report['date']} (matmul "
             f"{report['ceilings']['matmul_tflops']:.0f} TFLOP/s); us (TFLOP/s on the FLOPs each runs), medians of "
             "graph replays with the L2 flushed.", ""]
    for r in report["scenarios"]:
        lines += [f"**{r['scenario']}**: {r['groups']} groups, {r['mean_union_microblocks']:.1f} microblocks per "
                  f"group, {r['flops_executed'] / 1e9:.1f} GFLOP issued by the grouped kernel. Planner "
                  f"{us(r['planner_ms'])}, attention {us(r['attention_ms'])} ({tf(r['attention_tflops'])}), "
                  f"products probe {us(r['products_ms'])} ({tf(r['products_tflops'])}).", "",
                  "| variant | setting | us | TFLOP/s | max abs err | rel L2 err |", "| --- | --- | --- | --- | --- | --- |"]
        for v in r["variants"]:
            smem = f", {v['shared'] // 1024} KB" if "shared" in v else ""
            setting = (f"{v['mb']} mb / {v['num_warps']} warps / {v['stages']} stages{smem}" if "mb" in v
                       else f"{v['rows_per_group']} rows x {v['tokens']} tokens")
            if "rows_per_program" in v:
                setting += f", 128-row tile: {v['rows_per_program']} rows x {v['tokens']} tokens"

            e = v.get("errors") or {}
            err = (f"{e['max_abs_err']:.2e} | {e['rel_l2_err']:.2e}" if e else f"failed: {v.get('error', '')[:80]} | -")
            lines.append(f"| {v['variant']} | {setting} | {us(v['median_ms'])} | {tf(v['tflops'])} | {err} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dense_floor", description=__doc__.split("\n")[0])
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for dense-floor-<device>.json and .md (a later run with the same --out "
                        "replaces them)")
    p.add_argument("--quick", action="store_true", help="the kernel's tile setting only")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    by_name = {s.name: s for s in SCENARIOS}
    bad = [n for n in args.scenarios if n not in by_name or by_name[n].kind != "attention"
           or not is_prefill(by_name[n])]
    if bad:
        p.error(f"not prefill attention scenarios: {bad}")
    dev = torch.device(args.device)
    cfg = TimingConfig(budget_s=0.2, min_reps=20, max_reps=300) if dev.type == "cuda" else TimingConfig()
    timer = Timer(dev, cfg)
    ceilings = measure_ceilings(timer)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    report = dict(device=name, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), ceilings=ceilings,
                  versions=dict(torch=torch.__version__, triton=triton.__version__), scenarios=[])
    for n in args.scenarios:
        report["scenarios"].append(run_scenario(by_name[n], timer, quick=args.quick))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    text = markdown(report)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"dense-floor-{slug(name)}"
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        (args.out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
