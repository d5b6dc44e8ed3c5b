"""Bit-exact fingerprints of every route's output on the benchmark scenarios.

A change that should not move a bit (a file moved, a launcher rewritten, a check added) is shown to
move none by hashing each route's output on every scenario before and after it, on the same device::

    PYTHONPATH=src python3 -m benchmarks.output_hashes --out benchmarks/results/output-hashes-nvidia-h100.json
    PYTHONPATH=src python3 -m benchmarks.output_hashes --compare benchmarks/results/output-hashes-nvidia-h100.json

Each attention scenario is built as ``qsa bench`` builds it (:func:`benchmarks.generators.attention_workload`)
and run through plan + run on every kernel route the scenario measures, and on ``auto`` (with the
``rows_sorted`` and ``max_query_len`` hints the layer passes); the SHA-256 of ``out`` and of the fp32
``lse`` is recorded. Selection scenarios record the hash of ``select_tokens``' output. ``--compare`` reruns the
scenarios named in a saved file on this device and exits 1 when any hash differs or a route now fails.
Bits are promised for a fixed device model (split counts follow the SM count), so compare files of one
device only.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import sys
from pathlib import Path

from . import registry

ROOT = Path(__file__).resolve().parents[1]
HASHED_ROUTES = ("grouped", "xqa", "splitk", "invariant")


def digest(t) -> str:
    """SHA-256 of a tensor's bytes (its shape and dtype included), as hex."""
    import torch

    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{tuple(t.shape)}:{t.dtype}:".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def attention_hashes(scn: registry.Scenario, device: str) -> dict:
    import qsa

    from .generators import attention_workload

    w = attention_workload(scn, device)
    rows_per_req = -(-scn.rows // scn.num_reqs)
    routes = [r for r in scn.routes if r in HASHED_ROUTES] + ["auto"]
    out = {}
    for route in routes:
        try:
            plan = qsa.plan_attention(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                                      block_size=w.cache.block_size, num_blocks=w.cache.num_blocks,
                                      num_q_heads=scn.num_q_heads, num_kv_heads=scn.num_kv_heads,
                                      head_dim=scn.head_dim, route=route, rows_sorted=True,
                                      max_query_len=rows_per_req, kv_cache_dtype=w.cache.kv_cache_dtype)
            o, lse = qsa.run_attention(plan, w.q, w.cache.k, w.cache.v, return_lse=True, **w.cache_kwargs)
            out[route] = dict(out=digest(o), lse=digest(lse), ran=plan.routes.route,
                              finite=bool(o.isfinite().all()))
        except Exception as e:  # recorded: a route that stops running is a difference too
            out[route] = dict(error=f"{type(e).__name__}: {e}"[:300])
    return out


def selection_hashes(scn: registry.Scenario, device: str) -> dict:
    from qsa.selection.api import select_tokens

    from .generators import selection_workload

    sw = selection_workload(scn, device)
    # The block size is passed where select_tokens takes it, so that one script hashes older trees too.
    geometry = dict(block_size=scn.block_size) if "block_size" in inspect.signature(select_tokens).parameters \
        else {}
    try:
        idx = select_tokens(*sw.args, k=scn.topk, **geometry)
        return {"select": dict(out=digest(idx))}
    except Exception as e:
        return {"select": dict(error=f"{type(e).__name__}: {e}"[:300])}


def hashes(scenarios, device: str, log=None, after=None) -> dict:
    """``{scenario: {route: {"out": hex, "lse": hex, ...} or {"error": text}}}``; ``after(table)`` is
    called after each scenario (a run cut short keeps what it hashed)."""
    import time

    import torch

    result = {}
    for scn in scenarios:
        start = time.perf_counter()
        result[scn.name] = (attention_hashes if scn.kind == "attention" else selection_hashes)(scn, device)
        if log is not None:
            print(f"{scn.name} ({time.perf_counter() - start:.0f} s): {', '.join(sorted(result[scn.name]))}",
                  file=log, flush=True)
        if after is not None:
            after(result)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return result


def differences(old: dict, new: dict) -> list[str]:
    """Every (scenario, route) whose record differs between two hash tables, or is missing in one."""
    diff = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a is None or b is None:
            diff.append(f"{name}: only in the {'new' if a is None else 'saved'} table")
            continue
        for route in sorted(set(a) | set(b)):
            if a.get(route) != b.get(route):
                diff.append(f"{name}:{route}: {a.get(route)} -> {b.get(route)}")
    return diff


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.output_hashes",
                                description="SHA-256 of every route's output on the benchmark scenarios")
    p.add_argument("--scenario", "-s", action="append", metavar="GLOB",
                   help="scenarios matching GLOB (repeatable; default: all but the tiny test ones; with "
                        "--compare: those of the saved file, or of them the ones matching)")
    p.add_argument("--out", type=Path, help="write the table here (JSON)")
    p.add_argument("--compare", type=Path, help="a saved table: rerun its scenarios, exit 1 on any difference")
    p.add_argument("--device", default="auto", help="auto (the GPU if there is one), cpu or cuda[:N]")
    args = p.parse_args(argv)

    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        p.error("on the CPU the kernels run under the Triton interpreter: set TRITON_INTERPRET=1")
    saved = None
    if args.compare is not None:
        saved = json.loads(args.compare.read_text())
        names = set(saved["hashes"])
        scenarios = [s for s in (registry.select(args.scenario) if args.scenario else
                                 [registry.BY_NAME[n] for n in sorted(names) if n in registry.BY_NAME])
                     if s.name in names]
        saved["hashes"] = {s.name: saved["hashes"][s.name] for s in scenarios}
    else:
        scenarios = registry.select(args.scenario)
    if not scenarios:
        p.error(f"no scenario matches {args.scenario}")
    from .report import device_info

    name = device_info(device)["name"]

    def write(table):
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            record = dict(device=name, torch=torch.__version__, hashes=table)
            args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")

    table = hashes(scenarios, device, log=sys.stderr, after=write)
    record = dict(device=name, torch=torch.__version__, hashes=table)
    if args.out is not None:
        print(f"wrote {args.out}: {len(table)} scenarios")
    errors = [f"{s}:{r}" for s, routes in table.items() for r, v in routes.items() if "error" in v]
    if saved is not None:
        if saved.get("device") != record["device"]:
            print(f"note: saved on {saved.get('device')}, compared on {record['device']}", file=sys.stderr)
        diff = differences(saved["hashes"], table)
        for line in diff:
            print(f"DIFFERS {line}")
        print(f"{len(table)} scenarios compared: {len(diff)} differences")
        return 1 if diff else 0
    if errors:
        print(f"routes that raised: {', '.join(errors)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
