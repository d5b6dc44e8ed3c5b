"""One scenario's attention through the public plan/run split, a few times, for a profiler.

Nsight Compute then reports where an attention kernel's time goes (throughput against the memory and
tensor-core peaks, stall reasons), e.g.:

    ncu --kernel-name regex:grouped_attention --launch-skip 2 --launch-count 1 --set full \\
        python -m benchmarks.ncu_probe prefill-64k-o98
    ncu --kernel-name regex:xqa_attention --launch-skip 2 --launch-count 1 \\
        python -m benchmarks.ncu_probe decode-64 --route xqa

Scenario names are those of ``qsa bench --list`` (attention scenarios only).
"""

from __future__ import annotations

import argparse
import sys

import torch

from qsa import plan_attention, run_attention

from .generators import attention_workload
from .registry import SCENARIOS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncu_probe", description=__doc__.split("\n")[0])
    p.add_argument("scenario")
    p.add_argument("--route", default="auto", help="route of the plan (default: auto)")
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--unsorted", action="store_true",
                   help="plan without rows_sorted=True (the benchmark passes it: its rows come from select_tokens)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    by_name = {s.name: s for s in SCENARIOS}
    if args.scenario not in by_name or by_name[args.scenario].kind != "attention":
        p.error(f"not an attention scenario: {args.scenario!r}")
    scn = by_name[args.scenario]
    w = attention_workload(scn, torch.device(args.device))
    c = w.cache
    shape = dict(num_q_heads=scn.num_q_heads, num_kv_heads=scn.num_kv_heads, head_dim=scn.head_dim,
                 kv_cache_dtype=w.cache.kv_cache_dtype)
    out = torch.empty_like(w.q)
    for _ in range(args.calls):
        plan = plan_attention(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                              block_size=c.block_size, num_blocks=c.num_blocks, route=args.route,
                              rows_sorted=not args.unsorted, **shape)
        run_attention(plan, w.q, c.k, c.v, kv_cache_dtype=c.kv_cache_dtype, k_scale=c.k_scale,
                      v_scale=c.v_scale, out=out)
    if out.is_cuda:
        torch.cuda.synchronize()
    print(f"{scn.name}: {args.calls} calls, route {args.route}, overlap {w.stats['overlap']}, "
          f"finite {bool(torch.isfinite(out).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
