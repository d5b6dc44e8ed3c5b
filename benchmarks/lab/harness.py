"""What the prototypes' scripts share: a prefill scenario's grouped problem with its references, the
interleaved timing rounds, and the command line that writes the records."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass


@dataclass
class GroupedProblem:
    """One scenario's inputs, its grouped plan (made once) and the references an output is checked against."""
    q: object
    cache: object
    plan: object
    scale: float
    attention_kwargs: dict  # grouped_attention's keyword arguments besides q, k, v, plan, out, config
    ref: object  # fp32 reference, as float64
    low: object  # the same computation in the activations' dtype (sets the tolerance)
    name: str = ""
    workload: object = None  # the scenario's inputs (benchmarks.generators.attention_workload)

    def check(self, out) -> None:
        """``out``'s planned rows against the fp32 reference (raises if they differ beyond the tolerance)."""
        from qsa.attention.reference import assert_close_like_torch

        n = self.plan.num_rows
        assert_close_like_torch(out[:n], self.ref[:n], self.low[:n])

    def same_bits(self, a, b) -> bool:
        """Whether two outputs' planned rows are bitwise equal."""
        import torch

        n = self.plan.num_rows
        return bool(torch.equal(a[:n], b[:n]))


def grouped_problem(name: str, device) -> GroupedProblem:
    import torch

    from qsa.attention.planning.plan import plan_groups, PlanWorkspace

    from ..baselines import chunked_attention, full_fp32_matmul
    from ..generators import attention_workload
    from ..registry import BY_NAME

    scn = BY_NAME[name]
    w = attention_workload(scn, device)
    q, c = w.q, w.cache
    with full_fp32_matmul():
        ref = chunked_attention(q, *w.args, compute_dtype=torch.float32, **w.cache_kwargs).double()
    low = chunked_attention(q, *w.args, compute_dtype=q.dtype, **w.cache_kwargs)
    ws = PlanWorkspace.for_plan(w.block_table, block_size=c.block_size, num_groups=q.shape[0] // 8)
    plan = plan_groups(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                       block_size=c.block_size, num_blocks=c.num_blocks, workspace=ws)
    scale = scn.head_dim ** -0.5
    kw = dict(lse=None, gate=None, softmax_scale=scale, k_scale=c.k_scale, v_scale=c.v_scale, kv_fp8=False)
    return GroupedProblem(q, c, plan, scale, kw, ref, low, name, w)


def kernel_args(q, k, v, plan, out, softmax_scale: float) -> tuple:
    """The prototypes' kernel arguments up to the constexprs, after checking their scope: 6/1/256 fp16,
    8-row groups, K and V of one layout."""
    hq, d = q.shape[1], q.shape[2]
    if (hq // k.shape[2], d, plan.group_rows) != (6, 256, 8) or q.dtype != k.dtype or str(q.dtype) != "torch.float16":
        raise ValueError("the prototypes cover 6/1/256 fp16 with 8-row groups only")
    if k.stride() != v.stride():
        raise ValueError(f"K and V caches must share their strides, got {k.stride()} and {v.stride()}")
    return (q, k, v, plan.mb_ids, plan.masks, plan.counts, out, plan.num_rows, softmax_scale * math.log2(math.e),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), plan.mb_ids.stride(0),
            out.stride(0), out.stride(1))


def compare_kernels(names, timer, make_runs, twins: dict, rounds: int = 2, only=None) -> list[dict]:
    """For each scenario: ``make_runs(problem)`` gives {label: fn(out)} (those in ``only`` and "library"
    where ``only`` is given); each run writes a NaN-filled output,
    which is checked against the fp32 reference (a run that fails or raises is recorded with its error and
    not timed); ``twins`` {label: other label} are compared bitwise; then every run is timed in
    interleaved rounds (median of CUDA-graph replays, us)."""
    import torch

    records = []
    for name in names:
        pb = grouped_problem(name, timer.device)
        runs, outs = {}, {}
        for label, run in make_runs(pb).items():
            if only and label not in only and label != "library":
                continue
            out = torch.full_like(pb.q, float("nan"))
            fn = functools.partial(run, out)
            try:
                fn()
                torch.cuda.synchronize()
                pb.check(out)
            except (AssertionError, ValueError, RuntimeError) as e:  # recorded; the kernel is not timed
                records.append(dict(scenario=name, kernel=label, error=f"{type(e).__name__}: {e}"[:2000]))
                print(f"{name}: {label} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            runs[label] = fn
            outs[label] = out
        for label, twin in twins.items():
            if label not in outs or twin not in outs:
                continue
            same = pb.same_bits(outs[label], outs[twin])
            records.append(dict(scenario=name, kernel=label, bitwise_equal_to=twin, equal=same))
            print(f"{name}: {label} bitwise equal to {twin}: {same}", flush=True)
        for rnd in range(rounds):
            for label, fn in runs.items():
                t = timer.time(fn)
                records.append(dict(scenario=name, kernel=label, round=rnd, us=t.median_ms * 1e3))
                print(f"{name:20s} {label:12s} round {rnd} {t.median_ms * 1e3:8.1f} us", flush=True)
        del pb, runs, outs
        torch.cuda.empty_cache()
    return records


def main(prog: str, doc: str, stem: str, compare, argv=None) -> int:
    """``prog SCENARIO... [--only LABEL]... [--out DIR]``: ``compare(names, timer, only=...)``'s records into
    DIR/STEM.json (a later run into DIR replaces it)."""
    import torch

    from ..timing import Timer, TimingConfig

    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--only", action="append", help="time only this kernel label (repeatable) and the library's")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    timer = Timer("cuda", TimingConfig(budget_s=0.2, min_reps=10, max_reps=100))
    records = compare(args.scenarios, timer, only=set(args.only or ()))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       records=records), f, indent=1)
    return 0
