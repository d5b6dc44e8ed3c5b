"""The ``qsa`` command (``--version``, bare ``qsa``, ``--help``), the one version string, the files a
release ships (LICENSE, py.typed, CHANGELOG.md) and the CPU report of ``qsa bench``."""

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import qsa
import qsa.cli.commands

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout root, for benchmarks/

from benchmarks import report, run  # noqa: E402

SUBCOMMANDS = ("info", "demo", "verify", "bench")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# ------------------------------------------------------------------------------------------------
# the command line


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        qsa.cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"qsa {qsa.__version__}"


def test_bare_qsa_prints_the_help_and_exits_0(capsys):
    assert qsa.cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: qsa") and "--version" in out
    assert all(name in out for name in SUBCOMMANDS)


def _help_lines(text: str) -> dict:
    """``{subcommand: its line of help}`` from ``qsa --help``."""
    lines = {}
    for line in text.splitlines():
        m = re.match(r"^\s+(\w+)\s{2,}(\S.*)$", line)
        if m and m.group(1) in SUBCOMMANDS:
            lines[m.group(1)] = m.group(2)
    return lines


def test_help_lists_every_subcommand_with_a_line_of_help(capsys):
    with pytest.raises(SystemExit) as e:
        qsa.cli.main(["--help"])
    assert e.value.code == 0
    lines = _help_lines(capsys.readouterr().out)
    assert set(lines) == set(SUBCOMMANDS), lines
    assert all(len(text.split()) >= 3 for text in lines.values()), lines
    assert set(qsa.cli.commands.COMMANDS) | {"info"} == set(SUBCOMMANDS)  # a new command shows up in this test


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        qsa.cli.main(["bogus"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_info_prints_the_version_first(capsys):
    assert qsa.cli.main(["info"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"qsa {qsa.__version__}"
    assert any(line.startswith("route grouped") for line in out)


def test_the_qsa_module_entry_point_without_arguments():
    """``python -m qsa.cli`` (what the ``qsa`` script calls) with no arguments: the help, exit status 0."""
    proc = subprocess.run([sys.executable, "-m", "qsa.cli"], capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: qsa") and not proc.stderr.strip()


# ------------------------------------------------------------------------------------------------
# the version, written once


def test_version_is_written_once_and_read_by_the_build():
    """``qsa.__version__`` is a literal in ``__init__.py`` (setuptools reads it without importing qsa),
    assigned once; pyproject.toml takes the version from it and writes none of its own."""
    tree = ast.parse((ROOT / "src" / "qsa" / "__init__.py").read_text())
    assigned = [node for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)]
    assert len(assigned) == 1 and isinstance(assigned[0].value, ast.Constant)
    assert assigned[0].value.value == qsa.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc)?\d*", qsa.__version__)
    project = _pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "qsa.__version__"}


def test_installed_metadata_agrees_with_the_package():
    from importlib import metadata

    try:
        installed = metadata.version("qsa")
    except metadata.PackageNotFoundError:
        pytest.skip("qsa is not installed (run from a source tree on the path)")
    assert installed == qsa.__version__, "reinstall qsa (pip install -e .) after changing the version"


# ------------------------------------------------------------------------------------------------
# files a release ships


def test_py_typed_is_package_data():
    assert (Path(qsa.__file__).parent / "py.typed").is_file()
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["qsa"]


# sha256 of the Apache License 2.0 as the Apache Software Foundation publishes it (LICENSE-2.0.txt)
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_is_the_apache_2_text_declared_in_the_metadata():
    first, body = (ROOT / "LICENSE").read_bytes().split(b"\n", 1)
    assert first.decode() == "Copyright 2026 the qsa authors"
    assert hashlib.sha256(body).hexdigest() == APACHE_2_SHA256
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_changelog_has_unreleased_and_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[([^\]]+)\]", text, flags=re.M)
    assert versions[0] == "Unreleased"
    assert versions[1] == qsa.__version__, "the newest release in CHANGELOG.md is the package's version"
    for words in ("qsa --version", "LICENSE", "py.typed", "route=\"auto\"", "examples/", "docs/spec.md",
                  "update_compressed_keys", "block_size", "require grad"):
        assert words in text.split("## [" + qsa.__version__)[0], words


def test_bench_extra_names_matplotlib():
    assert _pyproject()["project"]["optional-dependencies"]["bench"] == ["matplotlib"]


# ------------------------------------------------------------------------------------------------
# the CPU report of qsa bench


def _rec(scenario, route, kind="route", **kw):
    base = dict(scenario=scenario, route=route, kind=kind, passed=True, median_ms=12.5, min_ms=11.0,
                max_ms=14.0, tflops=1e-7, gbps=1e-5, vs_splitk=1.0, vs_torch=None, max_abs_err=2.5e-4,
                rel_l2_err=2.0e-4, bound_abs=1.9e-3, bound_rel=1.8e-3, timing="wall", reps=3,
                replay_equal=True, error=None)
    base.update(kw)
    return base


def _recorded(device: str) -> dict:
    """A small recorded result, as ``latest.json`` holds it."""
    records = [
        _rec("tiny-prefill", "grouped", median_ms=367.4),
        _rec("tiny-prefill", "splitk", median_ms=503.5),
        _rec("tiny-prefill", "xqa", passed=False, median_ms=None, min_ms=None, max_ms=None, reps=None,
             max_abs_err=0.5, error="correctness gate failed: max abs 0.5 (bound 0.0019); not timed"),
        _rec("tiny-prefill", "floor-flops", kind="floor", passed=None, median_ms=0.0129, timing="model"),
        _rec("tiny-selection", "select", max_abs_err=None, rel_l2_err=None, bound_abs=None, bound_rel=None,
             exact=True, rows_differ=0, tie_equivalent=True, median_ms=307.8),
    ]
    scenarios = [dict(name="tiny-prefill", kind="attention", description="20 rows x 1 req", overlap=0.796,
                      avg_union_per_group=18.0, sharing=3.24, elapsed_s=7.8, error=None),
                 dict(name="tiny-selection", kind="selection", description="select_tokens: 6 rows", overlap=None,
                      avg_union_per_group=None, sharing=None, elapsed_s=1.5, error=None)]
    cpu = device == "cpu"
    return dict(
        schema=1, device=device, date="2026-01-01T00:00:00+00:00", complete=True, quick=False, argv=[],
        device_info=(dict(name="cpu", capability=None, sm_count=2, memory_gib=None, cores=2,
                          processor="Test CPU", triton_interpreter=True) if cpu
                     else dict(name=device, capability="9.0", sm_count=132, memory_gib=139.8)),
        versions=dict(python="3.11", torch="2.13", triton="3.6", qsa=qsa.__version__),
        ceilings=dict(copy_gbps=5.6, matmul_tflops=0.0067, matmul_shape=[256, 256, 256]),
        scenarios=scenarios, records=records,
        targets=report.cpu_targets() if cpu else report.evaluate_targets(records, {}, None),
        fatal_error=None)


def test_cpu_text_report_shows_what_was_measured():
    rep = _recorded("cpu")
    text = report.cpu_text(rep)
    assert "device: cpu (2 cores, Test CPU), Triton interpreter on" in text and f"qsa {qsa.__version__}" in text
    assert "wall-clock medians of 3 calls" in text
    assert "routes and baselines checked: 3 of 4 passed" in text
    rows = {(r[0], r[1]): r for r in report.cpu_result_rows(rep)}
    assert set(rows) == {("tiny-prefill", "grouped"), ("tiny-prefill", "splitk"), ("tiny-prefill", "xqa"),
                         ("tiny-selection", "select")}  # the floor is left out
    g = dict(zip(report.CPU_RESULT_COLUMNS, rows[("tiny-prefill", "grouped")]))
    assert g["median ms"] == "367.4" and g["min ms"] == "11" and g["max ms"] == "14" and g["calls"] == "3"
    assert g["max abs (bound)"] == "2.50e-04 (1.90e-03)" and g["check"] == "ok"
    x = dict(zip(report.CPU_RESULT_COLUMNS, rows[("tiny-prefill", "xqa")]))
    assert x["check"] == "FAIL" and x["median ms"] == "-" and x["note"].startswith("correctness gate failed")
    assert dict(zip(report.CPU_RESULT_COLUMNS, rows[("tiny-selection", "select")]))["check"] == "ok (exact)"
    # no rates, ratios, floors or target rows; the targets named once, as needing a GPU
    for absent in ("TFLOP/s", "GB/s ", "x splitk", "floor-", "not measured", "splitk-vs-naive"):
        assert absent not in text, absent
    assert text.count("need a CUDA GPU") == 1 and " 0.0 " not in text
    assert "tiny-selection" in text and "20 rows x 1 req" in text


def test_cpu_markdown_report(tmp_path):
    path = tmp_path / "benchmarks.md"
    report.write_markdown(_recorded("cpu"), path, plot=None)
    md = path.read_text()
    assert md.startswith("# Benchmarks (CPU)") and "on **cpu**" in md
    assert "| tiny-prefill | grouped | 367.4 | 11 | 14 | 3 | 2.50e-04 (1.90e-03) |" in md
    assert "## Targets" in md and md.count("need a CUDA GPU") == 1
    assert "| splitk-vs-naive" not in md and "floor-" not in md and "TFLOP/s" not in md
    assert "CUDA-graph replays" not in md and "History" not in md


def test_gpu_report_keeps_its_targets_rates_and_floors(tmp_path):
    rep = _recorded("NVIDIA H200")
    assert not report.is_cpu(rep)
    path = tmp_path / "benchmarks.md"
    report.write_markdown(rep, path, plot=None)
    md = path.read_text()
    assert md.startswith("# Benchmarks\n") and "CUDA-graph replays" in md
    # the latest run, dated and with its device; the suite it ran; no list of earlier runs (git has them)
    assert "**NVIDIA H200**, 2026-01-01T00:00:00+00:00." in md and report.RESULTS_NOTE in md
    assert "## The suite" in md and "NVIDIA H200 (sm 9.0, 132 SMs, 139.8 GiB)" in md
    assert "2 (1 attention, 1 selection)" in md and "Checked: 3 of 4 routes and baselines passed." in md
    assert "History" not in md
    assert "| target | value | goal | met | note |" in md and "| splitk-vs-naive-prefill-64k |" in md
    assert "| TFLOP/s |" in md and "| tiny-prefill | floor-flops |" in md


def test_cpu_targets_say_why_they_are_not_measured():
    t = report.cpu_targets()
    assert [x["name"] for x in t] == [name for name, *_ in report.TARGETS]
    assert all(x["value"] is None and x["met"] is None and "CUDA GPU" in x["note"] for x in t)


def test_qsa_bench_on_the_cpu_prints_the_cpu_report(tmp_path, monkeypatch, capsys):
    """A small real run (one tiny scenario, the PyTorch baseline only): the printed report and the JSON
    say what ran on the CPU; the floors stay in the JSON only, the targets carry the CPU note."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert run.main(["--scenario", "tiny-decode", "--route", "naive", "--device", "cpu", "--out", str(tmp_path),
                     "--no-docs"]) == 0
    text = capsys.readouterr().out
    assert "device: cpu (" in text and "Triton interpreter on" in text
    assert re.search(r"^tiny-decode\s+naive\s+[0-9.]+\s", text, flags=re.M), text
    assert "floor-" not in text and "TFLOP/s" not in text and "not measured" not in text
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["device"] == "cpu" and latest["device_info"]["triton_interpreter"] is True
    assert latest["device_info"]["cores"] == os.cpu_count()
    assert all(t["note"] == report.CPU_TARGET_NOTE for t in latest["targets"])
    assert any(r["kind"] == "floor" for r in latest["records"])
