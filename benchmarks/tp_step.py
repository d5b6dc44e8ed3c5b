"""Step time of one QSA layer at TP1, TP2 and TP4 (NCCL on GPUs): a prefill chunk and a decode batch.

Every rank builds the reference-shape layer (24/2 heads of 256, index 4 x 128, top-512) with its head
shard, fills a paged context for ``--requests`` requests of ``--context`` tokens (untimed), then times

* prefill: one chunk of ``--chunk`` rows at the end of request 0's context;
* decode: one row per request;

each called eagerly, replayed from a CUDA graph, and (``--compile``) called through ``torch.compile`` of
the layer, with CUDA events (median of ``--reps``; the all-reduce included). ``--replay`` /
``--no-replay`` set ``settings.REPLAY_STEPS`` (eager calls replay their recorded launches, or not). Rank 0
reports.

Run from the checkout root: ``PYTHONPATH=src python -m benchmarks.tp_step [--tp 1 2] [--context 8192]``;
``--json benchmarks/results/tp-step-latest-nvidia-h200.json`` replaces the kept result (the one before it is
in git history).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph_ms(fn, reps: int):
    """Median replay time of ``fn`` captured in a CUDA graph (warmed up on a side stream first), or the
    error that stopped the capture (a string)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        ms = _median_ms(graph.replay, reps)
        del graph  # a captured NCCL call holds the communicator: release it before the group goes
        torch.cuda.synchronize()
        return ms
    except Exception as e:  # recorded: the eager figures still stand
        torch.cuda.synchronize()
        return f"capture failed: {type(e).__name__}: {e}"[:200]


def _compiled_ms(layer, x, meta, cache, reps: int):
    """Median time of the layer step through ``torch.compile`` (compiled on its first calls), or the
    error that stopped it (a string)."""
    try:
        compiled = torch.compile(layer)
        for _ in range(2):
            compiled(x, meta, cache)
        torch.cuda.synchronize()
        return _median_ms(lambda: compiled(x, meta, cache), reps)
    except Exception as e:
        torch.cuda.synchronize()
        return f"compile failed: {type(e).__name__}: {e}"[:200]


def _profile(fn) -> None:
    """Print the CUDA kernels of one eager call of ``fn``, longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    print(events.table(sort_by=key, row_limit=15), flush=True)


def _host_profile(layer, x, meta, cache, reps: int) -> dict:
    """Host time (us, median of ``reps``) of each stage of one eager step of ``layer``, and of the whole
    step: each stage's call is timed from entry to return with the device idle before the step, so what it
    measures is the work of enqueueing (checks, binding, launches), not the kernels."""
    from qsa.attention import api
    from qsa.model import ops

    stages = {"project": (layer, "project"), "write_kv": (ops, "write_kv_impl"),
              "update_compressed_keys": (ops, "update_compressed_keys_impl"),
              "select_tokens": (ops, "select_tokens_impl"), "plan_attention": (api, "plan_attention"),
              "run_attention": (api, "run_attention")}
    spent = {name: [] for name in (*stages, "step")}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name].append(time.perf_counter() - t)
        return wrapper

    originals = {name: getattr(owner, attr) for name, (owner, attr) in stages.items()}
    try:
        for name, (owner, attr) in stages.items():
            setattr(owner, attr, timed(name, originals[name]))
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            layer(x, meta, cache)
            spent["step"].append(time.perf_counter() - t)
    finally:
        for name, (owner, attr) in stages.items():
            if owner is layer:
                delattr(layer, attr)  # the bound method again
            else:
                setattr(owner, attr, originals[name])
        torch.cuda.synchronize()
    return {name: round(1e6 * statistics.median(v), 1) for name, v in spent.items() if v}


def _worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    from qsa.cache.paged import BlockAllocator
    from qsa.model.layer import QSAAttention, QSAConfig, StepMetadata
    from qsa.model.serving import prefill_schedule
    from qsa.model.tp import destroy, init_local_group, TPInfo
    from qsa import settings

    if args.replay is not None:
        settings.REPLAY_STEPS = args.replay

    faulthandler.dump_traceback_later(args.watchdog, exit=True)  # a hung rank prints where it is
    t0 = time.time()

    def say(msg):
        if rank == 0:
            print(f"  TP{world} {time.time() - t0:6.1f}s {msg}", flush=True)

    if world > 1:
        tp = init_local_group(rank, world, port, backend="nccl")
    else:
        torch.cuda.set_device(0)
        tp = TPInfo()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = QSAConfig()
    layer = QSAAttention(cfg, tp=tp, seed=0, device=dev)
    bs, R, L = args.block_size, args.requests, args.context
    max_blocks = -(-(L + 1) // bs)
    num_blocks = R * max_blocks + 8
    cache = layer.allocate_cache(num_blocks, bs, R, fill="zeros")
    alloc = BlockAllocator(num_blocks, bs, generator=0)
    table = torch.full((R, max_blocks), -1, dtype=torch.int32)
    lens = [0] * R
    gen = torch.Generator(device=dev).manual_seed(0)

    def meta_for(chunks):
        t2r, pos, slots = [], [], []
        for slot, start, end in chunks:
            blocks = alloc.allocate(slot, end)
            table[slot, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            lens[slot] = max(lens[slot], end)
            t2r += [slot] * (end - start)
            pos += range(start, end)
            slots.append(alloc.slot_mapping(slot, start, end))
        return StepMetadata.build(t2r, pos, lens, table, torch.cat(slots), block_size=bs, device=dev)

    def hidden(rows):
        return torch.randn(rows, cfg.hidden_size, generator=gen, device=dev).to(cfg.dtype)

    with torch.no_grad():
        for step in prefill_schedule([L] * R, args.chunk):
            meta = meta_for([(c.slot, c.start, c.end) for c in step])
            layer(hidden(meta.num_rows), meta, cache)
        torch.cuda.synchronize()
        say(f"context filled: {R} x {L} tokens")

        meta = meta_for([(0, L - args.chunk, L)])
        x = hidden(args.chunk)
        dmeta = meta_for([(r, L, L + 1) for r in range(R)])
        dx = hidden(R)
        times = {}
        for step, (xs, ms) in (("prefill", (x, meta)), ("decode", (dx, dmeta))):
            layer(xs, ms, cache)
            times[f"{step}_ms"] = _median_ms(lambda: layer(xs, ms, cache), args.reps)
            times[f"{step}_graph_ms"] = _graph_ms(lambda: layer(xs, ms, cache), args.reps)
            if args.compile:
                times[f"{step}_compiled_ms"] = _compiled_ms(layer, xs, ms, cache, args.reps)
            if args.host_profile and world == 1:
                times[f"{step}_host_us"] = _host_profile(layer, xs, ms, cache, args.reps)
            say(f"{step} " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in times.items() if k.startswith(step)))
        if args.profile and world == 1:  # alone: a profiled call on one rank would wait for the others
            _profile(lambda: layer(dx, dmeta, cache))
        torch.cuda.synchronize()

    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(tp=world, heads=f"{layer.num_q_heads}/{layer.num_kv_heads}",
                           replay=settings.REPLAY_STEPS, **times), f)
    if world > 1:
        destroy()
    faulthandler.cancel_dump_traceback_later()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.tp_step", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--context", type=int, default=8192, help="tokens of each request before the timed steps")
    p.add_argument("--chunk", type=int, default=2048, help="rows of the timed prefill step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="print the kernels of one eager decode step (rank 0)")
    p.add_argument("--host-profile", action="store_true",
                   help="also record the host time of each stage of one eager step (TP1 only): "
                        "<step>_host_us in the rows")
    p.add_argument("--compile", action="store_true", help="also time each step through torch.compile of the layer")
    p.add_argument("--replay", action=argparse.BooleanOptionalAction, default=None,
                   help="eager calls replay their recorded launches, or (--no-replay) take the full path "
                        "(settings.REPLAY_STEPS; default: as shipped)")
    p.add_argument("--watchdog", type=float, default=240, help="seconds before a rank dumps its stack and exits")
    p.add_argument("--json", default=None,
                   help="also write the rows (with device and settings) to this file; the repository keeps the "
                        "latest as benchmarks/results/tp-step-latest-<device>.json, earlier ones in git history")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.tp_step needs CUDA GPUs", file=sys.stderr)
        return 2
    from qsa.model.tp import free_port

    rows = []
    for world in args.tp:
        if world > torch.cuda.device_count():
            print(f"TP{world}: skipped ({torch.cuda.device_count()} GPUs)")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.spawn(_worker, args=(world, free_port(), args, out), nprocs=world, join=True)
            with open(out) as f:
                rows.append(json.load(f))
            print(f"TP{world}: {rows[-1]}", flush=True)
    print(f"{args.requests} requests x {args.context} tokens of context, prefill chunk {args.chunk}, "
          f"block size {args.block_size}; {torch.cuda.get_device_name()}")
    print(f"{'TP':>3s} {'heads/rank':>10s} {'step':>8s} {'eager ms':>9s} {'graph ms':>9s} {'eager/graph':>11s} "
          f"{'compiled ms':>11s}")
    for r in rows:
        for step in ("prefill", "decode"):
            eager, graph, comp = r[f"{step}_ms"], r.get(f"{step}_graph_ms"), r.get(f"{step}_compiled_ms")
            num = isinstance(graph, float)
            print(f"{r['tp']:>3d} {r['heads']:>10s} {step:>8s} {eager:>9.3f} "
                  f"{graph if not num else f'{graph:.3f}':>9} {f'{eager / graph:.2f}' if num else '-':>11s} "
                  f"{comp if not isinstance(comp, float) else f'{comp:.3f}'!s:>11}")
    for r in rows:
        for step in ("prefill", "decode"):
            if f"{step}_host_us" in r:
                print(f"TP{r['tp']} {step} host us: " + ", ".join(f"{k} {v}" for k, v in r[f"{step}_host_us"].items()))
    if args.json:
        record = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                  "settings": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
