"""Floors under the decode and MTP targets, measured: how fast the bytes of a step can be read and how
much a step of one or two launches costs, timed as ``qsa bench`` times a step (medians of CUDA-graph
replays with the L2 flushed before each one).

For each named scenario, in one process:

* ``launch-1``, ``launch-2``: a graph of one or two empty kernels. The direct xqa step is two launches
  (the attention kernel and the split merge).
* ``gather`` probes: a kernel that reads exactly the K/V head rows the xqa route reads (each row's kept
  tokens, 4-token runs scattered over the shuffled pages), with the direct kernel's shape of work: one
  program per (row, KV head, split), ``BLOCK_N`` tokens per tile, the split's entries read before the
  loop, the K/V loads pipelined as asynchronous copies; splits from ``routes.direct_split_count`` or
  given. It feeds the tiles to two products with all-ones operands and sums the results, so it is the
  time of the loads alone. Variants: ``flat`` (each entry's head row precomputed: one load before the
  loop), ``table`` (the tokens, then their block-table entries, as the direct kernel resolves them;
  it reads every valid entry, as the scenarios' rows keep them all) and ``contiguous`` (the same byte
  count and program shape, each list's rows laid out one after another in a separate buffer: no gather).
  Every probe is checked per program against an fp64 sum before it is timed.
* the ``xqa`` and ``splitk`` routes, plan + run as the benchmark times them, and the target's time:
  80% of the copy bandwidth on the route's bytes (decode), splitk / 1.5 (MTP).

    python -m benchmarks.floors decode-64 mtp-8 mtp-16 --out /tmp/floors
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from qsa import routes
from qsa.kernels.common import split_range

from .breakdown import step_fn
from .generators import attention_workload, kept_entries
from .registry import SCENARIOS
from .run import step_bytes
from .timing import Timer, TimingConfig, measure_ceilings


@triton.jit
def _nothing_kernel(x_ptr):
    """An empty kernel: what a launch costs inside a graph replay."""
    if tl.program_id(0) < 0:
        tl.store(x_ptr, 0)


@triton.jit
def gather_sum_kernel(
    off_ptr,  # [lists, W] int64: each entry's head row (element offset / HEAD_DIM; -1: not read); FLAT
    idx_ptr,  # [rows, W] int32 tokens; not FLAT
    bt_ptr,  # [num_reqs, max_blocks] int32; not FLAT
    req_ptr,  # [rows] int32; not FLAT
    k_ptr,
    v_ptr,
    out_ptr,  # [lists, NUM_SPLITS] fp32: each program's sum of what it read
    W,
    num_kv_heads,
    stride_bt,
    stride_block,
    stride_tok,
    stride_head,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FLAT: tl.constexpr,
    SPLIT_N: tl.constexpr,  # power of two >= a split's entries
):
    """One program per (row, KV head, split) sums the K and V head rows of its split's entries, through
    the two products of an attention step with all-ones operands (so the compiler pipelines the K/V loads
    into shared memory as it does the attention kernels'): ``1 @ K^T`` and ``1 @ V``."""
    i_list = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    i_r = i_list // num_kv_heads
    i_kvh = i_list % num_kv_heads
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, HEAD_DIM)
    b_one_q = tl.full([16, HEAD_DIM], 1.0, tl.float16)
    b_one_p = tl.full([16, BLOCK_N], 1.0, tl.float16)
    # The split's entries are resolved before the loop, as the direct kernel resolves them, and each
    # tile takes its own from registers: no K/V load waits on a load of its own tile.
    tile_start, tile_end = split_range(tl.cdiv(W, BLOCK_N), i_split, NUM_SPLITS)
    o_s = tile_start * BLOCK_N + tl.arange(0, SPLIT_N)
    m_s = o_s < tl.minimum(W, tile_end * BLOCK_N)
    # The offsets are formed after the gather (a head row times HEAD_DIM, a block times its stride), so
    # the compiler sees them as multiples of 16 elements and makes the K/V loads 16-byte asynchronous
    # copies, pipelined as in the attention kernels.
    if FLAT:
        b_rows = tl.load(off_ptr + i_list * W + o_s, mask=m_s, other=-1)
    else:
        p_bt = bt_ptr + tl.load(req_ptr + i_r).to(tl.int64) * stride_bt
        b_ts = tl.load(idx_ptr + i_r * W + o_s, mask=m_s, other=-1)
        b_ps = tl.load(p_bt + b_ts // BLOCK_SIZE, mask=b_ts >= 0, other=-1)
    b_sk = tl.zeros([16, BLOCK_N], tl.float32)
    b_sv = tl.zeros([16, HEAD_DIM], tl.float32)
    for i_t in range(tile_start, tile_end):
        o_l = tl.minimum((i_t - tile_start) * BLOCK_N, SPLIT_N - BLOCK_N) + o_n
        if FLAT:
            b_row = tl.gather(b_rows, o_l, 0)
            m_n = b_row >= 0
            b_off = b_row * HEAD_DIM
        else:
            b_t = tl.gather(b_ts, o_l, 0)
            b_p = tl.gather(b_ps, o_l, 0).to(tl.int64)
            m_n = (b_t >= 0) & (b_p >= 0)
            b_off = b_p * stride_block + (b_t % BLOCK_SIZE) * stride_tok + i_kvh * stride_head
        b_k = tl.load(k_ptr + b_off[:, None] + o_d[None, :], mask=m_n[:, None], other=0).to(tl.float16)
        b_v = tl.load(v_ptr + b_off[:, None] + o_d[None, :], mask=m_n[:, None], other=0).to(tl.float16)
        b_sk = tl.dot(b_one_q, tl.trans(b_k), b_sk)
        b_sv = tl.dot(b_one_p, b_v, b_sv)
    b_total = tl.sum(tl.where(tl.arange(0, 16)[:, None] == 0, b_sk, 0.0), 1)
    b_total += tl.sum(tl.where(tl.arange(0, 16)[:, None] == 0, b_sv, 0.0), 1)
    tl.store(out_ptr + i_list * NUM_SPLITS + i_split + tl.arange(0, 16), b_total, mask=tl.arange(0, 16) == 0)


def flat_offsets(w, kept: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
    """``[rows * Hkv, W]`` int64: each kept entry's K (= V) head row (its element offset / head_dim),
    -1 elsewhere (``kept`` and ``phys`` from ``generators.kept_entries``)."""
    c = w.cache
    t = w.indices.long().clamp(min=0)
    s_block, s_tok, s_head = c.k.stride(0), c.k.stride(1), c.k.stride(2)
    base = phys * s_block + (t % c.block_size) * s_tok
    heads = torch.arange(c.k.shape[2], device=t.device) * s_head
    off = base[:, None, :] + heads[None, :, None]
    d = c.k.shape[3]
    if any(st % d for st in (s_block, s_tok, s_head)):
        raise ValueError(f"cache strides {c.k.stride()} are not multiples of head_dim {d}")
    return torch.where(kept[:, None, :], off // d, -1).reshape(-1, t.shape[1])


def contiguous_offsets(kept: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Offsets into a dense buffer holding each list's kept entries one after another, in list order."""
    lists = kept.repeat_interleave(num_kv_heads, 0)
    slot = torch.cumsum(lists.flatten().long(), 0).reshape(lists.shape) - 1
    return torch.where(lists, slot, -1)


class Probe:
    """The gather probe of one workload, with its inputs prepared once."""

    def __init__(self, w, scn):
        self.w, self.scn = w, scn
        c = w.cache
        # The entries xqa reads, at their positions in the rows (the scenarios' rows hold each token once).
        self.kept, self.phys = kept_entries(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                                            block_size=c.block_size, num_blocks=c.num_blocks)
        self.flat = flat_offsets(w, self.kept, self.phys).contiguous()
        self.k, self.v = c.k, c.v
        if c.kv_cache_dtype == "fp8_e4m3":  # read the bytes; the sum is of their integer codes
            self.k, self.v = c.k.view(torch.uint8), c.v.view(torch.uint8)
        n = int(self.kept.sum()) * scn.num_kv_heads
        self.dense_k = torch.ones(max(n, 1) * scn.head_dim, dtype=self.k.dtype, device=self.k.device)
        self.dense_v = torch.ones_like(self.dense_k)
        self.contiguous = contiguous_offsets(self.kept, scn.num_kv_heads, scn.head_dim).contiguous()
        self.lists = w.indices.shape[0] * scn.num_kv_heads
        self._expected = {}

    def default_splits(self, block_n: int) -> int:
        """The direct kernel's split count for this workload (its programs per SM), at ``block_n``."""
        scn = self.scn
        cfg = routes.xqa_direct_config(scn.num_q_heads // scn.num_kv_heads, scn.head_dim, self.lists,
                                       kv_fp8=scn.kv_cache_dtype == "fp8_e4m3")
        tiles = triton.cdiv(self.w.indices.shape[1], block_n)
        return routes.direct_split_count(self.lists, tiles, cfg.programs_per_sm, self.k.device)

    def fn(self, variant: str, splits: int, block_n: int, num_warps: int, stages: int):
        w, scn = self.w, self.scn
        out = torch.empty(self.lists, splits, dtype=torch.float32, device=self.k.device)
        k, v, off = self.k, self.v, self.flat
        if variant == "contiguous":
            k, v, off = self.dense_k, self.dense_v, self.contiguous
        c = w.cache
        args = (off, w.indices, w.block_table, w.token_to_req, k, v, out, w.indices.shape[1], scn.num_kv_heads,
                w.block_table.stride(0), c.k.stride(0), c.k.stride(1), c.k.stride(2))
        kw = dict(NUM_SPLITS=splits, BLOCK_N=block_n, HEAD_DIM=scn.head_dim, BLOCK_SIZE=c.block_size,
                  FLAT=variant != "table", num_warps=num_warps, num_stages=stages,
                  SPLIT_N=triton.next_power_of_2(triton.cdiv(triton.cdiv(w.indices.shape[1], block_n), splits) * block_n))

        def fn():
            gather_sum_kernel[(self.lists, splits)](*args, **kw)

        return fn, out

    def checked(self, variant: str, splits: int, block_n: int, num_warps: int, stages: int):
        """(the probe's launch, whether one launch summed exactly what it must: its output is first
        poisoned with NaN, then compared per program with :meth:`expected`)."""
        fn, out = self.fn(variant, splits, block_n, num_warps, stages)
        out.fill_(float("nan"))
        fn()
        want = self.expected(variant, splits, block_n)
        return fn, bool(torch.allclose(out.double(), want, rtol=1e-4, atol=1e-2))

    def expected(self, variant: str, splits: int, block_n: int) -> torch.Tensor:
        """``[lists, splits]`` fp64: what each program must sum, from the cache indexed by (block, slot,
        head), not from the probe's offsets. The ``table`` variant reads every valid entry, so it
        agrees only where every valid entry is kept (the scenarios' rows)."""
        key = (variant == "contiguous", splits, block_n)
        if key not in self._expected:
            self._expected[key] = self._expected_sums(variant == "contiguous", splits, block_n)
        return self._expected[key]

    def _expected_sums(self, contiguous: bool, splits: int, block_n: int) -> torch.Tensor:
        w = self.w
        width = w.indices.shape[1]
        hkv = self.scn.num_kv_heads
        per_entry = torch.zeros(self.lists, width, dtype=torch.float64, device=self.kept.device)
        t = w.indices.long().clamp(min=0)
        bs = w.cache.block_size
        phys = self.phys
        for i in range(self.lists):
            r, h = divmod(i, hkv)
            m = self.kept[r]
            if contiguous:
                per_entry[i, m] = 2.0 * self.scn.head_dim
            elif bool(m.any()):
                tok = t[r, m]
                kv = self.k[phys[r, m], tok % bs, h].double() + self.v[phys[r, m], tok % bs, h].double()
                per_entry[i, m] = kv.sum(1)
        tiles = triton.cdiv(width, block_n)
        per = triton.cdiv(tiles, splits)
        split_of = torch.arange(width, device=per_entry.device) // block_n // per
        out = torch.zeros(self.lists, splits, dtype=torch.float64, device=per_entry.device)
        return out.index_add_(1, split_of, per_entry)


def launch_fns(device):
    x = torch.zeros(1, dtype=torch.int32, device=device)

    def one():
        _nothing_kernel[(1,)](x)

    def two():
        _nothing_kernel[(1,)](x)
        _nothing_kernel[(1,)](x)

    return one, two


def probe_grid(quick: bool):
    """(variant, block_n, num_warps, stages) tried per split count."""
    if quick:
        return [("flat", 32, 4, 3), ("table", 32, 4, 3), ("contiguous", 32, 4, 3)]
    grid = [("flat", 32, 4, 2), ("flat", 32, 4, 3), ("flat", 32, 4, 4), ("flat", 64, 4, 3), ("flat", 64, 8, 2),
            ("flat", 64, 8, 3), ("table", 32, 4, 3), ("contiguous", 32, 4, 3)]
    return grid


def run_scenario(scn, timer: Timer, ceilings: dict, *, quick: bool, split_factors=(0.5, 1, 2)) -> dict:
    dev = timer.device
    w = attention_workload(scn, dev)
    probe = Probe(w, scn)
    kv_per_token, qo_bytes = step_bytes(scn)
    kv_bytes = int(probe.kept.sum()) * kv_per_token
    rec = dict(scenario=scn.name, rows=scn.rows, kv_bytes=kv_bytes, route_bytes=kv_bytes + qo_bytes, probes=[])

    # The routes, plan + run.
    for route in ("xqa", "splitk"):
        fn = step_fn(scn, w, route)
        fn()
        rec[f"{route}_ms"] = timer.time(fn).median_ms
    if scn.name.startswith("mtp"):
        rec["target_ms"] = rec["splitk_ms"] / 1.5
        rec["target"] = "splitk / 1.5"
    else:
        rec["target_ms"] = rec["route_bytes"] / (0.8 * ceilings["copy_gbps"] * 1e9) * 1e3
        rec["target"] = "route bytes at 0.8 x copy bandwidth"

    one, two = launch_fns(dev)
    one()
    two()
    rec["launch_1_ms"] = timer.time(one).median_ms
    rec["launch_2_ms"] = timer.time(two).median_ms

    for variant, block_n, nw, st in probe_grid(quick):
        base = probe.default_splits(block_n)
        tiles = triton.cdiv(w.indices.shape[1], block_n)
        splits = sorted({max(1, min(tiles, round(base * f))) for f in (split_factors if not quick else (1,))})
        for s in splits:
            fn, ok = probe.checked(variant, s, block_n, nw, st)
            t = timer.time(fn).median_ms if ok else None
            rec["probes"].append(dict(variant=variant, splits=s, block_n=block_n, num_warps=nw, stages=st,
                                      programs=probe.lists * s, ok=ok, median_ms=t,
                                      kv_gbps=None if t is None else kv_bytes / (t * 1e-3) / 1e9))
    done = [p for p in rec["probes"] if p["ok"]]
    for variant in ("flat", "table", "contiguous"):
        best = min((p for p in done if p["variant"] == variant), key=lambda p: p["median_ms"], default=None)
        rec[f"best_{variant}"] = best
    del w, probe
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def markdown(report: dict) -> str:
    lines = [f"Floors on {report['device']}, {report['date']} (copy {report['ceilings']['copy_gbps']:.0f} GB/s); "
             f"us, medians of graph replays with the L2 flushed ({report.get('flush', 'write')}).", "",
             "| scenario | target | xqa | splitk | 1 launch | 2 launches | best gather (flat) | best gather "
             "(table) | contiguous | flat GB/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def us(x):
        return "-" if x is None else f"{x * 1e3:.1f}"

    for r in report["scenarios"]:
        bf, bt, bc = (r.get(f"best_{v}") for v in ("flat", "table", "contiguous"))

        def cell(p):
            if p is None:
                return "-"
            return f"{us(p['median_ms'])} ({p['splits']} splits, {p['block_n']}/{p['num_warps']}w/{p['stages']}st)"

        gbps = "-" if bf is None else f"{bf['kv_gbps']:.0f}"
        lines.append(f"| {r['scenario']} | {us(r['target_ms'])} | {us(r['xqa_ms'])} | {us(r['splitk_ms'])} | "
                     f"{us(r['launch_1_ms'])} | {us(r['launch_2_ms'])} | {cell(bf)} | {cell(bt)} | {cell(bc)} | "
                     f"{gbps} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.floors", description=__doc__.split("\n")[0])
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--out", type=Path, default=None, help="directory for floors-<date>-<device>.json and .md")
    p.add_argument("--quick", action="store_true", help="one probe setting per variant, default splits")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--flush", choices=Timer.FLUSHES, default="write",
                   help="L2 flush before each replay: write (the benchmark's) or read (leaves the L2 clean)")
    args = p.parse_args(argv)
    by_name = {s.name: s for s in SCENARIOS}
    bad = [n for n in args.scenarios if n not in by_name or by_name[n].kind != "attention"]
    if bad:
        p.error(f"not attention scenarios: {bad}")
    dev = torch.device(args.device)
    cfg = TimingConfig(budget_s=0.2, min_reps=20, max_reps=300) if dev.type == "cuda" else TimingConfig()
    timer = Timer(dev, dataclasses.replace(cfg, flush=args.flush))
    ceilings = measure_ceilings(timer)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    report = dict(device=name, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), ceilings=ceilings,
                  flush=args.flush, scenarios=[])
    for n in args.scenarios:
        report["scenarios"].append(run_scenario(by_name[n], timer, ceilings, quick=args.quick))
        print(f"{n}: done", file=sys.stderr, flush=True)
    text = markdown(report)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"floors-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}-{name.lower().replace(' ', '-')}"
        if args.flush != "write":
            stem += f"-{args.flush}-flush"
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        (args.out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
