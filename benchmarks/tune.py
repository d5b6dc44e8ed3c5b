"""Launch-setting sweep for the page4 routes on the GPU: which tile shapes, warps and stages to ship.

Every setting is checked against the fp32 reference before it is timed (as in ``qsa bench``); the
planner is timed apart from the attention kernels. Results go to ``--out`` as ``tune.json`` (replaced by
the next run into that directory) plus a table on stdout. The repository keeps the latest sweep as
``benchmarks/results/tune-latest-<device>.json`` (copy ``tune.json`` over it); earlier ones are in git history.

    python -m benchmarks.tune --out /tmp/tune          # all workloads
    python -m benchmarks.tune --only prefill           # a subset (substring of the workload name)
    python -m benchmarks.tune --splitk-only --only mtp  # the splitk kernel's settings only
    python -m benchmarks.tune --planner-only --map-planners --only prefill-64k  # the shared-map planners
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import qsa
import qsa.attention.grouped.launch
import qsa.attention.launch
import qsa.attention.planning.plan
import qsa.attention.splitk.launch
import qsa.attention.xqa.launch
import qsa.settings
from qsa import plan_attention, run_attention
from qsa.attention.planning.plan import plan_groups, plan_single_rows, PlanWorkspace
from qsa.settings import PlannerConfig
from qsa.attention.planning.reference import compare_plans
from qsa.attention.reference import assert_close_like_torch

from .baselines import chunked_attention, full_fp32_matmul
from .generators import attention_workload
from .registry import K, Scenario
from .timing import Timer, TimingConfig

GROUPED = [  # rows_per_prog (at most), max tile rows, mb, num_warps, num_stages, programs_per_sm, prefetch,
    # lazy_rescale
    (8, 64, 8, 4, 3, 2, False, False), (8, 64, 8, 4, 2, 2, False, False), (8, 64, 8, 4, 2, 2, False, True),
    (8, 64, 8, 4, 2, 2, True, True), (8, 64, 4, 4, 2, 2, False, True), (8, 64, 4, 4, 3, 2, False, True),
    (8, 128, 8, 8, 3, 2, True, False), (8, 128, 8, 8, 3, 2, True, True), (8, 128, 8, 8, 2, 2, True, True),
    (8, 64, 8, 4, 3, 2, True, False), (8, 64, 8, 4, 3, 2, True, True), (8, 64, 8, 4, 3, 2, False, True),
]
PLANNER = [  # grouped planner: quads per row step, scan step, num_warps, programs_per_sm, flagged
    # sectors only, table checked in the scan, map in shared memory, its emission step, register cap
    # (qsa.settings.PlannerConfig)
    *((q, s, w, p, True, True)
      for q, s, w, p in ((32, 2048, 4, 5), (32, 1024, 4, 5), (32, 2048, 4, 8), (64, 2048, 4, 5), (32, 4096, 4, 5),
                         (32, 2048, 8, 4), (64, 4096, 8, 4))),
    *((q, s, w, p, False, False) for q, s, w, p in ((32, 1024, 4, 8), (64, 4096, 8, 4))),
    *((q, s, w, p, False, True, True, e)  # the map in shared memory (grouped_plan_map_kernel)
      for q, s, w, p, e in ((16, 2048, 4, 4, 128), (16, 2048, 4, 4, 256), (32, 2048, 4, 4, 128),
                            (32, 2048, 4, 3, 256), (32, 1024, 4, 4, 128), (64, 2048, 8, 2, 256))),
    *((q, s, w, p, False, True, True, e, r)  # with a register cap (maxnreg)
      for q, s, w, p, e, r in ((32, 2048, 4, 4, 128, 128), (32, 1024, 4, 4, 128, 128), (32, 2048, 4, 4, 64, 128),
                               (64, 2048, 4, 3, 128, 168), (32, 4096, 4, 4, 128, 128), (32, 4096, 4, 4, 256, 128),
                               (32, 2048, 4, 4, 256, 128))),
]
ROW_PLANNER = [  # single-row planner: indices per step, warps, scan-free steps (None: the defaults of
    # qsa.attention.planning.plan.row_plan_chunk and row_plan_ascending_steps)
    (None, None, None), (512, 4, False), (1024, 4, False), (1024, 8, False), (512, 4, True), (1024, 4, True),
    (1024, 8, True), (2048, 8, True), (4096, 8, None),
]
DIRECT_SPLITS = (17, 33, 48, 65)
"""Split counts tried for the direct xqa kernel besides qsa.attention.xqa.launch.direct_split_count's, on workloads of at most
16 rows (a 2051-wide row is 65 tiles of 32 tokens)."""
DIRECT_SPLITS_WIDE = (2, 3, 4, 5, 6)
"""... and on wider ones (decode-64: 4 splits fit one wave of two programs per SM on 132 SMs, 5 do not)."""
MERGE = [(256, 4), (256, 8), (128, 4), (64, 2)]
"""Split-merge settings (columns per program, warps; qsa.attention.launch.merge_config) tried on the direct route's total."""
SPLIT = [  # tile_tokens, num_warps, num_stages, programs_per_sm, prefetch (the planned xqa kernel, with the
    # scores' form of qsa.attention.xqa.launch.xqa_config; the direct xqa kernel sweeps them too on workloads of at most
    # qsa.settings.DIRECT_MAX_ROWS rows)
    (64, 4, 2, 1, False), (64, 4, 2, 3, False), (64, 4, 3, 1, False), (64, 4, 3, 1, True), (32, 4, 4, 1, True),
    (32, 4, 3, 2, True), (32, 4, 4, 2, True), (64, 8, 3, 1, True), (32, 8, 4, 1, True), (16, 4, 4, 2, True),
    (32, 4, 3, 2, False),
]
SPLITK = [(64, 4, 2), (64, 4, 3), (32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 8, 2), (64, 8, 3)]
"""splitk settings (tile_tokens, num_warps, num_stages), with the scores' form of qsa.attention.splitk.launch.splitk_config."""
DIRECT_RESOLVED = [  # the direct kernel with each split's entries read before its loop (SplitConfig's sixth
    # field, resolve_split; qsa.attention.xqa.launch.direct_resolves still decides where): the shipped settings and their
    # neighbours; the eighth field, defer_check, checks each split's positions after its loop (the shipped
    # setting for at most 16 lists, with the 168-register cap); the ninth, qk_halves, takes the scores over
    # the head's column halves (shipped at head_dim 256)
    (32, 4, 3, 2, False, True, 168, True, True), (32, 4, 3, 2, False, True, 168, True),
    (32, 4, 3, 2, False, True, None, False, True), (32, 4, 3, 2, False, True), (32, 4, 2, 2, False, True),
    (32, 4, 4, 2, False, True), (16, 4, 3, 2, False, True), (64, 4, 3, 2, False, True), (32, 4, 3, 1, False, True),
    (32, 4, 4, 2, False, True, 168, True), (16, 4, 3, 2, False, True, 168, True),
]


def workloads(smoke: bool):
    if smoke:  # tiny CPU shapes, to exercise this script under the Triton interpreter
        return [Scenario(name="smoke-prefill", rows=16, context=512, num_q_heads=2, head_dim=16, topk=16,
                         overlap=0.8),
                Scenario(name="smoke-decode", rows=2, num_reqs=2, context=512, num_q_heads=2, head_dim=16,
                         topk=16, overlap=None)]
    return [
        Scenario(name="prefill-64k-o80", overlap=0.8),
        Scenario(name="prefill-64k-o98", overlap=0.98),
        Scenario(name="prefill-64k-o80-fp8", overlap=0.8, kv_cache_dtype="fp8_e4m3"),
        Scenario(name="decode-64", rows=64, num_reqs=64, overlap=None),
        Scenario(name="decode-256", rows=256, num_reqs=256, overlap=None),
        Scenario(name="decode-1", rows=1, num_reqs=1, overlap=None),
        Scenario(name="mtp-8", rows=8, overlap=0.8),
        Scenario(name="mtp-16", rows=16, overlap=0.8),
        Scenario(name="prefill-128k-o80", context=128 * K, overlap=0.8),
        Scenario(name="prefill-8k-o80", context=8 * K, overlap=0.8),
        Scenario(name="prefill-8k-12-1", rows=2048, context=8 * K, num_q_heads=12, overlap=0.8),
        Scenario(name="prefill-8k-24-2", rows=2048, context=8 * K, num_q_heads=24, num_kv_heads=2, overlap=0.8),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tune")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under the Triton interpreter")
    ap.add_argument("--planner-only", action="store_true", help="sweep the planners only")
    ap.add_argument("--no-planner", action="store_true", help="skip the planner sweep")
    ap.add_argument("--map-planners", action="store_true", help="of the grouped planners, the shared-map ones only")
    ap.add_argument("--splitk-only", action="store_true", help="sweep the splitk kernel only")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.smoke else "cuda")
    grouped_settings = (GROUPED[0], GROUPED[3]) if args.smoke else GROUPED
    split_settings = (SPLIT[0], SPLIT[3]) if args.smoke else SPLIT
    splitk_settings = (SPLITK[0], SPLITK[2]) if args.smoke else SPLITK
    planner_settings = ((PLANNER[0], next(s for s in PLANNER if not s[4]), PLANNER[-1]) if args.smoke
                        else PLANNER)
    row_planner_settings = (ROW_PLANNER[0], (16, 4, True)) if args.smoke else ROW_PLANNER
    direct_splits = (3,) if args.smoke else DIRECT_SPLITS
    direct_resolved = (DIRECT_RESOLVED[0],) if args.smoke else DIRECT_RESOLVED
    direct_splits_wide = (2,) if args.smoke else DIRECT_SPLITS_WIDE
    merge_settings = ((16, 4), (8, 2)) if args.smoke else MERGE
    if args.no_planner:
        planner_settings = ()
    elif args.map_planners:
        planner_settings = tuple(s for s in planner_settings if len(s) > 7 and s[7])
    timer = Timer(dev, TimingConfig(budget_s=0.15, min_reps=5, max_reps=50))
    records = []

    def record(name, what, setting, fn, check=None):
        err = None
        try:
            if check is not None and hasattr(check, "poison"):
                check.poison()  # a setting that writes nothing must not pass on the last one's output
            out = fn()
            if check is not None:
                check(out)
            t = timer.time(fn)
            ms = t.median_ms
        except Exception as e:  # a setting that fails to compile or check is recorded, not fatal
            ms, err = None, f"{type(e).__name__}: {str(e)[:200]}"
        records.append(dict(workload=name, what=what, setting=setting, median_ms=ms, error=err))
        shown = f"{ms:8.3f} ms" if ms is not None else f"FAILED {err}"
        print(f"{name:18s} {what:14s} {str(setting):24s} {shown}", flush=True)

    for scn in workloads(args.smoke):
        if args.only and not any(s in scn.name for s in args.only):
            continue
        sweep(scn, dev, record, grouped_settings, split_settings, args.planner_only, planner_settings,
              row_planner_settings, direct_splits, direct_resolved, direct_splits_wide, merge_settings,
              splitk_settings, args.splitk_only)
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", date=time.strftime("%Y-%m-%d"), records=records),
                  f, indent=1)
    return 0


def same_plan_as(ref_plan):
    """A check that a planner's output equals ``ref_plan`` (raises on the first difference)."""
    def check(plan):
        diff = compare_plans(plan, ref_plan)
        if diff:
            raise AssertionError(diff[0])
    return check


def sweep(scn: Scenario, dev, record, grouped_settings, split_settings, planner_only: bool = False,
          planner_settings=PLANNER, row_planner_settings=ROW_PLANNER, direct_splits=DIRECT_SPLITS,
          direct_resolved=DIRECT_RESOLVED, direct_splits_wide=DIRECT_SPLITS_WIDE, merge_settings=MERGE,
          splitk_settings=SPLITK, splitk_only: bool = False) -> None:
    """Every setting of one workload: planners, grouped, xqa and splitk, each checked then timed (with
    ``splitk_only``, splitk's alone)."""
    t0 = time.time()
    w = attention_workload(scn, dev)
    print(f"# {scn.name}: built in {time.time() - t0:.1f}s, overlap {w.stats['overlap']}, "
          f"union/group {w.stats['avg_union_per_group']:.0f}", flush=True)
    q, c = w.q, w.cache
    args_ = (q, *w.args)
    if not planner_only:
        with full_fp32_matmul():
            ref = chunked_attention(*args_, compute_dtype=torch.float32, **w.cache_kwargs).double()
        low = chunked_attention(*args_, compute_dtype=q.dtype, **w.cache_kwargs)
    def check(got):
        assert_close_like_torch(got, ref, low)

    check.poison = lambda: out.fill_(float("nan"))
    inputs = dict(indices=w.indices, block_table=w.block_table, token_to_req=w.token_to_req,
                  positions=w.positions, seq_lens=w.seq_lens, block_size=c.block_size,
                  num_blocks=c.num_blocks)
    single = plan_single_rows(**inputs)
    rows = q.shape[0]
    G = scn.num_q_heads // scn.num_kv_heads
    out = torch.empty_like(q)
    kw = dict(out=out, lse=None, gate=None, softmax_scale=scn.head_dim ** -0.5, k_scale=c.k_scale,
              v_scale=c.v_scale, kv_fp8=c.kv_cache_dtype == "fp8_e4m3")
    if splitk_only:
        return sweep_splitk(scn, w, inputs, q, kw, splitk_settings, record, check)
    record(scn.name, "plan-single", "-", lambda: plan_single_rows(**inputs, out=single))
    if scn.num_reqs > 1 or rows <= 16:  # decode and MTP: the row planner's step width and warps
        check_row_plan = same_plan_as(plan_single_rows(**inputs))
        for chunk, warps, steps in row_planner_settings:
            def run_row_planner(chunk=chunk, warps=warps, steps=steps):
                return plan_single_rows(**inputs, chunk=chunk, num_warps=warps, ascending_steps=steps)
            record(scn.name, "plan-single", (chunk, warps, steps), run_row_planner, check_row_plan)
    if rows >= 8 and scn.num_reqs == 1:
        ws = PlanWorkspace.for_plan(w.block_table, block_size=c.block_size, num_groups=rows // 8)
        grouped = plan_groups(**inputs, workspace=ws)
        record(scn.name, "plan-grouped", "-", lambda: plan_groups(**inputs, out=grouped, workspace=ws))
        for setting in planner_settings:
            cfg_p = PlannerConfig(*setting)
            ws_p = PlanWorkspace.for_plan(w.block_table, block_size=c.block_size, num_groups=rows // 8,
                                          config=cfg_p)

            def run_planner(cfg_p=cfg_p, ws_p=ws_p):
                return plan_groups(**inputs, workspace=ws_p, config=cfg_p)
            record(scn.name, "plan-grouped", setting, run_planner, same_plan_as(grouped))
    if planner_only:
        return
    if rows >= 8 and scn.num_reqs == 1:
        for rp, tile_rows, mb, nw, ns, pps, pf, lazy in grouped_settings:
            while rp > 1 and rp * G > tile_rows:
                rp //= 2
            bm = max(16, 1 << (rp * G - 1).bit_length())
            cfg = qsa.settings.GroupedConfig(rows_per_prog=rp, block_m=bm, mb=mb, num_warps=nw, num_stages=ns,
                                       programs_per_sm=pps, prefetch=pf, lazy_rescale=lazy)

            def run_grouped(cfg=cfg):
                qsa.attention.grouped.launch.grouped_attention(q, c.k, c.v, grouped, config=cfg, **kw)
                return out
            record(scn.name, "grouped-attn", (rp, bm, mb, nw, ns, pps, pf, lazy), run_grouped, check)
        shape = dict(num_q_heads=scn.num_q_heads, num_kv_heads=scn.num_kv_heads, head_dim=scn.head_dim,
                 kv_cache_dtype=c.kv_cache_dtype)
        full = plan_attention(**inputs, **shape, route="grouped", workspace=ws)

        def total():  # plan + attention through the public plan/run split, buffers reused
            p = plan_attention(**inputs, **shape, route="grouped", out=full, workspace=ws)
            return run_attention(p, q, c.k, c.v, kv_cache_dtype=c.kv_cache_dtype, k_scale=c.k_scale,
                                 v_scale=c.v_scale, out=out)
        record(scn.name, "grouped-total", "default", total, check)
    for setting in split_settings:
        cfg = qsa.settings.SplitConfig(*setting, qk_halves=qsa.attention.xqa.launch.xqa_config(G, scn.head_dim).qk_halves)

        def run_xqa(cfg=cfg):
            # cut as the library cuts the launch (qsa.attention.xqa.launch.xqa_cut, where the tiles are the direct kernel's size)
            qsa.attention.xqa.launch.xqa_attention(q, c.k, c.v, single, row_start=0, config=cfg, index_width=w.indices.shape[1],
                                    **kw)
            return out
        record(scn.name, "xqa-attn", setting, run_xqa, check)
    shape = dict(num_q_heads=scn.num_q_heads, num_kv_heads=scn.num_kv_heads, head_dim=scn.head_dim,
                 kv_cache_dtype=c.kv_cache_dtype)
    xqa_plan = plan_attention(**inputs, **shape, route="xqa")

    def xqa_total():
        p = plan_attention(**inputs, **shape, route="xqa", out=xqa_plan)
        return run_attention(p, q, c.k, c.v, kv_cache_dtype=c.kv_cache_dtype, k_scale=c.k_scale,
                             v_scale=c.v_scale, out=out)
    record(scn.name, "xqa-total", "default", xqa_total, check)
    if rows <= qsa.settings.DIRECT_MAX_ROWS:
        for setting in (*split_settings, *direct_resolved):  # the direct kernel (+ merge): no plan launch
            cfg = qsa.settings.SplitConfig(*setting)

            def run_direct(cfg=cfg):
                qsa.attention.xqa.launch.xqa_direct_attention(q, c.k, c.v, w.indices, w.block_table, w.token_to_req,
                                               w.positions, w.seq_lens, row_start=0, config=cfg, **kw)
                return out
            record(scn.name, "direct-attn", setting, run_direct, check)
        # other split counts, default settings (resolved where qsa.attention.xqa.launch.direct_resolves allows)
        for splits in (direct_splits if rows <= 16 else direct_splits_wide):
            def run_direct_splits(splits=splits):
                qsa.attention.xqa.launch.xqa_direct_attention(q, c.k, c.v, w.indices, w.block_table, w.token_to_req,
                                               w.positions, w.seq_lens, row_start=0, num_splits=splits, **kw)
                return out
            record(scn.name, "direct-splits", splits, run_direct_splits, check)
        direct_plan = plan_attention(**inputs, **shape, route="xqa", rows_sorted=True)

        def direct_total():
            p = plan_attention(**inputs, **shape, route="xqa", rows_sorted=True, out=direct_plan)
            return run_attention(p, q, c.k, c.v, kv_cache_dtype=c.kv_cache_dtype, k_scale=c.k_scale,
                                 v_scale=c.v_scale, out=out)
        record(scn.name, "direct-total", "default", direct_total, check)
        default_merge = qsa.attention.launch.merge_config
        try:
            for cols, warps in merge_settings:
                qsa.attention.launch.merge_config = lambda splits, d, xqa_lists=None, cols=cols, warps=warps: (
                    min(cols, d), warps)
                record(scn.name, "direct-merge", (cols, warps), direct_total, check)
        finally:
            qsa.attention.launch.merge_config = default_merge
    sweep_splitk(scn, w, inputs, q, kw, splitk_settings, record, check)


def sweep_splitk(scn: Scenario, w, inputs: dict, q, kw: dict, settings, record, check) -> None:
    """The splitk kernel (its token-list plan made once) at each setting, with the shipped scores' form."""
    c = w.cache
    G = scn.num_q_heads // scn.num_kv_heads
    tokens_plan = plan_attention(**inputs, num_q_heads=scn.num_q_heads, num_kv_heads=scn.num_kv_heads,
                                 head_dim=scn.head_dim, route="splitk")
    halves = qsa.attention.splitk.launch.splitk_config(G, scn.head_dim).qk_halves
    for setting in settings:
        cfg = qsa.settings.SplitConfig(*setting, qk_halves=halves)

        def run_splitk(cfg=cfg):
            qsa.attention.splitk.launch.splitk_attention(q, c.k, c.v, tokens_plan.tokens, tokens_plan.token_counts,
                                       w.block_table, w.token_to_req, block_size=c.block_size,
                                       config=cfg, **kw)
            return kw["out"]
        record(scn.name, "splitk-attn", setting, run_splitk, check)


if __name__ == "__main__":
    sys.exit(main())
