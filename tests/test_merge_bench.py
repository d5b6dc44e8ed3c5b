"""``benchmarks.merge`` on the CPU (its tiny grid under the Triton interpreter): the JSON report and its
schema, every case checked and then timed by the wall clock with the GPU figures null; merges that are
wrong (a plain mean of the parts ignoring the lses, a merge that leaves ``out=`` unwritten) recorded as
failed and not timed; the ``--max-seconds`` budget; the GPU grid and the byte count.

Benchmark tooling: marked ``lab``, as the other benchmark tools' tests are (``python -m pytest -m lab``)."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout root

from benchmarks import merge as bench  # noqa: E402

pytestmark = pytest.mark.lab

TOP_KEYS = {"schema", "tool", "device", "date", "versions", "copy_gbps", "cases"}
CASE_KEYS = {"parts", "rows", "num_q_heads", "head_dim", "dtype", "form", "passed", "max_abs_err", "bound",
             "graph_ms", "eager_ms", "host_us", "gbps", "copy_fraction", "torch_graph_ms", "x_torch", "error"}
TIMINGS = ("graph_ms", "eager_ms", "host_us", "torch_graph_ms")
GPU_FIGURES = ("gbps", "copy_fraction", "x_torch")


def _run(tmp_path, *extra):
    js, md = tmp_path / "merge.json", tmp_path / "merge.md"
    rc = bench.main(["--device", "cpu", "--out", str(js), "--md", str(md), *extra])
    return rc, json.loads(js.read_text()), md.read_text()


def test_cpu_run_checks_and_times_every_case(tmp_path, capsys):
    rc, rep, md = _run(tmp_path)
    assert rc == 0
    assert TOP_KEYS <= set(rep)
    assert rep["schema"] == 1 and rep["tool"] == "benchmarks.merge" and rep["device"] == "cpu"
    assert set(rep["versions"]) == {"torch", "triton", "qsa"} and all(rep["versions"].values())
    assert rep["date"].endswith("+00:00")
    assert rep["copy_gbps"] is None and rep["merge_path"] == "triton"
    cases = rep["cases"]
    want = bench.grid("cpu", quick=False)
    assert [(c["parts"], c["rows"], c["num_q_heads"], c["head_dim"], c["dtype"], c["form"]) for c in cases] == \
        [(w.parts, w.rows, w.num_q_heads, w.head_dim, w.dtype, w.form) for w in want]
    assert {c["parts"] for c in cases} == {2, 3} and {c["rows"] for c in cases} == {1, 3}
    assert {c["form"] for c in cases} == {"list", "stacked"} and {c["dtype"] for c in cases} == {"bf16", "fp16"}
    for c in cases:
        assert CASE_KEYS <= set(c), c
        assert c["passed"] is True and c["error"] is None and c["skipped"] is False, c
        assert 0 <= c["max_abs_err"] <= c["bound"], c
        assert c["torch_max_abs_err"] <= c["bound"], c
        assert c["method"] == "wall"
        for k in TIMINGS:
            assert isinstance(c[k], float) and c[k] > 0, (k, c)
        for k in GPU_FIGURES:
            assert c[k] is None, (k, c)
        assert c["bytes"] == bench.nominal_bytes(bench.Case(*(c[k] for k in (
            "parts", "rows", "num_q_heads", "head_dim", "dtype", "form"))), False)
    out = capsys.readouterr().out
    assert "graph ms" in out and "x torch" in out and out.count(" yes ") == len(cases)
    assert md.startswith("# merge_attention_states on cpu") and md.count("| yes |") == len(cases)


def _mean_merge(outs, lses, *, out=None, return_lse=False):
    """Wrong: the plain mean of the parts, the lses (and empty parts) ignored."""
    o = outs if isinstance(outs, torch.Tensor) else torch.stack(list(outs))
    res = o.float().mean(dim=0).to(o.dtype)
    out = res if out is None else out.copy_(res)
    return (out, torch.zeros(out.shape[:2])) if return_lse else out


def _unwritten_out_merge(outs, lses, *, out=None, return_lse=False):
    """Wrong: the right merge into a new tensor, ``out=`` left as it was."""
    import qsa

    return qsa.merge_attention_states(outs, lses, return_lse=return_lse)


@pytest.mark.parametrize("wrong", [_mean_merge, _unwritten_out_merge])
def test_wrong_merge_is_recorded_as_failed_and_not_timed(tmp_path, monkeypatch, wrong):
    monkeypatch.setattr(bench, "merge_under_test", lambda: wrong)
    rc, rep, md = _run(tmp_path)
    assert rc == 1
    cases = rep["cases"]
    assert len(cases) == len(bench.grid("cpu", quick=False))
    for c in cases:
        assert c["passed"] is False and c["skipped"] is False, c
        assert c["error"].startswith("check failed"), c
        for k in TIMINGS + GPU_FIGURES + ("method", "torch_max_abs_err"):
            assert c[k] is None, (k, c)
    if wrong is _mean_merge:
        assert all(c["max_abs_err"] > c["bound"] for c in cases)
    else:  # NaN left in out
        assert all(c["max_abs_err"] is None and "non-finite" in c["error"] for c in cases)
    assert md.count("| FAIL |") == len(cases)


def test_max_seconds_spent_skips_the_remaining_cases(tmp_path):
    rc, rep, _ = _run(tmp_path, "--max-seconds", "0")
    assert rc == 0
    assert rep["cases"] and all(c["skipped"] and not c["passed"] and c["graph_ms"] is None for c in rep["cases"])
    assert all(c["error"].startswith("skipped") for c in rep["cases"])


def test_gpu_grid_and_bytes():
    full, quick = bench.grid("cuda", quick=False), bench.grid("cuda", quick=True)
    assert len(full) == 2 * (4 * 4 * 2 + 1) and len(quick) < 12
    assert {c.parts for c in full} == {2, 4, 8, 16} and {c.rows for c in full} == {1, 64, 256, 8192}
    assert {c.num_q_heads for c in full} == {6, 24} and {c.head_dim for c in full} == {256}
    assert sum(c.dtype == "fp16" for c in full) == 2 and {c.form for c in full} == {"list", "stacked"}
    case = bench.Case(4, 64, 6, 256, "bf16", "list")
    assert bench.nominal_bytes(case, False) == 4 * 64 * 6 * (256 * 2 + 4) + 64 * 6 * 256 * 2
    assert bench.nominal_bytes(case, True) == bench.nominal_bytes(case, False) + 64 * 6 * 4
