"""``qsa demo`` and ``qsa verify`` on the CPU: they run, report, and fail loudly when bits differ."""

import os
import subprocess
import sys

import pytest
import torch

from qsa import demo, indexer, verify


def _cpu_env():
    """The environment of a CPU user: no Triton interpreter unless a command turns it on."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def test_demo_cli_cpu_default():
    """``qsa demo`` with no arguments: the reference route, two placements, bitwise equal logits."""
    res = subprocess.run([sys.executable, "-m", "qsa.cli", "demo", "--device", "cpu"], capture_output=True,
                         text=True, env=_cpu_env(), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "bitwise equal" in out and "OK:" in out
    assert "prefill tok/s" in out and "decode tok/s" in out
    assert "(prefill chunks: reference)" in out
    table = [line for line in out.splitlines() if line.startswith(("A ", "B "))]
    assert len(table) == 2 and table[0].split()[3] != table[1].split()[3]  # different first blocks


def test_demo_physical_order_shows_the_defect(capfd):
    """Under the interpreter: the logical plan stays bitwise equal across placements, the physical one
    does not (the grouped kernel runs: 64-row chunks). On a machine with a GPU the CPU demo reruns
    itself with the interpreter on (hence capfd)."""
    status = demo.main(["--device", "cpu", "--plan-order", "physical", "--requests", "1", "--prompt-len", "128",
                        "--new-tokens", "2"])
    out = capfd.readouterr().out
    assert status == 0, out
    assert "(prefill chunks: grouped)" in out
    assert "logical order, placements A vs B: bitwise equal" in out
    assert "physical order (demonstration), placements C vs D: NOT bitwise equal" in out


def test_demo_fails_on_a_placement_dependent_defect(monkeypatch, capsys):
    """A selection that (wrongly) depends on physical block ids makes the demo exit 1."""
    real = indexer._select_tokens_torch

    def placement_dependent(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *, k):
        out = real(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, k=k)
        bs = 4 * kc_cache.shape[1]
        req = token_to_req.long().clamp(min=0)[:, None]
        page = block_table.long()[req, (out.long().clamp(min=0) // bs)]
        return torch.where((page % 3 == 0) & (out > 0), -1, out)

    monkeypatch.setattr(indexer, "_select_tokens_torch", placement_dependent)
    status = demo.main(["--device", "cpu", "--route", "reference", "--requests", "2", "--prompt-len", "40", "--new-tokens", "2",
                        "--chunk", "32", "--no-warmup"])
    out = capsys.readouterr().out
    assert status == 1
    assert "NOT bitwise equal" in out and "FAIL" in out


@pytest.mark.parametrize("cmd,args,match", [
    ("demo", ["--block-size", "0"], "--block-size"), ("demo", ["--block-size", "6"], "multiple of 4"),
    ("demo", ["--requests", "0"], "--requests"), ("demo", ["--prompt-len", "-5"], "--prompt-len"),
    ("demo", ["--layers", "-1"], "--layers"), ("demo", ["--chunk", "0"], "--chunk"),
    ("demo", ["--alloc-seeds", "1", "1"], "must differ"), ("demo", ["--route", "fast"], "--route"),
    ("verify", ["--sample", "-3"], "--sample"), ("verify", ["-n", "0"], "--relocations"),
    ("verify", ["--load", "/nonexistent/step.pt"], "no such file"), ("verify", ["--device", "tpu"], "--device"),
])
def test_cli_refuses_bad_arguments(cmd, args, match, capsys):
    with pytest.raises(SystemExit) as e:
        (demo if cmd == "demo" else verify).main(["--device", "cpu", *args] if "--device" not in args else args)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cli_cuda_without_a_gpu(capsys):
    for module in (demo, verify):
        with pytest.raises(SystemExit):
            module.main(["--device", "cuda"])
        assert "no CUDA device is available" in capsys.readouterr().err


def test_progress_bar_prints_once_off_a_terminal(capsys):
    bar = demo.ProgressBar("run A")
    for i in range(1, 6):
        bar.update(i, 5, "prefill")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "[" + "#" * 32 + "]" in lines[0] and "5/5" in lines[0]


def test_verify_cpu_default(capfd):
    """The CPU default (one relocation to keep the test short): every check passes, the graph check is
    skipped on the CPU, and both the grouped and the single-row route ran."""
    status = verify.main(["--device", "cpu", "-n", "1"])
    out = capfd.readouterr().out
    assert status == 0, out
    assert "72 rows grouped + 4 single-row" in out
    for line in ("repeat", "relocation (permutation)", "permuted index order", "fp64 reference"):
        assert any(row.startswith(line) and " ok " in row for row in out.splitlines()), line
    assert any(row.startswith("cuda graph replay") and "skipped" in row for row in out.splitlines())


def test_verify_save_load_and_exit_status(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "step.pt")
    cpu_ref = ["--device", "cpu", "--route", "reference"]
    assert verify.main([*cpu_ref, "--save", path, "-n", "2"]) == 0
    assert verify.main([*cpu_ref, "--load", path, "-n", "3"]) == 0
    assert "loaded from" in capsys.readouterr().out

    real = verify._attend

    def placement_dependent(step, kv, table, indices, route, order="logical", max_query_len=None):
        out, lse = real(step, kv, table, indices, route, order, max_query_len)
        return out + table[0, 0].to(out.dtype), lse

    monkeypatch.setattr(verify, "_attend", placement_dependent)
    assert verify.main([*cpu_ref, "--load", path, "-n", "3"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "out differ" in out


def test_verify_catches_the_physical_order(device):
    """fp16 data (rounding flips show more often than in bf16): with the physical-order plan a
    relocation changes the bits, and the verifier says so."""
    step = verify.capture_step("cpu").to(device)
    step.q, step.gate, step.kv = step.q.half(), step.gate.half(), step.kv.half()
    v = verify.Verifier(step, route="auto", plan_order="physical", sample=2, log=lambda *_: None)
    checks = v.relocations(1)
    assert checks[0].status == "FAIL" and "out" in checks[0].detail


@pytest.mark.gpu
def test_gpu_demo_and_verify(capsys):
    """On a GPU: the reference-shape demo with CUDA-graph decode, and verify with graph replays."""
    assert demo.main(["--layers", "2", "--requests", "3", "--prompt-len", "3000", "--new-tokens", "16"]) == 0
    assert "bitwise equal" in capsys.readouterr().out
    assert verify.main(["-n", "6"]) == 0
    out = capsys.readouterr().out
    assert any(row.startswith("cuda graph replay") and " ok " in row for row in out.splitlines())
