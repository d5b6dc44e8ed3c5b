"""The benchmark suite on the CPU: generators, references, the correctness gate, target evaluation, ``qsa
bench`` on a tiny scenario, and a tiny end-to-end run under the Triton interpreter (JSON schema, docs).

The end-to-end run and the tools around the suite (the launch-setting sweeps, floors, the profiler driver,
A/B runs) are marked ``lab`` and left out of the default run (``python -m pytest -m lab``)."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout root

from benchmarks import registry, report, run  # noqa: E402
from benchmarks.baselines import (exact_selection, naive_attention,  # noqa: E402
                                  reference_attention_fp32, selection_check)
from benchmarks.generators import (adjacent_overlap, block_sets, expand_blocks, row_layout,  # noqa: E402
                                   selection_stats, walk_blocks)
from helpers import make_attention_case
from qsa.attention.reference import reference_attention  # noqa: E402


# ------------------------------------------------------------------------------------------------
# generators


@pytest.mark.parametrize("overlap, lo, hi", [(0.8, 0.75, 0.85), (0.98, 0.97, 1.0), (0.5, 0.45, 0.55)])
def test_walk_hits_requested_overlap(overlap, lo, hi):
    req, pos = row_layout(256, 1, 8192)
    seq = np.array([8192])
    blocks = walk_blocks(req, pos, seq, topk=64, overlap=overlap, seed=1)
    assert ((blocks >= 0).sum(1) == 64).all()
    assert all(len(set(r.tolist())) == 64 for r in blocks)
    assert (np.diff(blocks, axis=1) > 0).all()
    vis = np.minimum((pos + 1) // 4, 8192 // 4)
    assert (blocks < vis[:, None]).all()
    big = torch.iinfo(torch.int64).max
    b = torch.where(torch.from_numpy(blocks) >= 0, torch.from_numpy(blocks), big)
    got = adjacent_overlap(b, torch.from_numpy(req))
    assert lo <= got <= hi, got
    assert abs(got - overlap) < 0.02


def test_walk_dense_rows_and_new_requests():
    # Rows whose visible range is at most topk select everything visible; a new request restarts.
    req = np.array([0, 0, 0, 1, 1])
    pos = np.array([9, 10, 63, 60, 61])
    blocks = walk_blocks(req, pos, np.array([64, 64]), topk=8, overlap=0.8, seed=0)
    assert blocks[0].tolist() == [0, 1, -1, -1, -1, -1, -1, -1]     # visible (9 + 1) // 4 = 2
    assert blocks[1].tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    assert ((blocks[2:] >= 0).sum(1) == 8).all()


def test_expand_blocks_matches_selection_format():
    blocks = torch.tensor([[1, 3, -1], [0, 2, 5]])
    pos = torch.tensor([14, 22])
    seq = torch.tensor([15, 22])
    out = expand_blocks(blocks, pos, seq)
    assert out.dtype == torch.int32
    # row 0: blocks 1, 3 -> 4..7, 12..15 (15 >= seq_len 15 -> -1); tail (15 // 4) * 4 = 12..14.
    assert out[0].tolist() == [4, 5, 6, 7, 12, 13, 14, -1, 12, 13, 14, -1, -1, -1, -1]
    # row 1: tail 20..22 but 22 >= seq_len 22.
    assert out[1].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 20, 21, -1, -1, 20, 21, -1]


def test_selection_stats_counts_unions_and_sets():
    case = make_attention_case(rows=16, num_reqs=2, width=24, messy=True, padding_rows=2, seed=4)
    kw = case.plan_inputs()
    st = selection_stats(kw["indices"], kw["block_table"], kw["token_to_req"], kw["positions"], kw["seq_lens"],
                         block_size=kw["block_size"], num_blocks=kw["num_blocks"])
    from qsa.attention.reference import kept_tokens as _kept_tokens

    idx, t2r, pos = case.indices.tolist(), case.token_to_req.tolist(), case.positions.tolist()
    lens, table = case.seq_lens.tolist(), case.block_table.tolist()
    sets = [_kept_tokens(idx[r], t2r[r], pos[r], lens, table, kw["block_size"], kw["num_blocks"])
            for r in range(16)]
    assert st["set_sizes"].tolist() == [len(s) for s in sets]
    bs = kw["block_size"]
    unions = []
    for g in range(2):
        mbs = {table[t2r[r]][t // bs] * (bs // 4) + (t % bs) // 4 for r in range(8 * g, 8 * g + 8) for t in sets[r]}
        unions.append(len(mbs))
    assert st["union_total"] == sum(unions)
    assert st["avg_union_per_group"] == pytest.approx(sum(unions) / 2)


def test_block_sets_excludes_tail():
    tokens = torch.tensor([[0, 1, 2, 3, 12, 13, 17]])
    keep = torch.ones_like(tokens, dtype=torch.bool)
    b = block_sets(tokens, keep, torch.tensor([4]))
    big = torch.iinfo(torch.int64).max
    assert b[0].tolist() == [0, 3] + [big] * 5


# ------------------------------------------------------------------------------------------------
# references and baselines


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [(2, 1), (4, 2)])
def test_fp32_reference_and_naive_match_fp64_reference(kv_cache_dtype, heads):
    case = make_attention_case(rows=13, num_q_heads=heads[0], num_kv_heads=heads[1],
                               kv_cache_dtype=kv_cache_dtype, seed=3)
    c = case.cache
    args = (case.q, c.k, c.v, case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens)
    kw = dict(kv_cache_dtype=c.kv_cache_dtype, k_scale=c.k_scale, v_scale=c.v_scale)
    ref, _ = reference_attention(*args, **kw)
    fp32 = reference_attention_fp32(*args, **kw)
    naive = naive_attention(*args, **kw)
    assert fp32.dtype == torch.float32 and naive.dtype == case.q.dtype
    assert (fp32.double() - ref).abs().max() < 1e-5
    assert torch.isfinite(naive).all()
    assert (naive.double() - ref).abs().max() < 4e-3
    # chunking changes nothing but BLAS rounding
    from benchmarks.baselines import chunked_attention

    one = chunked_attention(*args, compute_dtype=torch.float32, chunk_rows=1, **kw)
    assert (one - fp32).abs().max() < 1e-6


@pytest.mark.parametrize("layout", ["interleaved", "separate"])
def test_row_gather_equals_advanced_indexing(layout):
    from benchmarks.baselines import _gather
    from qsa.cache.paged import allocate_kv_cache

    c = allocate_kv_cache(7, 8, 2, 16, layout=layout)
    g = torch.Generator().manual_seed(0)
    c.k.copy_(torch.randn(c.k.shape, generator=g))
    c.v.copy_(torch.randn(c.v.shape, generator=g))
    blk = torch.randint(0, 7, (3, 5), generator=g)
    off = torch.randint(0, 8, (3, 5), generator=g)
    for t in (c.k, c.v, c.k[:, :, :1]):  # the last cannot be viewed flat: advanced indexing
        assert torch.equal(_gather(t, blk, off, False, 1.0, torch.float16), t[blk, off])


def test_exact_selection_matches_loop_reference():
    from qsa.selection.reference import select_tokens_reference

    from benchmarks.generators import selection_workload

    scn = registry.BY_NAME["tiny-selection"]
    sw = selection_workload(scn, "cpu")
    exact, scores_of = exact_selection(*sw.args, k=scn.topk)
    ref = select_tokens_reference(*sw.args, k=scn.topk)
    assert torch.equal(exact, ref.to(exact.dtype))
    chk = selection_check(exact, exact, scores_of, sw.token_to_req, k=scn.topk)
    assert chk == dict(exact=True, rows_differ=0, tie_equivalent=True)
    # A selection that swaps a chosen block for a worse one is neither exact nor tie-equivalent.
    bad = exact.clone()
    bad[-1, 0:4] = torch.tensor([0, 1, 2, 3], dtype=bad.dtype) if int(bad[-1, 0]) != 0 else bad[-1, 0:4] + 4
    chk = selection_check(bad, exact, scores_of, sw.token_to_req, k=scn.topk)
    assert not chk["exact"] and chk["rows_differ"] == 1 and not chk["tie_equivalent"]


def test_selection_check_up_to_ties_only():
    """With every block scoring the same, any other choice of whole, distinct blocks with the exact tail
    is tie-equivalent; a wrong token inside a block, a repeated block, a missing block or another tail
    is not. Rows of different requests are scored with their own request's keys."""
    k = 3

    def row(blocks, tail):
        toks = [4 * b + i if b >= 0 else -1 for b in blocks for i in range(4)]
        return toks + list(tail)

    exact = torch.tensor([row([0, 2, 5], [40, 41, 42]), row([1, 3, 4], [60, 61, 62])], dtype=torch.int32)
    token_to_req = torch.tensor([0, 1], dtype=torch.int32)
    seen = []

    def scores_of(sel):
        assert torch.unique(token_to_req[sel]).numel() == 1, "rows of two requests scored together"
        seen.append(sel.tolist())
        return torch.zeros((sel.numel(), 20), dtype=torch.float64)

    def check(rows):
        return selection_check(torch.tensor(rows, dtype=torch.int32), exact, scores_of, token_to_req, k=k)

    tie = check([row([1, 2, 5], [40, 41, 42]), row([0, 3, 4], [60, 61, 62])])
    assert tie == dict(exact=False, rows_differ=2, tie_equivalent=True) and sorted(seen) == [[0], [1]]
    inside = row([0, 2, 5], [40, 41, 42])
    inside[1] = 9
    for name, rows in (("token inside a block", [inside, exact[1].tolist()]),
                       ("repeated block", [row([2, 2, 5], [40, 41, 42]), exact[1].tolist()]),
                       ("missing block", [row([0, 2, -1], [40, 41, 42]), exact[1].tolist()]),
                       ("another tail", [exact[0].tolist(), row([1, 3, 4], [40, 40, 40])])):
        chk = check(rows)
        assert chk["rows_differ"] == 1 and not chk["tie_equivalent"], name


# ------------------------------------------------------------------------------------------------
# the correctness gate


def test_gate_bounds_and_rejection():
    ref = torch.randn(32, 2, 16)
    good = ref.half()
    yard = run.output_errors((ref + 1e-3 * torch.randn_like(ref)).half(), ref)
    bounds = run.gate_bounds(ref, torch.float16, yard)
    assert bounds["yardstick"] == "naive"
    assert run.gate(run.output_errors(good, ref), bounds)
    zeros = torch.zeros_like(good)
    assert not run.gate(run.output_errors(zeros, ref), bounds)
    nan = good.clone()
    nan[3, 1, 2] = float("nan")
    e = run.output_errors(nan, ref)
    assert not e["finite"] and not run.gate(e, bounds)
    fixed = run.gate_bounds(ref, torch.float16, None)
    assert fixed["yardstick"] == "fixed"
    assert run.gate(run.output_errors(good, ref), fixed)


def _tiny_suite():
    return run.Suite("cpu")


def test_gate_rejects_a_wrong_route_and_reports_no_time():
    suite = _tiny_suite()

    def dropped_token_route(route, scn, w, state):
        # splitk, but each row loses its last selected token: a subtle, plausible bug.
        idx = w.indices.clone()
        last = (idx >= 0).sum(1) - 1
        idx[torch.arange(idx.shape[0]), last] = -1
        return suite._kernel_route("splitk", scn, dataclasses.replace(w, indices=idx), state)

    def zeros_route(route, scn, w, state):
        out = torch.empty_like(w.q)
        return (lambda: out.zero_()), out, True

    suite.route_builders["dropped"] = dropped_token_route
    suite.route_builders["zeros"] = zeros_route
    scn = dataclasses.replace(registry.BY_NAME["tiny-prefill"], rows=9, routes=("splitk", "dropped", "zeros", "naive"))
    meta = suite.run(scn)
    assert meta["error"] is None, meta["error"]
    recs = {r["route"]: r for r in suite.records if r["scenario"] == scn.name}
    assert recs["splitk"]["passed"] and recs["splitk"]["median_ms"] is not None
    for wrong in ("dropped", "zeros"):
        assert recs[wrong]["passed"] is False, recs[wrong]
        assert recs[wrong]["median_ms"] is None and recs[wrong]["tflops"] is None
        assert "correctness gate failed" in recs[wrong]["error"]
    assert recs["naive"]["passed"]


def _offset(out):
    return out.add_(0.02 * (torch.arange(out.numel()).view_as(out) % 3 - 1).to(out.dtype))


def test_a_failed_yardstick_sets_no_bounds(monkeypatch):
    """A naive result that fails its own (fixed) gate is not the yardstick: a route as wrong as it fails too."""
    import benchmarks.baselines as bl

    real = bl.naive_attention
    monkeypatch.setattr(bl, "naive_attention", lambda *a, **kw: _offset(real(*a, **kw)))
    suite = _tiny_suite()

    def offset_route(route, scn, w, state):
        fn, out, graph = suite._kernel_route("splitk", scn, w, state)
        return (lambda: (fn(), _offset(out))), out, graph

    suite.route_builders["offset"] = offset_route
    scn = dataclasses.replace(registry.BY_NAME["tiny-prefill"], rows=9, routes=("splitk", "offset", "naive"))
    suite.run(scn)
    recs = {r["route"]: r for r in suite.records if r["scenario"] == scn.name}
    assert recs["naive"]["passed"] is False and recs["offset"]["passed"] is False, recs["offset"]
    assert recs["offset"]["median_ms"] is None
    assert recs["splitk"]["passed"] and recs["splitk"]["median_ms"] is not None


def test_a_replay_that_differs_from_the_checked_output_is_not_counted():
    suite = _tiny_suite()

    def right_once(route, scn, w, state):
        fn, out, graph = suite._kernel_route("splitk", scn, w, state)
        calls = []

        def step():
            fn() if not calls else out.zero_()
            calls.append(1)
        return step, out, graph

    suite.route_builders["right-once"] = right_once
    scn = dataclasses.replace(registry.BY_NAME["tiny-prefill"], rows=9, routes=("right-once", "naive"))
    suite.run(scn)
    rec = next(r for r in suite.records if r["scenario"] == scn.name and r["route"] == "right-once")
    assert rec["replay_equal"] is False and rec["passed"] is False and rec["median_ms"] is None, rec
    assert "differs from the checked output" in rec["error"]


class _OrderTimer:
    """A stand-in GPU timer: the calls it was asked to time, in order; each timed call runs ``fn``."""
    is_cuda = True

    def __init__(self):
        self.order = []

    def eager_samples(self, fn, reps):
        self.order.append(("eager", fn.route, reps))
        for _ in range(reps):
            fn()
        return [1.0 + 0.1 * len(self.order)] * reps

    def host_samples(self, fn, calls, drain_every=20):
        self.order.append(("host", fn.route, calls))
        for _ in range(calls):
            fn()
        return [10.0] * calls


def _queued(suite, route, rec, writes):
    """A queued record of ``route`` whose three calls write ``writes[name]()`` into its output."""
    out, checked = torch.zeros(4), torch.ones(4)

    def call(name):
        def f():
            out.copy_(writes.get(name, lambda: checked)())
        f.route = route
        return f

    return suite.queued_costs(rec, call("fn"), out, checked, None, call("plan_run"), call("run_only"))


def test_eager_costs_interleave_the_routes_and_check_every_call():
    """The eager and host-cost calls of a scenario's routes are timed in rounds that interleave the routes
    (the first route rotates), each route's share of the calls per round; the fields are the medians of all
    rounds. A route whose timed calls write other bits than the checked ones, in any of the three kinds of
    call, fails with the kind named; one that raises fails alone and leaves the later rounds."""
    suite = run.Suite("cpu", eager_reps=10, host_calls=20)
    suite.timer = _OrderTimer()
    suite._sync = lambda: None
    recs = {name: dict(route=name, passed=True) for name in ("a", "b", "c", "d", "e")}
    wrong = lambda: torch.full((4,), 2.0)  # noqa: E731

    def boom():
        raise RuntimeError("boom")

    pending = [_queued(suite, "a", recs["a"], {}), _queued(suite, "b", recs["b"], {}),
               _queued(suite, "c", recs["c"], {"run_only": wrong}),
               _queued(suite, "d", recs["d"], {"plan_run": boom}), _queued(suite, "e", recs["e"], {"fn": wrong})]
    suite._eager_costs(pending)
    order = suite.timer.order
    firsts = [route for kind, route, n in order if kind == "eager"]
    assert firsts[:5] == ["a", "b", "c", "d", "e"] and firsts[5:9] == ["b", "c", "e", "a"], firsts
    assert all(n == (2 if kind == "eager" else 4) for kind, _, n in order)
    assert sum(1 for kind, route, _ in order if route == "a" and kind == "eager") == run.Suite.EAGER_ROUNDS
    a = recs["a"]
    assert a["passed"] and a["eager_equal"] and a["eager_reps"] == 10 and a["host_calls"] == 20, a
    assert a["eager_rounds"] == run.Suite.EAGER_ROUNDS and a["host_us"] == 10.0 and a["host_run_us"] == 10.0
    eager_a = [1.0 + 0.1 * (i + 1) for i, (kind, route, _) in enumerate(order) if kind == "eager" and route == "a"]
    assert a["eager_ms"] == pytest.approx(sorted(eager_a)[2]) and a["eager_min_ms"] == pytest.approx(min(eager_a))
    assert recs["b"]["passed"] and recs["b"]["eager_ms"] > a["eager_ms"]
    for name, call in (("c", "run_attention"), ("e", "eager")):
        r = recs[name]
        assert r["passed"] is False and r["eager_equal"] is False and r.get("eager_ms") is None, r
        assert f"the output of the {call} calls" in r["error"], r["error"]
    d = recs["d"]
    assert d["passed"] is False and "boom" in d["error"] and d.get("host_us") is None
    assert sum(1 for _, route, _ in order if route == "d") == 2  # its first round's eager call, then the raise


def test_failing_scenario_is_recorded_and_run_goes_on():
    suite = _tiny_suite()
    broken = dataclasses.replace(registry.BY_NAME["tiny-decode"], name="broken", rows=4, num_reqs=3)
    meta = suite.run(broken)
    assert meta["error"] and "multiple of num_reqs" in meta["error"]
    ok = suite.run(dataclasses.replace(registry.BY_NAME["tiny-decode"], routes=("naive",)))
    assert ok["error"] is None


# ------------------------------------------------------------------------------------------------
# targets


def _rec(scenario, route, ms, passed=True, **kw):
    return dict(scenario=scenario, route=route, kind="route", median_ms=ms, passed=passed, **kw)


def _meta(name, requested, measured):
    return dict(name=name, overlap_requested=requested, overlap=measured)


def test_target_evaluation_with_synthetic_numbers():
    records = [
        _rec("prefill-64k-o80", "naive", 40.0), _rec("prefill-64k-o80", "splitk", 3.0),
        _rec("prefill-64k-o80", "grouped", 1.2), _rec("prefill-64k-o80", "planner", 0.1),
        _rec("prefill-64k-o98", "splitk", 3.0), _rec("prefill-64k-o98", "grouped", 0.5, tflops=160.0),
        _rec("prefill-128k-o80", "splitk", 3.0), _rec("prefill-128k-o80", "grouped", 0.9),
        _rec("decode-64", "xqa", 0.05, gbps=3600.0), _rec("decode-256", "xqa", 0.2, gbps=3000.0),
        _rec("mtp-8", "splitk", 0.03), _rec("mtp-8", "xqa", 0.025), _rec("mtp-8", "grouped", 0.018),
        _rec("mtp-16", "splitk", 0.03), _rec("mtp-16", "grouped", 0.04, passed=False),
        _rec("mtp-16", "xqa", 0.025),
        _rec("selection-8192x16384", "select", 1.0, exact=True),
        _rec("selection-8192x16384", "torch-select", 6.0),
    ]
    scenarios = {"prefill-64k-o80": _meta("prefill-64k-o80", 0.8, 0.80),
                 "prefill-64k-o98": _meta("prefill-64k-o98", 0.98, 0.975),
                 "prefill-128k-o80": _meta("prefill-128k-o80", 0.8, 0.86)}
    t = {x["name"]: x for x in report.evaluate_targets(records, scenarios, {"copy_gbps": 4250.0})}
    assert set(t) == {name for name, *_ in report.TARGETS}
    assert t["splitk-vs-naive-prefill-64k"]["value"] == pytest.approx(40 / 3) and t["splitk-vs-naive-prefill-64k"]["met"]
    assert t["prefill-64k-o98-grouped-vs-splitk"]["value"] == pytest.approx(6.0)
    assert t["prefill-64k-o98-grouped-vs-splitk"]["met"]
    assert t["prefill-64k-o80-grouped-vs-splitk"]["value"] == pytest.approx(2.5)
    assert t["prefill-64k-o80-grouped-vs-splitk"]["met"] is False
    # 128k: fast enough, but its measured overlap 0.86 is outside [0.75, 0.85]: not met.
    assert t["prefill-128k-o80-grouped-vs-splitk"]["value"] > 3
    assert t["prefill-128k-o80-grouped-vs-splitk"]["met"] is False
    assert "overlap" in t["prefill-128k-o80-grouped-vs-splitk"]["note"]
    assert t["prefill-64k-o98-grouped-tflops"]["met"]
    assert t["prefill-64k-planner-share"]["value"] == pytest.approx(0.1 / 1.2)
    assert t["prefill-64k-planner-share"]["met"]
    assert t["decode-64-xqa-bandwidth"]["value"] == pytest.approx(3600 / 4250)
    assert t["decode-64-xqa-bandwidth"]["met"]
    assert t["decode-256-xqa-bandwidth"]["met"] is False
    assert t["mtp-8-best-vs-splitk"]["value"] == pytest.approx(0.03 / 0.018)
    assert t["mtp-8-best-vs-splitk"]["met"]
    # a route that failed its check is never the best
    assert t["mtp-16-best-vs-splitk"]["value"] == pytest.approx(0.03 / 0.025)
    assert t["mtp-16-best-vs-splitk"]["met"] is False
    assert t["selection-8192x16384-vs-torch"]["value"] == pytest.approx(6.0)
    assert t["selection-8192x16384-vs-torch"]["met"]
    # not exact -> not met, whatever the speed
    records[-2]["exact"] = False
    t2 = {x["name"]: x for x in report.evaluate_targets(records, scenarios, None)}
    assert t2["selection-8192x16384-vs-torch"]["met"] is False
    assert t2["decode-64-xqa-bandwidth"]["met"] is None  # no ceilings measured


def _host(scenario, route, ms, eager_ms=None, host_us=None, host_run_us=None, passed=True):
    return _rec(scenario, route, ms, passed=passed, eager_ms=eager_ms, host_us=host_us, host_run_us=host_run_us)


def test_host_cost_targets_take_the_worst_case():
    """The host-cost targets are the worst case over the records of the host-cost steps (auto and forced
    routes alike; scenarios outside the set and records that failed are not counted, the latter named in
    the note); auto-vs-best-route over every scenario with an auto record, the worse of the graph and the
    eager ratio, against grouped/xqa/splitk only."""
    records = [
        _host("decode-1", "xqa", 0.040, eager_ms=0.050, host_us=20.0, host_run_us=8.0),
        _host("decode-1", "splitk", 0.060, eager_ms=0.070, host_us=18.0, host_run_us=7.0),
        _host("decode-1", "invariant", 0.010, eager_ms=0.012, host_us=9.0, host_run_us=4.0),  # no rival of auto
        _host("decode-1", "auto", 0.041, eager_ms=0.052, host_us=22.0, host_run_us=9.0),
        _host("decode-64-fp8", "xqa", 0.050, eager_ms=0.066, host_us=29.5, host_run_us=14.0),
        _host("decode-64-fp8", "auto", 0.050, eager_ms=0.064, host_us=29.0, host_run_us=14.5),
        _host("mtp-8", "grouped", 0.030, eager_ms=0.047, host_us=26.0, host_run_us=12.0),
        _host("mtp-8", "auto", 0.030, eager_ms=0.048, host_us=27.0, host_run_us=12.5),
        # outside the host-cost steps: its host figures do not count, its auto ratio does
        _host("prefill-64k-o98", "grouped", 1.00, eager_ms=1.2, host_us=500.0, host_run_us=90.0),
        _host("prefill-64k-o98", "auto", 1.02, eager_ms=1.22, host_us=510.0, host_run_us=95.0),
        # failed: not counted, named
        _host("decode-256", "splitk", None, eager_ms=9.0, host_us=999.0, host_run_us=999.0, passed=False),
        _rec("decode-1", "naive", 0.5),  # baselines carry no host figures
    ]
    v = report.host_cost_values(records)
    assert v["eager-host-plan-run-us"][:3] == (29.5, "decode-64-fp8", "xqa")
    assert v["eager-host-run-us"][:3] == (14.5, "decode-64-fp8", "auto")
    assert v["eager-over-graph-us"][0] == pytest.approx(18.0) and v["eager-over-graph-us"][1:3] == ("mtp-8", "auto")
    # decode-1: graph 0.041 / 0.040, eager 0.052 / 0.050 (invariant's 0.010 is no rival): the eager 1.04
    assert v["auto-vs-best-route"][0] == pytest.approx(1.04) and v["auto-vs-best-route"][1] == "decode-1"
    for name in report.HOST_TARGETS[:3]:
        assert "decode-256:splitk" in v[name][3], v[name]
    t = {x["name"]: x for x in report.host_cost_targets(records)}
    assert [x["name"] for x in report.host_cost_targets(records)] == list(report.HOST_TARGETS)
    assert all(t[name]["met"] for name in report.HOST_TARGETS), t
    assert t["eager-host-run-us"]["scenario"] == "decode-64-fp8" and t["eager-host-run-us"]["route"] == "auto"
    # the same entries in evaluate_targets
    ev = {x["name"]: x for x in report.evaluate_targets(records, {}, None)}
    assert all(ev[name] == t[name] for name in report.HOST_TARGETS)

    # known wrong: auto 10% slower than the best forced route (graph), and a host time past its goal
    records[9]["median_ms"] = 1.10
    records[4]["host_us"] = 31.0
    t = {x["name"]: x for x in report.host_cost_targets(records)}
    assert t["auto-vs-best-route"]["value"] == pytest.approx(1.10) and t["auto-vs-best-route"]["met"] is False
    assert t["auto-vs-best-route"]["scenario"] == "prefill-64k-o98"
    assert t["eager-host-plan-run-us"]["value"] == 31.0 and t["eager-host-plan-run-us"]["met"] is False
    # an eager time 10% worse than the best forced route's, with graph times equal, fails as well
    records[9].update(median_ms=1.00, eager_ms=1.32)
    t = {x["name"]: x for x in report.host_cost_targets(records)}
    assert t["auto-vs-best-route"]["value"] == pytest.approx(1.10) and t["auto-vs-best-route"]["met"] is False
    # an auto that failed its check gives no ratio and is named
    records[9]["passed"] = False
    t = {x["name"]: x for x in report.host_cost_targets(records)}
    assert t["auto-vs-best-route"]["value"] == pytest.approx(1.04) and "prefill-64k-o98:auto" in t["auto-vs-best-route"]["note"]
    # nothing measured (a CPU-like run, no host figures): not measured, with why
    t = report.host_cost_targets([_rec("decode-1", "xqa", 0.04)])
    assert all(x["value"] is None and x["met"] is None and x["note"] for x in t)


def test_auto_route_label():
    """The tables show which route auto took."""
    auto = dict(route="auto", plan_route="grouped", grouped_rows=184, direct=True)
    assert report.route_label(auto, 185) == "auto (grouped 184 + xqa 1 direct)"
    assert report.route_label(dict(auto, grouped_rows=8192), 8192) == "auto (grouped)"
    assert report.route_label(dict(auto, plan_route="xqa", grouped_rows=0), 64) == "auto (xqa direct)"
    assert report.route_label(dict(auto, plan_route="splitk", grouped_rows=0, direct=False), 64) == "auto (splitk)"
    assert report.route_label(dict(route="xqa", plan_route="xqa"), 64) == "xqa"


def test_targets_not_measured_are_null():
    t = report.evaluate_targets([], {}, None)
    assert all(x["value"] is None and x["met"] is None and x["note"] for x in t)
    # a bandwidth that is not finite (a zero copy rate measured) is not measured either
    rec = _rec("decode-64", "xqa", 0.05, gbps=float("inf"))
    (bw,) = [x for x in report.evaluate_targets([rec], {}, {"copy_gbps": 4000.0})
             if x["name"] == "decode-64-xqa-bandwidth"]
    assert bw["value"] is None and bw["met"] is None and "finite" in bw["note"]


# ------------------------------------------------------------------------------------------------
# end to end


def test_registry_names_and_selection():
    names = [s.name for s in registry.SCENARIOS]
    for required in ("prefill-64k-o80", "prefill-64k-o98", "prefill-128k-o80", "prefill-8k-o80", "mtp-5",
                     "mtp-8", "mtp-16", "decode-1", "decode-16", "decode-64", "decode-256",
                     "selection-8192x16384", "prefill-64k-o80-12x1", "prefill-64k-o80-24x2",
                     "prefill-64k-o80-fp8", "prefill-64k-o80-bf16"):
        assert required in names
    quick = [s.name for s in registry.select(None, quick=True)]
    assert quick == ["prefill-64k-o80", "prefill-64k-o98", "decode-64", "mtp-8", "selection-8192x16384"]
    assert not any(s.test_only for s in registry.select(None))
    assert [s.name for s in registry.select(["tiny-*"])] == ["tiny-prefill", "tiny-decode", "tiny-selection"]
    for name, scn, *_ in report.TARGETS:
        assert scn in names or name in report.HOST_TARGETS, (name, scn)
    # every pattern of the host-cost goal's steps names at least one scenario
    import fnmatch

    for pattern in report.HOST_COST_STEPS:
        assert any(fnmatch.fnmatchcase(n, pattern) for n in names), pattern


@pytest.mark.lab
def test_end_to_end_tiny_run(tmp_path, capsys):
    out, docs = tmp_path / "results", tmp_path / "docs"
    out.mkdir()
    (out / "latest.json").write_text("{}")  # the last run's: replaced
    (out / "2026-01-01-0000-cpu.json").write_text("{}")  # an old dated copy: neither read nor linked
    rc = run.main(["--scenario", "tiny-*", "--out", str(out), "--docs", str(docs)])
    assert rc == 0
    latest = json.loads((out / "latest.json").read_text())
    # latest.json and nothing else is written: no dated copy beside it
    assert sorted(p.name for p in out.iterdir()) == ["2026-01-01-0000-cpu.json", "latest.json"]
    assert (out / "2026-01-01-0000-cpu.json").read_text() == "{}"
    for key in ("schema", "device", "date", "complete", "ceilings", "scenarios", "records", "targets", "versions"):
        assert key in latest
    assert latest["complete"] and latest["device"] == "cpu"
    assert latest["ceilings"]["copy_gbps"] > 0 and latest["ceilings"]["matmul_tflops"] > 0
    assert [s["name"] for s in latest["scenarios"]] == ["tiny-prefill", "tiny-decode", "tiny-selection"]
    assert all(s["error"] is None for s in latest["scenarios"]), [s["error"] for s in latest["scenarios"]]
    prefill = latest["scenarios"][0]
    assert 0.6 < prefill["overlap"] <= 1.0 and prefill["avg_union_per_group"] > 0 and prefill["sharing"] > 1
    fields = {"scenario", "route", "kind", "passed", "median_ms", "tflops", "gbps", "vs_splitk", "max_abs_err",
              "rel_l2_err", "error"}
    recs = latest["records"]
    assert all(fields <= set(r) for r in recs)
    by = {(r["scenario"], r["route"]): r for r in recs}
    for route in ("grouped", "xqa", "splitk", "naive"):
        r = by[("tiny-prefill", route)]
        assert r["passed"] and r["median_ms"] > 0 and r["max_abs_err"] < r["bound_abs"], r
        assert r["tflops"] > 0 and r["gbps"] > 0
    assert by[("tiny-prefill", "splitk")]["vs_splitk"] == pytest.approx(1.0)
    assert by[("tiny-prefill", "grouped")]["replay_equal"]
    assert by[("tiny-prefill", "planner")]["median_ms"] > 0
    assert by[("tiny-prefill", "floor-bytes-grouped")]["bytes"] < by[("tiny-prefill", "floor-bytes-row")]["bytes"]
    for route in ("xqa", "splitk", "invariant", "naive"):
        assert by[("tiny-decode", route)]["passed"]
    # auto on every attention scenario, checked and timed like the forced routes, with the route it took
    for scn, routes in (("tiny-prefill", ("grouped", "xqa", "splitk", "auto")),
                        ("tiny-decode", ("xqa", "splitk", "invariant", "auto"))):
        for route in routes:
            r = by[(scn, route)]
            assert r["passed"] and r["kind"] == "route" and r["eager_equal"], r
            for key in ("median_ms", "eager_ms", "host_us", "host_run_us"):
                assert isinstance(r[key], float) and r[key] > 0, (scn, route, key, r[key])
        auto = by[(scn, "auto")]
        assert auto["plan_route"] == "xqa" and auto["grouped_rows"] == 0 and auto["direct"], auto  # below 64 rows
        assert auto["max_abs_err"] < auto["bound_abs"] and auto["vs_splitk"] > 0
    for key in ("eager_ms", "host_us", "host_run_us"):
        assert by[("tiny-prefill", "naive")][key] is None and by[("tiny-prefill", "planner")][key] is None
    assert ("tiny-selection", "auto") not in by
    assert by[("tiny-selection", "select")]["exact"] and by[("tiny-selection", "select")]["median_ms"] > 0
    assert by[("tiny-selection", "torch-select")]["passed"]
    assert by[("tiny-selection", "select")]["vs_torch"] > 0
    names = {t["name"] for t in latest["targets"]}
    assert names == {name for name, *_ in report.TARGETS} and set(report.HOST_TARGETS) <= names
    assert all(set(t) >= {"name", "value", "goal", "met"} for t in latest["targets"])
    md = (docs / "benchmarks.md").read_text()
    assert "| tiny-prefill | grouped |" in md and "## Targets" in md and latest["date"] in md
    assert "| eager ms | host us | host run us |" in md and "| tiny-decode | auto (xqa direct) |" in md
    assert "2026-01-01" not in md and "History" not in md
    text = capsys.readouterr().out
    assert "tiny-selection" in text and "target" in text
    assert not any(isinstance(v, float) and (math.isnan(v) or math.isinf(v))
                   for r in recs for v in r.values())


def test_cpu_run_takes_the_tiny_scenarios_and_keeps_the_gpu_results(tmp_path, monkeypatch):
    """On the CPU without --scenario only the tiny scenarios run, and without --out the results go to a
    new temporary directory, not over the repository's GPU results."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = (run.ROOT / "benchmarks" / "results" / "latest.json").read_bytes()
    assert run.main(["--route", "naive", "--device", "cpu", "--no-docs"]) == 0
    (latest,) = tmp_path.glob("qsa-bench-cpu-*/latest.json")
    names = {r["scenario"] for r in json.load(open(latest))["records"]}
    assert names and all(n.startswith("tiny-") for n in names), names
    assert (run.ROOT / "benchmarks" / "results" / "latest.json").read_bytes() == before


def test_bench_exit_status_counts_failures(tmp_path, monkeypatch):
    """A run in which a route fails its check exits 1 (its records stay in the JSON); floors never fail, and
    scenarios left out by --max-minutes are not failures; a --device that is no device is a usage error."""
    monkeypatch.setattr(run, "gate", lambda errors, bounds: False)
    assert run.main(["--scenario", "tiny-decode", "--route", "xqa", "--out", str(tmp_path), "--no-docs"]) == 1
    recs = json.loads((tmp_path / "latest.json").read_text())["records"]
    assert any(r["route"] == "xqa" and not r["passed"] for r in recs)
    report = {"records": [{"scenario": "a", "route": "floor-flops", "kind": "floor", "passed": None, "error": None},
                          {"scenario": "a", "route": "xqa", "kind": "route", "passed": True, "error": None}],
              "scenarios": [{"name": "b", "error": "skipped: --max-minutes reached"}]}
    assert run.failures(report) == []
    report["records"].append({"scenario": "a", "route": "splitk", "kind": "route", "passed": True, "error": "boom"})
    report["scenarios"].append({"name": "c", "error": "CUDA error"})
    assert run.failures(report) == ["a:splitk", "c (CUDA error)"]
    with pytest.raises(SystemExit) as e:
        run.main(["--device", "foo", "--no-docs"])
    assert e.value.code == 2


def test_qsa_bench_runs_the_kernels_on_a_cpu_without_the_interpreter_flag(tmp_path):
    """`qsa bench` imports qsa before benchmarks.run can switch the interpreter on: on a CPU it reruns
    itself under the interpreter, so the Triton routes run and pass (not ERROR with exit status 0)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "qsa.cli", "bench", "--scenario", "tiny-decode", "--route", "xqa",
                           "--device", "cpu", "--out", str(tmp_path), "--no-docs"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = json.loads((tmp_path / "latest.json").read_text())["records"]
    xqa = [r for r in recs if r["route"] == "xqa"]
    assert xqa and all(r["passed"] and r["error"] is None for r in xqa), xqa


def _tune_smoke(tmp_path, monkeypatch, *only):
    """benchmarks.tune's smoke run (of the workloads named in ``only``, or all): its records, each checked
    (planner settings against the default plan, kernels against the fp32 reference) and timed."""
    from benchmarks import tune

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tune.main(["--smoke", *(a for o in only for a in ("--only", o)), "--out", str(tmp_path)]) == 0
    records = json.load(open(tmp_path / "tune.json"))["records"]
    assert records and all(r["error"] is None and r["median_ms"] > 0 for r in records), records
    return records


def _check_single_row_records(records):
    whats = {r["what"] for r in records}
    assert {"plan-single", "xqa-attn", "splitk-attn", "direct-attn", "direct-total", "direct-splits",
            "direct-merge"} <= whats
    merges = {tuple(r["setting"]) for r in records if r["what"] == "direct-merge"}
    assert merges == {(16, 4), (8, 2)}
    row_planners = {tuple(r["setting"]) for r in records if r["what"] == "plan-single" and r["setting"] != "-"}
    assert row_planners == {(None, None, None), (16, 4, True)}
    direct = [r["setting"] for r in records if r["what"] == "direct-attn"]
    assert {len(s) >= 6 and s[5] for s in direct} == {False, True}  # entries resolved before the loop or not
    assert any(len(s) >= 8 and s[7] for s in direct)  # the deferred row check
    # the score halves (on a smoke head of 16 columns the launch takes the whole head: a half is too narrow)
    assert any(len(s) == 9 and s[8] for s in direct)


@pytest.mark.lab
def test_tune_smoke_checks_and_times_the_decode_settings(tmp_path, monkeypatch):
    """benchmarks.tune under the interpreter on its decode workload: every single-row planner and kernel
    setting (xqa planned and direct, its splits and merges, splitk) checked and timed."""
    records = _tune_smoke(tmp_path, monkeypatch, "decode")
    assert {r["workload"] for r in records} == {"smoke-decode"}
    _check_single_row_records(records)


@pytest.mark.lab
def test_tune_smoke_checks_and_times_every_setting(tmp_path, monkeypatch):
    """benchmarks.tune under the interpreter: every planner and kernel setting is checked (planner
    settings against the default plan, kernels against the fp32 reference) and timed."""
    records = _tune_smoke(tmp_path, monkeypatch)
    _check_single_row_records(records)
    whats = {r["what"] for r in records}
    assert {"plan-grouped", "grouped-attn"} <= whats
    summaries = {r["setting"][4] for r in records if r["what"] == "plan-grouped" and r["setting"] != "-"}
    assert summaries == {True, False}  # the scan of flagged sectors and of every word
    assert any(len(r["setting"]) >= 8 and r["setting"][7] for r in records if r["what"] == "plan-grouped")  # the map


@pytest.mark.lab
def test_tune_splitk_only(tmp_path, monkeypatch):
    """``--splitk-only`` times splitk's settings and nothing else, each checked first."""
    from benchmarks import tune

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tune.main(["--smoke", "--splitk-only", "--only", "decode", "--out", str(tmp_path)]) == 0
    records = json.load(open(tmp_path / "tune.json"))["records"]
    assert {r["what"] for r in records} == {"splitk-attn"}
    assert all(r["error"] is None and r["median_ms"] > 0 for r in records), records
    assert {tuple(r["setting"]) for r in records} == {tune.SPLITK[0], tune.SPLITK[2]}


@pytest.mark.lab
def test_tune_checks_each_setting_on_its_own_output(tmp_path, monkeypatch):
    """A setting that writes nothing fails its check, although the setting before it left a right output
    in the shared buffer (each check runs on a NaN-filled buffer)."""
    from benchmarks import tune

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real, calls = tune.qsa.attention.splitk.launch.splitk_attention, []

    def first_setting_only(*a, config, **kw):
        calls.append(config)
        if config == calls[0]:
            real(*a, config=config, **kw)
    monkeypatch.setattr(tune.qsa.attention.splitk.launch, "splitk_attention", first_setting_only)
    assert tune.main(["--smoke", "--splitk-only", "--only", "decode", "--out", str(tmp_path)]) == 0
    records = json.load(open(tmp_path / "tune.json"))["records"]
    assert [r["error"] is None for r in records] == [True, False], records
    assert records[1]["median_ms"] is None


@pytest.mark.lab
def test_ncu_probe_runs_a_scenario(capsys):
    """The profiler driver plans and runs a scenario end to end (tiny shape, interpreter) and refuses a
    selection scenario."""
    from benchmarks import ncu_probe

    assert ncu_probe.main(["tiny-prefill", "--device", "cpu", "--calls", "1"]) == 0
    assert "finite True" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ncu_probe.main(["tiny-selection", "--device", "cpu"])


@pytest.mark.lab
def test_floors_probe_sums_exactly_the_entries_xqa_reads(device):
    """benchmarks.floors: each gather-probe variant (precomputed offsets, block table, contiguous copy)
    sums exactly the K/V head rows the xqa route reads, per program, at several split counts, for an
    fp16 and an FP8 cache; probes whose offsets are wrong (one entry moved to the next head row, or to
    the NaN block 0) are rejected."""
    from benchmarks import floors
    from benchmarks.generators import attention_workload

    by_name = {s.name: s for s in registry.SCENARIOS}
    for name in ("tiny-prefill", "tiny-decode"):
        scn = by_name[name]
        probe = floors.Probe(attention_workload(scn, torch.device(device)), scn)
        assert probe.kept.any()
        for variant in ("flat", "table", "contiguous"):
            for splits in (1, 2, 3):
                assert probe.checked(variant, splits, 16, 4, 2)[1], (name, variant, splits)
    good = probe.flat.clone()
    i, j = (good >= 0).nonzero()[0].tolist()
    for wrong in (good[i, j] + 1, 0):
        probe.flat = good.clone()
        probe.flat[i, j] = wrong
        assert not probe.checked("flat", 2, 16, 4, 2)[1], wrong
        assert probe.checked("table", 2, 16, 4, 2)[1]


def _group_union_sums(w, k, v, group_rows: int) -> torch.Tensor:
    """``[groups, Hkv]`` fp64: K + V (caches of ``w``'s geometry) summed over the union of the tokens each
    group's rows keep, from the reference keep rule (``kept_tokens``), not from a plan."""
    from benchmarks.generators import kept_tokens

    c = w.cache
    tokens, phys, keep = kept_tokens(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                                     block_size=c.block_size, num_blocks=c.num_blocks)
    if c.kv_cache_dtype == "fp8_e4m3":  # the E4M3 values of the cache's bytes
        k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
    per_tok = k.double().sum(-1) + v.double().sum(-1)
    groups = -(-tokens.shape[0] // group_rows)
    out = torch.zeros(groups, per_tok.shape[-1], dtype=torch.float64)
    for g in range(groups):
        rows = slice(g * group_rows, (g + 1) * group_rows)
        pairs = {(int(b), int(t) % c.block_size) for b, t in zip(phys[rows][keep[rows]], tokens[rows][keep[rows]])}
        for b, slot in pairs:
            out[g] += per_tok[b, slot]
    return out


@pytest.mark.lab
def test_floors_grouped_probe_sums_the_union_of_each_group(device):
    """benchmarks.floors' grouped probe, on its check cache (integers in the slots the plan loads, NaN
    elsewhere): per (group, KV head) it sums exactly the K/V of the tokens that some row of the group
    keeps (the expected sums agree with the reference keep rule, fp16 and FP8 caches) at every setting
    it is timed with. Probes that read a wrong plan entry, leave out a token or read an unkept slot are
    rejected."""
    from benchmarks import floors
    from benchmarks.generators import attention_workload

    base = registry.BY_NAME["tiny-prefill"]
    for scn in (base, dataclasses.replace(base, kv_cache_dtype="fp8_e4m3")):
        w = attention_workload(scn, torch.device(device))
        probe = floors.GroupedProbe(w, scn)
        g = probe.grouped
        assert g.num_groups >= 2 and probe.union_tokens() > 0
        k, v, want = probe.check_cache()
        assert k.dtype == probe.k.dtype and k.shape == probe.k.shape
        assert torch.isnan((k.view(torch.float8_e4m3fn) if probe.kv_fp8 else k).float()).any()
        assert torch.equal(want.cpu(), _group_union_sums(w, k, v, g.group_rows))
        for cfg in floors.grouped_probe_grid(quick=False):
            assert probe.checked(*cfg)[1], (scn.kv_cache_dtype, cfg)
    # Sabotaged plans, after the check cache was made from the right one: an entry moved to the next
    # microblock; a kept token left out; a slot that no row of the group keeps (NaN there) read.
    i = int(torch.nonzero(g.counts > 0)[0])
    masks = [int(x) for x in g.masks[i, :int(g.counts[i])]]
    free = [(e, t) for e, m in enumerate(masks) for t in range(4) if not (m >> t) & 0x11111111]
    assert free, "the tiny plan has no entry with an unkept slot"
    e, t = free[0]
    first = int(g.mb_ids[i, 0])
    for entry, wrong_id, wrong_mask in ((0, first + 1, masks[0]), (0, first, masks[0] & (masks[0] - 1)),
                                        (e, int(g.mb_ids[i, e]), masks[e] | 1 << t)):
        good_id, good_mask = int(g.mb_ids[i, entry]), int(g.masks[i, entry])
        g.mb_ids[i, entry], g.masks[i, entry] = wrong_id, wrong_mask
        assert not probe.checked(64, 8, 4, 3)[1], (entry, wrong_id, wrong_mask)
        g.mb_ids[i, entry], g.masks[i, entry] = good_id, good_mask
    assert probe.checked(64, 8, 4, 3)[1]


@pytest.mark.lab
def test_floors_cli_writes_its_report(tmp_path, capsys):
    """``python -m benchmarks.floors`` on the CPU: routes, launches and probes measured, JSON and
    Markdown written; a selection scenario is refused."""
    from benchmarks import floors

    assert floors.main(["tiny-decode", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["floors-cpu.json", "floors-cpu.md"]  # no date in them
    js = tmp_path / "floors-cpu.json"
    rep = json.load(open(js))
    (rec,) = rep["scenarios"]
    assert rec["scenario"] == "tiny-decode" and rec["kv_bytes"] > 0
    assert {p["variant"] for p in rec["probes"]} == {"flat", "table", "contiguous"}
    assert all(p["ok"] and p["median_ms"] > 0 for p in rec["probes"])
    assert rec["xqa_ms"] > 0 and rec["splitk_ms"] > 0 and rec["launch_2_ms"] > 0
    assert "tiny-decode" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        floors.main(["tiny-selection", "--device", "cpu"])
    assert floors.main(["tiny-prefill", "--quick", "--device", "cpu", "--out", str(tmp_path / "g")]) == 0
    js = tmp_path / "g" / "floors-cpu.json"
    (rec,) = json.load(open(js))["scenarios"]
    assert rec["scenario"] == "tiny-prefill" and rec["target"] == "splitk / 3" and rec["union_bytes"] > 0
    assert {p["variant"] for p in rec["probes"]} == {"products", "small"}
    assert all(p["ok"] and p["median_ms"] > 0 for p in rec["probes"])
    assert min(rec[k] for k in ("grouped_ms", "planner_ms", "attention_ms", "splitk_ms")) > 0
    assert "Grouped step" in capsys.readouterr().out
    assert floors.main(["tiny-decode", "--quick", "--device", "cpu", "--flush", "read", "--out", str(tmp_path)]) == 0
    assert json.load(open(tmp_path / "floors-cpu-read-flush.json"))["flush"] == "read"
    assert json.load(open(tmp_path / "floors-cpu.json"))["flush"] == "write"


def test_timer_flushes():
    """Both L2 flushes run (a memset, or a read of another buffer into a scalar); an unknown one is refused."""
    from benchmarks.timing import FLUSH_BYTES, Timer, TimingConfig

    t = Timer("cpu", TimingConfig(flush="write"))
    t.flush_l2()
    assert t._flush.numel() == FLUSH_BYTES and not t._flush.any()
    t = Timer("cpu", TimingConfig(flush="read"))
    t.flush_l2()
    assert t._flush[0].numel() * 4 == FLUSH_BYTES and float(t._flush[1]) > 0
    with pytest.raises(ValueError, match="flush"):
        Timer("cpu", TimingConfig(flush="none"))


def test_kept_entries_in_row_order_are_the_reference_sets():
    """``generators.kept_entries`` (the entries the floors' probes read, at their positions in the row)
    marks, row by row, exactly the tokens of the reference's keep rule (docs/spec.md section 4) on messy rows:
    -1, tokens past the position, the length and the table, table entries -1 and past the cache, padding
    rows, rows whose position is past their length."""
    from benchmarks.generators import kept_entries
    from qsa.attention.reference import kept_tokens as _kept_tokens

    case = make_attention_case(rows=13, num_reqs=3, num_q_heads=2, num_kv_heads=1, head_dim=16, width=40,
                               max_seq_len=150, padding_rows=2, seed=31)
    # Rows whose position is past their length, holding tokens in between: only t < seq_len drops them.
    for r in range(0, 9, 4):
        n = int(case.seq_lens[case.token_to_req[r]])
        case.positions[r] = n + 8
        case.indices[r, :4] = torch.arange(n, n + 4, dtype=case.indices.dtype)
    kw = case.plan_inputs()
    keep, phys = kept_entries(kw["indices"], kw["block_table"], kw["token_to_req"], kw["positions"], kw["seq_lens"],
                              block_size=kw["block_size"], num_blocks=kw["num_blocks"])
    table = case.block_table.tolist()
    dropped = 0
    for r in range(case.indices.shape[0]):
        row = case.indices[r].tolist()
        req = int(case.token_to_req[r])
        want = _kept_tokens(row, req, int(case.positions[r]), case.seq_lens.tolist(), table, kw["block_size"],
                            kw["num_blocks"])
        got = {t for t, k in zip(row, keep[r].tolist()) if k}
        assert got == set(want), r
        assert all(p == table[req][t // kw["block_size"]] for t, p, k in zip(row, phys[r].tolist(), keep[r].tolist())
                   if k), r
        dropped += sum(1 for t in set(row) if t >= 0 and t not in got)
    assert dropped > 0  # the case does drop valid-looking entries


def test_target_values_that_miss_their_goal_never_print_as_it():
    from benchmarks.report import target_value

    assert target_value(0.7995239, 0.8) == "0.7995"
    assert target_value(0.80402, 0.8) == "0.804"
    assert target_value(1.4121, 1.5) == "1.41"
    assert target_value(2.9999996, 3.0) == "3"  # differs from the goal only past 6 digits
    assert target_value(None, 0.8) == "-"
    assert target_value(0.8, 0.8) == "0.8"


@pytest.mark.lab
def test_ab_alternates_versions_and_compares_bits(tmp_path, monkeypatch):
    """benchmarks.ab under the interpreter: a process per version (two copies of one source), each pair
    checked against the reference and timed, and each process importing the version it was given. Equal
    outputs compare equal; an output one bit apart does not; NaNs of the same bits do."""
    import shutil

    from benchmarks import ab

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    old = tmp_path / "old" / "src"
    shutil.copytree(os.path.join(ab.ROOT, "src"), old, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    assert ab.main(["--old-src", str(old), "--pairs", "tiny-decode:xqa,tiny-decode:splitk", "--alternations", "1",
                    "--rounds", "1", "--out", str(tmp_path / "out")]) == 0
    rep = json.load(open(tmp_path / "out" / "ab.json"))
    assert [r["pair"] for r in rep["rows"]] == ["tiny-decode:xqa", "tiny-decode:splitk"]
    assert [r["bitwise_equal"] for r in rep["rows"]] == [True, True]
    assert [r["tag"] for r in rep["runs"]] == ["old", "new"]
    assert rep["runs"][0]["qsa"] == str(old / "qsa")
    assert rep["runs"][1]["qsa"] == os.path.join(ab.ROOT, "src", "qsa")
    for r in rep["rows"]:
        for tag in ("old", "new"):
            assert r[tag]["median_us"] > 0 and r[tag]["rel_l2_err"] < 1e-2, r
    assert "tiny-decode:xqa" in open(tmp_path / "out" / "ab.md").read()

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    x = torch.randn(3, 2, 4).to(torch.float16)
    x[1, 1, 1] = float("nan")
    torch.save(x, a / "s.r.pt")
    torch.save(x.clone(), b / "s.r.pt")
    assert ab.bitwise_equal(str(a), str(b), [("s", "r")]) == {"s:r": True}
    y = x.clone()
    y.view(torch.int16)[0, 0, 0] ^= 1
    torch.save(y, b / "s.r.pt")
    assert ab.bitwise_equal(str(a), str(b), [("s", "r")]) == {"s:r": False}
    for bad in ("tiny-decode", "tiny-decode:", "nope:xqa", "tiny-selection:select"):
        with pytest.raises(ValueError):
            ab.parse_pairs(bad)


def test_unsorted_routes_plan_without_the_hint():
    """A route name ending in ``-unsorted`` (for ``benchmarks.ab``) plans that route without ``rows_sorted``:
    a decode batch's xqa rows then take the planned kernel, not the direct one; the plain name keeps the hint."""
    from benchmarks.breakdown import UNSORTED, plan_args
    from benchmarks.generators import attention_workload
    from benchmarks.registry import BY_NAME
    from qsa import plan_attention

    scn = BY_NAME["tiny-decode"]
    w = attention_workload(scn, torch.device("cpu"))
    plans = {}
    for route in ("xqa", "xqa" + UNSORTED):
        args, kw = plan_args(scn, w, route)
        assert kw["route"] == "xqa" and kw["rows_sorted"] == (route == "xqa")
        plans[route] = plan_attention(*args, **kw)
    assert plans["xqa"].routes.direct and plans["xqa"].single is None
    assert not plans["xqa-unsorted"].routes.direct and plans["xqa-unsorted"].single is not None


@pytest.mark.lab
def test_ab_refuses_to_time_a_wrong_step(monkeypatch):
    """An A/B process checks each step (on a NaN-filled output) before it times anything."""
    from benchmarks import ab, breakdown

    real = breakdown.step_fn

    def zeroing(scn, w, route):
        fn = real(scn, w, route)
        out = fn.__closure__[fn.__code__.co_freevars.index("out")].cell_contents

        def step():
            fn()
            out.zero_()
        return step

    assert ab.worker("new", [("tiny-decode", "splitk")], 1, None)["pairs"]["tiny-decode:splitk"]["us"]
    monkeypatch.setattr(breakdown, "step_fn", zeroing)
    with pytest.raises(RuntimeError, match="tiny-decode:splitk fails its check"):
        ab.worker("new", [("tiny-decode", "splitk")], 1, None)


@pytest.mark.lab
def test_ab_extracts_a_commits_source(tmp_path):
    """``--old-rev``: the commit's ``src/`` through ``git archive`` (needs the repository)."""
    import subprocess

    from benchmarks import ab

    if subprocess.run(["git", "-C", ab.ROOT, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    src = ab.extract("HEAD", str(tmp_path))
    assert os.path.isfile(os.path.join(src, "qsa", "__init__.py"))
    assert os.path.isfile(os.path.join(src, "qsa", "attention", "xqa", "kernel.py"))
    with pytest.raises(subprocess.CalledProcessError):
        ab.extract("no-such-revision", str(tmp_path / "x"))


def test_host_cost_split_times_the_calls_without_their_launches_and_the_launches_alone(monkeypatch):
    """``host_cost --split`` on the interpreter (replays on): the stubbed calls launch nothing (their output
    keeps its NaN), the launches alone write the full path's bits, and the count is the replay's launches.
    Known-wrong: with replays off there is nothing to split (an empty record, not figures of the full path)."""
    from benchmarks import host_cost, registry
    from benchmarks.generators import attention_workload
    from benchmarks.timing import Timer
    from qsa import settings
    from qsa.attention import replay

    monkeypatch.setattr(replay, "ON_INTERPRETER", True)
    monkeypatch.setattr(settings, "REPLAY_STEPS", True)
    scn = registry.BY_NAME["tiny-decode"]
    w = attention_workload(scn, "cpu")
    out = torch.full_like(w.q, float("nan"))
    plan_run, run = host_cost.calls_of(scn, w, "xqa", out)
    rec = host_cost.split_costs(Timer("cpu"), plan_run, run, w, out, calls=2)
    assert set(rec) == {"plan_run_py_us", "run_py_us", "run_launches_us", "run_launches"}
    assert rec["run_launches"] >= 1 and all(v > 0 for v in rec.values())
    expected = out.clone()
    assert not expected.isnan().any()
    out.fill_(float("nan"))
    monkeypatch.setattr(replay.ReplayCache, "serve_values", lambda self, entry, values, stream: True)
    run()
    assert out.isnan().all(), "a stubbed run launched"
    monkeypatch.undo()
    monkeypatch.setattr(replay, "ON_INTERPRETER", True)
    run.plan.replays.last.launch(host_cost_values(run.plan, w, out), 0)
    assert torch.equal(out, expected)
    monkeypatch.setattr(settings, "REPLAY_STEPS", False)
    assert host_cost.split_costs(Timer("cpu"), plan_run, run, w, out, calls=2) == {}


def host_cost_values(plan, w, out):
    from qsa.attention import api

    return api._run_values(plan, w.q, w.cache.k, w.cache.v, None, out, None)
