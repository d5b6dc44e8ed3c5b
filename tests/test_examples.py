"""The scripts in examples/: the quickstart runs and checks itself, its check rejects wrong outputs, and
the CUDA-graph example does what it promises without a GPU (and runs on one, ``-m gpu``)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import qsa

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
QUICKSTART = os.path.join(EXAMPLES, "quickstart.py")
CUDA_GRAPH = os.path.join(EXAMPLES, "cuda_graph.py")


def run_script(path, *args, **env):
    return subprocess.run([sys.executable, path, *args], capture_output=True, text=True,
                          env=dict(os.environ, **env))


def load_quickstart():
    """examples/quickstart.py as a module (its main() is not run)."""
    name = "qsa_examples_quickstart"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, QUICKSTART)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_quickstart_runs_on_the_cpu():
    r = run_script(QUICKSTART, "--device", "cpu", TRITON_INTERPRET="1")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "quickstart: all checks passed" in out
    assert "the Triton kernels run under the CPU interpreter" in out
    assert out.count(": ok") == 2, out  # plan + run, and the one-call op, within tolerance
    assert "plan + run and the one-call op bitwise equal: True" in out
    # Both page4 routes ran, and the selection was sparse (more candidate blocks than k for every row).
    assert "64 rows grouped" in out and "1 row single-row xqa" in out, out
    line = next(s for s in out.splitlines() if s.startswith("selection:"))
    fewest_candidates = int(line.split()[1].split("-")[0])
    assert fewest_candidates > load_quickstart().SIZES["small"].k, line


@pytest.fixture(scope="module")
def quickstart_result():
    qs = load_quickstart()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return qs, qs.run_example(qs.SIZES["small"], device)


def test_quickstart_check_accepts_the_kernels_output(quickstart_result):
    qs, res = quickstart_result
    for name in ("planned", "one_call"):
        c = qs.check_attention(res[name], res["ref"], res["ref_lowp"])
        assert c.ok and c.err <= c.bound, (name, c)


def test_quickstart_check_rejects_wrong_outputs(quickstart_result):
    qs, res = quickstart_result
    out, ref, low = res["planned"], res["ref"], res["ref_lowp"]
    check = qs.check_attention
    c = check(out, ref, low)

    # One element off by a little more than the bound.
    bumped = out.clone()
    bumped[7, 1, 3] = (ref[7, 1, 3] + 2 * c.bound).to(out.dtype)
    assert not check(bumped, ref, low).ok

    # A NaN anywhere, an all-zero output, another row's output.
    nan = out.clone()
    nan[-1, 0, 0] = float("nan")
    assert not check(nan, ref, low).ok
    assert not check(torch.zeros_like(out), ref, low).ok
    assert not check(out.roll(1, dims=0), ref, low).ok

    # A plausible but wrong attention: every causal token of each row instead of its selection.
    rows = out.shape[0]
    dense = torch.arange(int(res["positions"].max()) + 1, dtype=torch.int32, device=out.device).repeat(rows, 1)
    batch = (res["block_table"], res["token_to_req"], res["positions"], res["seq_lens"])
    kv = res["kv"]
    wrong, _ = qsa.reference_attention(res["q"], kv[:, 0], kv[:, 1], dense, *batch, gate=res["gate"],
                                       compute_dtype=out.dtype)
    assert not check(wrong, ref, low).ok

    # A wrong shape.
    assert not check(out[:-1], ref, low).ok


def test_cuda_graph_example_without_a_gpu():
    """Without a CUDA device (none visible) it says so and exits 0."""
    r = run_script(CUDA_GRAPH, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no CUDA device" in r.stdout and "skipped" in r.stdout, r.stdout
    assert "replay" not in r.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "reference"])
def test_cuda_graph_example_on_the_gpu(size):
    r = run_script(CUDA_GRAPH, "--size", size)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cuda_graph: all checks passed" in r.stdout
    assert r.stdout.count("bitwise equal to eager: True") == 4, r.stdout
    assert "pages moved: True; selection unchanged: True; output bitwise unchanged: True" in r.stdout
