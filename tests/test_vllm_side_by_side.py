"""benchmarks.vllm_side_by_side on the CPU: the report (JSON and Markdown) on fake records, the set-up of
vLLM's op folder from a stand-in wheel, the scenario set; the tiny ``--quick`` run under the interpreter is
marked ``lab`` (vLLM's op is not run on the CPU: the interpreter computes its bf16 dots wrongly)."""

import json
import os
import subprocess
import sys
import zipfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout root

from benchmarks import vllm_side_by_side as sbs  # noqa: E402
from benchmarks.report import sanitize, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def op_record(ms, eager_ms, host_us, err=1e-3, passed=True, available=True, error=None):
    return dict(available=available, passed=passed, error=error, max_abs_err=err, rel_l2_err=err / 10, finite=True,
                graph_ms=ms, graph_min_ms=ms, graph_max_ms=ms, graph_reps=10, timing="graph", replay_equal=True,
                eager_ms=eager_ms, eager_min_ms=eager_ms, eager_max_ms=eager_ms, eager_reps=50, host_us=host_us,
                host_calls=200, eager_equal=True)


def scenario_record(name, hq=6, hkv=1, rows=8192, reqs=1, **kw):
    rec = dict(name=name, step=name.rsplit("-", 1)[0], num_q_heads=hq, num_kv_heads=hkv, head_dim=256, dtype="bf16",
               block_size=16, rows=rows, num_reqs=reqs, context=65536, topk=512, width=2052, use_prefill_config=True,
               overlap_requested=0.8, overlap=0.801, tokens_total=rows * 2049, avg_set_size=2049.5,
               avg_union_per_group=2900.0, qsa_route="grouped", ref_rows=16, naive_max_abs_err=2e-3,
               bound_abs=4.1e-3, bound_rel=1e-2, yardstick="naive", setup_s=3.0, elapsed_s=9.0, error=None, ops={})
    rec.update(kw)
    return rec


def fake_report():
    both = scenario_record("prefill-8192-6x1", ops=dict(vllm=op_record(2.0, 2.1, 30.0), qsa=op_record(0.8, 1.2, 250.0)),
                           vllm_vs_qsa=dict(max_abs_diff=3.9e-3, bitwise_equal=False, rows=8192))
    qsa_only = scenario_record("decode-64-6x1", rows=64, reqs=64, use_prefill_config=False, qsa_route="xqa direct",
                               ops=dict(vllm=dict(available=False, passed=False, error="ModuleNotFoundError: vllm"),
                                        qsa=op_record(0.05, 0.2, 180.0)))
    failed = scenario_record("mtp-8-6x1", rows=8, use_prefill_config=False, qsa_route="xqa direct",
                             ops=dict(vllm=op_record(0.013, 0.05, 20.0),
                                      qsa=dict(available=True, passed=False, max_abs_err=float("inf"), finite=False,
                                               error="correctness gate failed: max abs inf")))
    errored = dict(name="chunk-2048-12x1", num_q_heads=12, num_kv_heads=1, rows=2048, num_reqs=1,
                   error="RuntimeError: out of memory", ops={})
    skipped = dict(name="prefill-8192-24x2", num_q_heads=24, num_kv_heads=2, rows=8192, num_reqs=1,
                   error="skipped: --max-minutes reached", ops={})
    return dict(schema=1, tool="benchmarks.vllm_side_by_side", device=dict(name="NVIDIA H100 80GB HBM3"),
                date="2026-12-06T00:00:00+00:00", complete=True, quick=False, argv=[],
                versions=dict(python="3.11", torch="2.11.0", triton="3.6.0", qsa="0.1.0"),
                vllm_op=dict(available=True, module=sbs.VLLM_OP_MODULE, file=".vllm/" + sbs.VLLM_OP_FILE,
                             sha256="ab" * 32, shim=True, vllm_version="0.33.0+qsa-side-by-side-shim"),
                scenarios=[both, qsa_only, failed, errored, skipped], fatal_error=None)


def test_report_formatting_on_fake_records(tmp_path):
    report = fake_report()
    assert sbs.speedup(report["scenarios"][0], "graph_ms") == pytest.approx(2.5)
    assert sbs.speedup(report["scenarios"][0], "eager_ms") == pytest.approx(1.75)
    assert sbs.speedup(report["scenarios"][1], "graph_ms") is None   # vLLM not available
    assert sbs.speedup(report["scenarios"][2], "graph_ms") is None   # qsa failed its check

    path = tmp_path / "side.json"
    write_json(path, sanitize(report))
    back = json.loads(path.read_text())                             # inf written as a string, still valid JSON
    assert back["scenarios"][2]["ops"]["qsa"]["max_abs_err"] == "inf"

    md = sbs.markdown(back)
    lines = md.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| scenario"))
    assert lines[header] == "| " + " | ".join(sbs.COLUMNS) + " |"
    body = lines[header + 2:header + 2 + 5]
    assert all(line.count("|") == len(sbs.COLUMNS) + 1 for line in body), body
    row = dict(zip(sbs.COLUMNS, (c.strip() for c in body[0].strip("|").split("|"))))
    assert row["vLLM graph ms"] == "2.0000" and row["qsa graph ms"] == "0.8000" and row["x graph"] == "2.50"
    assert row["x eager"] == "1.75" and row["qsa host us"] == "250.0" and row["max abs vLLM-qsa"] == "3.90e-03"
    assert row["check vLLM / qsa"] == "ok / ok" and row["qsa route"] == "grouped" and row["overlap"] == "0.80"
    assert "n/a / ok" in body[1] and "ok / FAIL" in body[2] and "inf" in body[2]
    assert "error: RuntimeError: out of memory" in body[3] and "skipped" in body[4]
    assert "NVIDIA H100 80GB HBM3" in md and "sha256 abababababab" in md and "stand-in" in md
    assert "mtp-8-6x1 qsa: correctness gate failed" in md

    assert sorted(sbs.failures(back)) == ["chunk-2048-12x1 (RuntimeError: out of memory)", "mtp-8-6x1:qsa"]
    incomplete = dict(back, complete=False, vllm_op=dict(available=False, error="ModuleNotFoundError: vllm"))
    md2 = sbs.markdown(incomplete)
    assert "Incomplete run" in md2 and "not available (ModuleNotFoundError: vllm)" in md2


def test_scenarios_and_prefill_flag():
    full = sbs.select()
    assert len(full) == 12 and not any(s.test_only for s in full)
    assert [s.name for s in full[:4]] == ["prefill-8192-6x1", "chunk-2048-6x1", "decode-64-6x1", "mtp-8-6x1"]
    assert {(s.num_q_heads, s.num_kv_heads) for s in full} == {(6, 1), (12, 1), (24, 2)}
    assert all(s.dtype == "bf16" and s.head_dim == 256 and s.block_size == 16 and s.width + 1 == 2052
               and s.context == 65536 for s in full)
    flags = {s.name.rsplit("-", 1)[0]: sbs.use_prefill_config(s) for s in full}
    assert flags == {"prefill-8192": True, "chunk-2048": True, "decode-64": False, "mtp-8": False}
    assert all(s.test_only for s in sbs.select(quick=True))
    assert [s.name for s in sbs.select(["decode-64-*"])] == ["decode-64-6x1", "decode-64-12x1", "decode-64-24x2"]


STAND_IN_OP = '''
from vllm.model_executor.warmup.jit_warmup_triton_helper import TritonWarmupTensor, triton_scalar_specialization_rep
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON, tl, triton


def qsa_sparse_paged_attention(*args, **kwargs):
    return current_platform.has_device_capability(89), HAS_TRITON
'''


def test_setup_from_a_wheel_and_import(tmp_path):
    """--setup-vllm takes the op's file from a wheel and writes the stand-in modules; an op file importing
    what vLLM's imports then loads with torch and Triton alone, and the report says where it came from."""
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(sbs.VLLM_OP_FILE, STAND_IN_OP)
        z.writestr("vllm/models/qwen4_exp/nvidia/model.py", "raise ImportError('not extracted')\n")
    dest = tmp_path / "vdir"
    assert sbs.main(["--setup-vllm", str(wheel), "--vllm-dir", str(dest)]) == 0
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert files == sorted(["SOURCE.txt", sbs.VLLM_OP_FILE, *sbs.SHIM_FILES])
    code = ("import sys; from benchmarks import vllm_side_by_side as s; from pathlib import Path; "
            f"op, info = s.load_vllm_op(Path({str(dest)!r})); "
            "assert op is not None, info; assert info['shim'] and info['available'], info; "
            "print(op()); assert 'torch' in sys.modules and 'vllm.models.qwen4_exp.nvidia.model' not in sys.modules")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "src")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() in ("(True, True)", "(False, True)")

    bad = tmp_path / "other.whl"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("vllm/models/qwen4_exp/amd/ops/qsa.py", "")
    with pytest.raises(SystemExit, match="amd/ops/qsa.py"):
        sbs.setup_vllm(bad, tmp_path / "vdir2")


def test_missing_op_is_reported(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("a vllm package is importable here")
    code = ("from benchmarks import vllm_side_by_side as s; from pathlib import Path; "
            f"op, info = s.load_vllm_op(Path({str(tmp_path)!r})); assert op is None and not info['available']; "
            "print(info['error'])")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "src")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "vllm" in res.stdout


@pytest.mark.lab
def test_quick_run_on_the_cpu(tmp_path):
    """The tiny scenarios end to end under the interpreter: qsa checked and timed, vLLM's op recorded as not run,
    the JSON and Markdown written."""
    out, md = tmp_path / "smoke.json", tmp_path / "smoke.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "benchmarks.vllm_side_by_side", "--quick", "--device", "cpu",
                          "--out", str(out), "--md", str(md)], capture_output=True, text=True, timeout=900, env=env,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] and [s["name"] for s in report["scenarios"]] == [s.name for s in sbs.select(quick=True)]
    for rec in report["scenarios"]:
        q, v = rec["ops"]["qsa"], rec["ops"]["vllm"]
        assert q["passed"] and q["graph_ms"] > 0 and q["host_us"] > 0 and q["replay_equal"] and q["eager_equal"], q
        assert not v["available"] and v["error"]  # not run under the interpreter (or not importable)
    assert md.read_text() == sbs.markdown(report)
