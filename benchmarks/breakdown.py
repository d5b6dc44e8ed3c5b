"""Where a route's time goes: the kernels of one plan + run step, each timed inside CUDA-graph replays.

For each scenario and route, the step (``plan_attention`` into fixed buffers, then ``run_attention``)
is captured in a CUDA graph; the graph is replayed with the L2 flushed before each replay, as
``qsa bench`` times it, and the PyTorch profiler records every kernel of the replays. The table lists
each kernel's median duration per step next to the replay's median wall time (the rest is launch gaps
and dependencies between the kernels). With programmatic dependent launch (sm_90, ``QSA_PDL=0`` turns it
off) a kernel may start before its predecessor ends and wait for it, so its duration includes that wait
and the durations can add up to more than the replay.

    python -m benchmarks.breakdown decode-64 mtp-8 --route xqa --route splitk --out /tmp/breakdown
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

import torch

from qsa import plan_attention, run_attention

from .generators import attention_workload
from .registry import SCENARIOS
from .timing import Timer


UNSORTED = "-unsorted"
"""A route name ending so (``xqa-unsorted``) plans without the ``rows_sorted`` hint: xqa rows then take the
planned kernel at any batch size."""


def plan_args(scn, w, route: str) -> tuple[tuple, dict]:
    """(positional, keyword) arguments of ``plan_attention`` for a scenario's workload, as the benchmark
    plans it (``route`` may end in ``UNSORTED``)."""
    c = w.cache
    rows_sorted = not route.endswith(UNSORTED)
    route = route.removesuffix(UNSORTED)
    # max_query_len as a serving engine's step metadata gives it (rows per request): `auto` sends a pure
    # decode batch to xqa.
    plan_kw = dict(block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=scn.num_q_heads,
                   num_kv_heads=scn.num_kv_heads, head_dim=scn.head_dim, route=route, rows_sorted=rows_sorted,
                   max_query_len=scn.rows // scn.num_reqs, kv_cache_dtype=c.kv_cache_dtype)
    return (w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens), plan_kw


def step_fn(scn, w, route: str):
    """plan + run of ``route`` into fixed buffers, as the benchmark times it."""
    from qsa.attention.planning.plan import PlanWorkspace

    c = w.cache
    plan_in, plan_kw = plan_args(scn, w, route)
    plan = plan_attention(*plan_in, **plan_kw)
    ws = None
    if plan.grouped is not None:
        ws = PlanWorkspace.for_plan(w.block_table, block_size=c.block_size, num_groups=plan.grouped.num_groups)
    out = torch.empty_like(w.q)

    def fn():
        p = plan_attention(*plan_in, **plan_kw, out=plan, workspace=ws)
        run_attention(p, w.q, c.k, c.v, out=out, **w.cache_kwargs)

    return fn


def check_output(out: torch.Tensor, ref: torch.Tensor, dtype, what: str) -> dict:
    """The output errors of ``out`` against ``ref`` (the fp32 reference), after they have passed the
    benchmark's fixed gate for activations of ``dtype``; RuntimeError naming ``what`` otherwise."""
    from .run import gate, gate_bounds, output_errors

    err = output_errors(out, ref)
    bounds = gate_bounds(ref, dtype, None)
    if not gate(err, bounds):
        raise RuntimeError(f"{what} fails its check against the fp32 reference: max abs "
                           f"{err['max_abs_err']:.3g} (bound {bounds['bound_abs']:.3g}), rel L2 "
                           f"{err['rel_l2_err']:.3g} (bound {bounds['bound_rel']:.3g})")
    return err


def checked_step_fn(scn, w, route: str, ref: torch.Tensor, what: str = ""):
    """``(step_fn(scn, w, route), its output buffer, its output errors)`` after one run into a NaN-filled
    output has passed :func:`check_output`, so that nothing wrong is timed."""
    fn = step_fn(scn, w, route)
    fn()
    out = fn.__closure__[fn.__code__.co_freevars.index("out")].cell_contents
    out.fill_(float("nan"))
    fn()
    return fn, out, check_output(out, ref, w.q.dtype, f"{what}{scn.name}:{route}")


def kernel_times(timer: Timer, fn, reps: int) -> tuple[dict, float]:
    """(median ms per step of each kernel name, median replay ms)."""
    from torch.profiler import ProfilerActivity, profile

    def cuda_events(p):
        return [ev for ev in p.events() if ev.device_type == torch.autograd.DeviceType.CUDA]

    fn()
    torch.cuda.synchronize()
    g = timer.capture(fn)
    wall = timer._time_replays(g).median_ms
    # The L2 flush's kernels, profiled alone: a kernel of the same name in the step (a buffer zeroed
    # by the plan) is far shorter than a flush of hundreds of MB, so the flush is told apart by length.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            timer.flush_l2()
        torch.cuda.synchronize()
    flush = defaultdict(list)
    for ev in cuda_events(prof):
        flush[ev.name].append(ev.device_time_total)
    flush_min = {name: 0.5 * min(ts) for name, ts in flush.items()}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            timer.flush_l2()
            g.replay()
        torch.cuda.synchronize()
    per_name = defaultdict(list)
    for ev in cuda_events(prof):
        if ev.device_time_total < flush_min.get(ev.name, float("inf")):
            per_name[ev.name].append(ev.device_time_total / 1e3)
    out = {}
    for name, ts in per_name.items():
        calls = max(1, round(len(ts) / reps))
        # sum of the step's calls of that kernel, median over steps
        per_step = [sum(ts[i * calls:(i + 1) * calls]) for i in range(len(ts) // calls)]
        out[name] = dict(calls=calls, median_ms=statistics.median(per_step))
    del g
    return out, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.breakdown", description=__doc__.split("\n")[0])
    ap.add_argument("scenario", nargs="+")
    ap.add_argument("--route", action="append", default=[])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    by_name = {s.name: s for s in SCENARIOS}
    timer = Timer("cuda")
    records = []
    for name in args.scenario:
        scn = by_name[name]
        w = attention_workload(scn, torch.device("cuda"))
        for route in args.route or ["auto"]:
            kernels, wall = kernel_times(timer, step_fn(scn, w, route), args.reps)
            records.append(dict(scenario=name, route=route, replay_ms=wall, kernels=kernels))
            print(f"\n{name} {route}: replay {wall * 1e3:.1f} us, kernels "
                  f"{sum(k['median_ms'] for k in kernels.values()) * 1e3:.1f} us")
            for kname, k in sorted(kernels.items(), key=lambda kv: -kv[1]["median_ms"]):
                print(f"  {k['median_ms'] * 1e3:8.1f} us  x{k['calls']}  {kname[:90]}")
        del w
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "breakdown.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
