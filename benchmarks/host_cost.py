"""Host cost of the op called eagerly: how long one call takes to enqueue, and where that time goes.

For each step (decode 1/64/256 rows, MTP 8/16, 185 rows of one request, a 2048-row chunk, an 8192-row
prefill) at the chosen head shapes and dtypes, and each route the step can take, it measures

* ``plan_run_us``: host time of one ``sparse_paged_attention`` call (plan + run), median of ``--calls``;
* ``run_us``: host time of ``run_attention`` on a held plan;
* ``eager_ms`` / ``graph_ms``: one eager call (L2 flushed, device idle before it) and one CUDA-graph replay
  of the same call;

with ``--split``, where a replayed call's host time goes:

* ``plan_run_py_us`` / ``run_py_us``: the same calls with the replays' launches left out (the fingerprint,
  the checks, the outputs: what surrounds the launches);
* ``run_launches_us``: the launches of a run's replay alone, with their pointers, and ``run_launches``, how
  many there are;

and with ``--profile``, a cProfile of ``--calls`` calls of the first step, the functions that take the host
time, written as text::

    PYTHONPATH=src python3 -m benchmarks.host_cost --out host-cost.json --profile host-profile.txt

``qsa bench`` records the same figures per scenario; this tool is for the profile and for quick looks.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from dataclasses import replace
from pathlib import Path

from . import registry

STEPS = ("decode-1", "decode-64", "decode-256", "mtp-8", "mtp-16", "mixed-185", "chunk-2048", "prefill-64k-o80")
SHAPES = {"6x1": (6, 1), "12x1": (12, 1), "24x2": (24, 2)}
CACHES = {"fp16": ("fp16", "auto"), "bf16": ("bf16", "auto"), "fp8": ("fp16", "fp8_e4m3")}
ROUTES = ("auto", "grouped", "xqa", "splitk")


def variant(step: str, shape: str, cache: str) -> registry.Scenario:
    hq, hkv = SHAPES[shape]
    dtype, kv = CACHES[cache]
    scn = registry.BY_NAME[step]
    return replace(scn, name=f"{step}-{shape}-{cache}", num_q_heads=hq, num_kv_heads=hkv, dtype=dtype,
                   kv_cache_dtype=kv)


def hints_of(scn) -> dict:
    """The host hints every call of ``scn`` passes, as a serving layer would: the rows are sorted as
    ``select_tokens`` emits them, and the most rows any one request has (``ceil(rows / num_reqs)``, the
    scenarios spreading rows evenly)."""
    return dict(rows_sorted=True, max_query_len=-(-scn.rows // scn.num_reqs))


def calls_of(scn, w, route, out=None):
    """(one plan + run call, one run call on a held plan) of ``scn`` on ``route``, both writing ``out``
    (a new buffer when None)."""
    import torch

    import qsa

    hints = hints_of(scn)
    cache = w.cache
    out = torch.empty_like(w.q) if out is None else out

    def plan_run():
        qsa.sparse_paged_attention(w.q, cache.k, cache.v, w.indices, w.block_table, w.token_to_req, w.positions,
                                   w.seq_lens, route=route, out=out, **hints, **w.cache_kwargs)

    plan = qsa.plan_attention(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                              block_size=cache.block_size, num_blocks=cache.num_blocks, num_q_heads=scn.num_q_heads,
                              num_kv_heads=scn.num_kv_heads, head_dim=scn.head_dim, route=route,
                              kv_cache_dtype=cache.kv_cache_dtype, **hints)

    def run():
        qsa.run_attention(plan, w.q, cache.k, cache.v, out=out, **w.cache_kwargs)

    run.plan = plan
    return plan_run, run


def split_costs(timer, plan_run, run, w, out, calls: int) -> dict:
    """Where the host time of a replayed call goes (see the module docstring), for ``plan_run`` and ``run``
    from :func:`calls_of` (both writing ``out``); empty where the run is not replayed."""
    from qsa.attention import api, replay

    plan_run(), run()
    plan = run.plan
    entry, ctx = plan.replays.last, replay.context_of(w.q)
    if not isinstance(entry, replay.Replay) or ctx is None:
        return {}
    served = replay.ReplayCache.serve, replay.ReplayCache.serve_values
    try:  # the replays' launches left out: a served call returns as soon as it has its inputs
        replay.ReplayCache.serve = replay.ReplayCache.serve_values = lambda self, entry, inputs, stream: True
        rec = dict(plan_run_py_us=round(timer.host_us(plan_run, calls), 2), run_py_us=round(timer.host_us(run, calls), 2))
    finally:
        replay.ReplayCache.serve, replay.ReplayCache.serve_values = served
    values = api._run_values(plan, w.q, w.cache.k, w.cache.v, None, out, None)
    stream = ctx[0]
    rec["run_launches_us"] = round(timer.host_us(lambda: entry.launch(values, stream), calls), 2)
    rec["run_launches"] = sum(1 for step in entry.steps if step[0] == "launch")
    return rec


def admits(scn, route: str) -> bool:
    return route == "auto" or route in scn.routes


def measure(scenarios, device, calls: int, routes=ROUTES, log=None, after=None, split: bool = False) -> dict:
    import torch

    from .generators import attention_workload
    from .timing import Timer

    timer = Timer(device)
    table = {}
    for scn in scenarios:
        w = attention_workload(scn, device)
        entry = {}
        for route in routes:
            if not admits(scn, route):
                continue
            try:
                out = torch.empty_like(w.q)
                plan_run, run = calls_of(scn, w, route, out)
                rec = dict(plan_run_us=round(timer.host_us(plan_run, calls), 2),
                           run_us=round(timer.host_us(run, calls), 2))
                if split:
                    rec.update(split_costs(timer, plan_run, run, w, out, calls))
                if timer.is_cuda:
                    rec["eager_ms"] = round(timer.time_eager(plan_run).median_ms, 5)
                    rec["graph_ms"] = round(timer.time(plan_run).median_ms, 5)
            except Exception as e:  # recorded, the run goes on
                rec = dict(error=f"{type(e).__name__}: {e}"[:300])
            entry[route] = rec
        table[scn.name] = entry
        if log is not None:
            print(scn.name, json.dumps(entry), file=log, flush=True)
        if after is not None:
            after(table)
        del w
        if timer.is_cuda:
            torch.cuda.empty_cache()
    return table


def profile(scn, device, calls: int, route: str = "auto", what: str = "plan_run") -> str:
    """cProfile text of ``calls`` host calls of ``scn`` (``what``: "plan_run" or "run")."""
    import torch

    from .generators import attention_workload

    w = attention_workload(scn, device)
    fn = dict(zip(("plan_run", "run"), calls_of(scn, w, route)))[what]
    fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    text.write(f"# {scn.name}, route {route}, {what}: {calls} calls\n")
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(35)
    return text.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_cost", description=__doc__.split("\n")[0])
    p.add_argument("--steps", nargs="*", default=list(STEPS), choices=STEPS)
    p.add_argument("--shapes", nargs="*", default=["6x1"], choices=list(SHAPES))
    p.add_argument("--caches", nargs="*", default=["fp16"], choices=list(CACHES))
    p.add_argument("--routes", nargs="*", default=list(ROUTES), choices=ROUTES)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", type=Path)
    p.add_argument("--profile", type=Path, help="write a cProfile of the first step's auto call here")
    p.add_argument("--split", action="store_true",
                   help="also time each call with the replays' launches left out, and a run's launches alone")
    p.add_argument("--device", default="auto")
    p.add_argument("--replay", action=argparse.BooleanOptionalAction, default=None,
                   help="eager calls replay their recorded launches, or (--no-replay) take the full path "
                        "(settings.REPLAY_STEPS; default: as shipped)")
    args = p.parse_args(argv)
    if args.replay is not None:
        from qsa import settings

        settings.REPLAY_STEPS = args.replay

    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    scenarios = [variant(s, h, c) for s in args.steps for h in args.shapes for c in args.caches]
    if args.profile is not None:
        text = "".join(profile(scenarios[0], device, args.calls, what=what) for what in ("plan_run", "run"))
        args.profile.write_text(text)
    from .report import device_info

    name = device_info(device)["name"]

    def write(table):
        if args.out is not None:
            args.out.write_text(json.dumps(dict(device=name, host_cost=table), indent=1) + "\n")

    measure(scenarios, device, args.calls, routes=args.routes, log=sys.stderr, after=write, split=args.split)
    return 0


if __name__ == "__main__":
    sys.exit(main())
