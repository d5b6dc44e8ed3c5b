"""``qsa demo`` and ``qsa verify`` on the CPU: they run, report, and fail loudly when bits differ."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import qsa
import qsa.attention.reference
import qsa.backend
import qsa.cli.demo
import qsa.cli.verify
import qsa.model.layer
import qsa.model.serving
import qsa.selection.api
import qsa.settings


def _cpu_env():
    """The environment of a CPU user: no Triton interpreter unless a command turns it on."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def expected_routes(lens, chunk, new_tokens) -> str:
    """The attention routes ``route="auto"`` takes for the demo's steps, worked out from the schedule: a
    prefill step of at least ``GROUPED_MIN_ROWS`` rows is grouped in groups of ``GROUP_ROWS``, with its
    leftover rows on xqa where it holds rows of several requests (all of it grouped, the last group
    partial, where it is one request's rows), a smaller one is xqa, and so is every decode step; in the
    demo's words."""
    import qsa

    prefill = {"grouped": 0, "xqa": 0}
    for step in qsa.model.serving.prefill_schedule(lens, chunk):
        rows = sum(c.end - c.start for c in step)
        one_request = max(c.end - c.start for c in step) >= rows  # max_query_len >= rows: a partial last group
        grouped = 0 if rows < qsa.settings.GROUPED_MIN_ROWS else rows if one_request else \
            rows // qsa.settings.GROUP_ROWS * qsa.settings.GROUP_ROWS
        prefill["grouped"] += grouped > 0
        prefill["xqa"] += rows > grouped

    def steps(n, kind):
        return f"{n} {kind} step{'s' * (n != 1)}"

    parts = [f"grouped {steps(prefill['grouped'], 'prefill')}"] if prefill["grouped"] else []
    xqa = [steps(n, kind) for n, kind in ((prefill["xqa"], "prefill"), (new_tokens - 1, "decode")) if n]
    return ", ".join(parts + ([f"xqa {' + '.join(xqa)}"] if xqa else []))


def check_kernels_ran(out: str, lens, chunk, new_tokens, stages: str = "Triton kernels") -> None:
    """The demo's report of what ran: the kernel routes the schedule calls for, never the reference."""
    prefix = "routes run (each of runs A and B): "
    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, out
    attention, _, ran_stages = lines[0][len(prefix):].partition("; selection and cache writes: ")
    assert "reference" not in attention, lines[0]
    assert attention == expected_routes(lens, chunk, new_tokens), lines[0]
    assert ran_stages == stages, lines[0]


SMALL_DEMO = ["--layers", "1", "--requests", "2", "--prompt-len", "70", "--new-tokens", "3", "--chunk", "100"]
SMALL_LENS, SMALL_CHUNK, SMALL_NEW = [70, 108], 100, 3  # the demo's prompts: 70 and 70 + 70 * 9 // 20 + 7
# chunks: 70 + 30 rows of two requests (96 grouped, 4 on xqa), then 78 rows of one (all grouped)


@pytest.mark.slow
def test_demo_cli_cpu_runs_the_kernels():
    """``qsa demo`` on a CPU, no interpreter in the environment: it turns the interpreter on and runs the
    Triton kernels (grouped prefill chunks, the leftover rows of a two-request chunk and decode on xqa,
    Triton selection and cache writes),
    and says so from what ran; two placements, bitwise equal logits. Small sizes keep it short."""
    res = subprocess.run([sys.executable, "-m", "qsa.cli", "demo", "--device", "cpu", *SMALL_DEMO],
                         capture_output=True, text=True, env=_cpu_env())
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "bitwise equal" in out and "OK:" in out
    assert "prefill tok/s" in out and "decode tok/s" in out
    assert "the Triton kernels run under the Triton interpreter" in out
    assert f"{SMALL_LENS[0]}, {SMALL_LENS[1]} prompt tokens" in out
    check_kernels_ran(out, SMALL_LENS, SMALL_CHUNK, SMALL_NEW)
    assert "falls back" not in res.stderr
    table = [line for line in out.splitlines() if line.startswith(("A ", "B "))]
    assert len(table) == 2 and table[0].split()[3] != table[1].split()[3]  # different first blocks


def test_the_kernel_check_rejects_a_demo_that_ran_the_reference(capsys):
    """The check above fails on the output of a demo whose attention ran the PyTorch reference."""
    status = qsa.cli.demo.main(["--device", "cpu", "--route", "reference", *SMALL_DEMO, "--no-warmup"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "routes run (each of runs A and B): reference 2 prefill steps + 2 decode steps; selection and cache " \
           "writes: PyTorch implementations" in out
    with pytest.raises(AssertionError):
        check_kernels_ran(out, SMALL_LENS, SMALL_CHUNK, SMALL_NEW)
    with pytest.raises(AssertionError):
        check_kernels_ran(out, SMALL_LENS, SMALL_CHUNK, SMALL_NEW, stages="PyTorch implementations")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU demo under the interpreter, in this process")
def test_demo_reports_the_fallback_of_a_broken_interpreter(monkeypatch, capsys):
    """An interpreter that cannot run the kernels (the probe failed): auto runs the reference, the demo
    reports that it did, and a forced route is refused with the reason (exit status 2)."""
    import qsa

    reason = "the Triton interpreter cannot run qsa's kernels (probe failed); pip install 'numpy<2.4'"
    monkeypatch.setattr(qsa.backend, "interpreter_problem", lambda: reason)
    monkeypatch.setattr(qsa.backend, "_logged", set())
    assert qsa.cli.demo.main(["--device", "cpu", "--requests", "2", "--prompt-len", "20", "--new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "routes run (each of runs A and B): reference " in out and "Triton interpreter" not in out
    assert qsa.cli.demo.main(["--device", "cpu", "--route", "xqa"]) == 2
    assert f"qsa demo: --route xqa cannot run: {reason}" in capsys.readouterr().err
    assert qsa.cli.demo.main(["--device", "cpu", "--backend", "triton"]) == 2
    assert f"qsa demo: --backend triton cannot run: {reason}" in capsys.readouterr().err
    assert qsa.cli.verify.main(["--device", "cpu", "--route", "grouped"]) == 2
    assert f"qsa verify: --route grouped cannot run: {reason}" in capsys.readouterr().err


def _launch_counter(monkeypatch):
    """Count the attention launchers' calls by route, as :func:`qsa.run_attention` makes them."""
    from collections import Counter

    import qsa

    launched = Counter()

    def counting(real, route):
        def launch(*args, **kwargs):
            launched[route] += 1
            return real(*args, **kwargs)
        return launch

    launchers = qsa.attention
    for module, name, route in ((launchers.grouped.launch, "grouped_attention", "grouped"),
                                (launchers.xqa.launch, "xqa_attention", "xqa"),
                                (launchers.xqa.launch, "xqa_direct_attention", "xqa"),
                                (launchers.splitk.launch, "splitk_attention", "splitk"),
                                (launchers.invariant.launch, "invariant_attention", "invariant")):
        monkeypatch.setattr(module, name, counting(getattr(module, name), route))
    monkeypatch.setattr(qsa.attention.reference, "reference_attention", counting(qsa.attention.reference.reference_attention, "reference"))
    return launched


def _generate_counting(monkeypatch, route):
    """Serve two requests (20 and 10 tokens; chunks of 22 rows: 20 + 2 rows of two requests, 16 grouped + 6
    xqa with the grouping threshold lowered to 16 rows, then 8 xqa; 2 decode steps) on a 2-layer model;
    returns the result and the kernels launched in each step."""
    from collections import Counter

    from qsa.model.tiny import TinyConfig, TinyQSAModel
    from qsa.model.serving import Engine, ServingConfig

    monkeypatch.setattr(qsa.settings, "GROUPED_MIN_ROWS", 16)
    launched = _launch_counter(monkeypatch)
    model = TinyQSAModel(TinyConfig.small(num_layers=2), device="cpu")
    engine = Engine(model, ServingConfig(num_blocks=16, block_size=16, max_reqs=2, max_blocks_per_req=6, chunk_size=22,
                                         route=route, backend="torch"))
    per_step, seen = [], Counter()

    def on_step(done, total, kind):
        per_step.append(dict(launched - seen))
        seen.update(launched - seen)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 10)]
    res = engine.generate(prompts, 3, on_step=on_step)
    return res, per_step


def tally_mismatches(res, per_step) -> list[str]:
    """Steps whose record of the routes run differs from the kernels launched in them."""
    return [f"step {i} ({s.kind}): recorded {s.routes}, launched {launched}"
            for i, (s, launched) in enumerate(zip(res.steps, per_step)) if s.routes != launched]


@pytest.mark.parametrize("route", ["auto", pytest.param("splitk", marks=pytest.mark.slow), "reference"])
def test_step_records_are_the_kernels_launched(route, monkeypatch):
    """Each step's record of its attention routes (one count per layer) is what the launchers ran."""
    res, per_step = _generate_counting(monkeypatch, route)
    assert len(per_step) == len(res.steps) == 4
    assert tally_mismatches(res, per_step) == []
    if route == "auto":
        assert [s.routes for s in res.steps] == [{"grouped": 2, "xqa": 2}, {"xqa": 2}, {"xqa": 2}, {"xqa": 2}]
        assert res.route_steps() == {"grouped": {"prefill": 1, "decode": 0}, "xqa": {"prefill": 2, "decode": 2}}
        assert qsa.cli.demo.routes_run(res) == "grouped 1 prefill step, xqa 2 prefill steps + 2 decode steps"
    else:
        assert res.route_steps() == {route: {"prefill": 2, "decode": 2}}
    assert res.backends() == {"torch"}


def test_a_tally_of_the_admitted_route_is_rejected(monkeypatch):
    """Recording the route admission named (grouped) instead of the kernels launched misses the xqa rows of
    the mixed prefill step: the check fails."""
    import qsa

    monkeypatch.setattr(qsa.model.layer, "routes_launched", lambda plan: (plan.routes.route,))
    res, per_step = _generate_counting(monkeypatch, "auto")
    assert len(tally_mismatches(res, per_step)) == 1


def test_demo_physical_order_shows_the_defect(capfd):
    """Under the interpreter: the logical plan stays bitwise equal across placements, the physical one
    does not (the grouped kernel runs: one 64-row chunk, on placements whose physical order flips a
    rounding). On a machine with a GPU the CPU demo reruns itself with the interpreter on (hence capfd)."""
    status = qsa.cli.demo.main(["--device", "cpu", "--plan-order", "physical", "--requests", "1", "--prompt-len", "64",
                        "--new-tokens", "2", "--alloc-seeds", "3", "4"])
    out = capfd.readouterr().out
    assert status == 0, out
    assert "routes run (each of runs A and B): grouped " in out
    assert "logical order, placements A vs B: bitwise equal" in out
    assert "physical order (demonstration), placements C vs D: NOT bitwise equal" in out


def test_demo_fails_on_a_placement_dependent_defect(monkeypatch, capsys):
    """A selection that (wrongly) depends on physical block ids makes the demo exit 1."""
    real = qsa.selection.api._select_tokens_torch

    def placement_dependent(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *, k):
        out = real(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, k=k)
        bs = 4 * kc_cache.shape[1]
        req = token_to_req.long().clamp(min=0)[:, None]
        page = block_table.long()[req, (out.long().clamp(min=0) // bs)]
        return torch.where((page % 3 == 0) & (out > 0), -1, out)

    monkeypatch.setattr(qsa.selection.api, "_select_tokens_torch", placement_dependent)
    status = qsa.cli.demo.main(["--device", "cpu", "--route", "reference", "--requests", "2", "--prompt-len", "40", "--new-tokens", "2",
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
    ("demo", ["--alloc-seeds", "1", "-1"], "absolute value"), ("demo", ["--alloc-seeds", "-7", "7"], "absolute value"),
    ("demo", ["--topk", str(qsa.selection.api.MAX_K + 1), "--requests", "1"], "--topk"), ("demo", ["--topk", "0"], "--topk"),
    ("demo", ["--route", "reference", "--backend", "triton"], "--backend triton"),
    ("demo", ["--backend", "cuda"], "--backend"),
    ("demo", ["--seed", str(2**64)], "--seed"), ("demo", ["--seed", str(-(2**63) - 1)], "--seed"),
    ("verify", ["--seed", str(2**64), "--route", "reference"], "--seed"),
    ("verify", ["--save", "/nonexistent/step.pt", "--route", "reference"],
     "--save /nonexistent/step.pt: no such folder"),
])
def test_cli_refuses_bad_arguments(cmd, args, match, capsys):
    with pytest.raises(SystemExit) as e:
        (qsa.cli.demo if cmd == "demo" else qsa.cli.verify).main(["--device", "cpu", *args] if "--device" not in args else args)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_every_demo_option_has_help():
    actions = [a for a in qsa.cli.demo.parser()._actions if a.dest != "help"]
    assert len(actions) >= 16
    for action in actions:
        assert action.help and len(action.help) > 10, action.option_strings


def test_demo_refuses_to_call_one_placement_independent(capsys):
    """Seeds 1 and 5 hand a single one-block request the same block: the runs compared nothing, and the
    demo says so instead of reporting placement independence."""
    status = qsa.cli.demo.main(["--device", "cpu", "--route", "reference", "--requests", "1", "--prompt-len", "1",
                        "--new-tokens", "1", "--alloc-seeds", "1", "5", "--no-warmup"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "INCONCLUSIVE" in out and "same physical blocks" in out and "OK:" not in out


def test_demo_physical_order_on_the_reference_route(capsys):
    """No Triton kernel runs on the reference route: the demo does not claim the interpreter runs them."""
    status = qsa.cli.demo.main(["--device", "cpu", "--route", "reference", "--plan-order", "physical", "--requests", "2",
                        "--prompt-len", "20", "--new-tokens", "1", "--no-warmup"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "Triton interpreter" not in out
    assert "the reference route has none" in out


def _bad_steps(tmp_path):
    """Files ``--load`` must refuse, with what its message should name."""
    good = dict(q=torch.zeros(4, 2, 16), gate=torch.zeros(4, 2, 16), iq=torch.zeros(4, 1, 16),
                kv=torch.zeros(3, 2, 16, 1, 16), kc=torch.zeros(3, 4, 16),
                block_table=torch.zeros(1, 3, dtype=torch.int32),
                token_to_req=torch.zeros(4, dtype=torch.int32), positions=torch.arange(4),
                seq_lens=torch.tensor([4], dtype=torch.int32), indices=torch.zeros(4, 7, dtype=torch.int32),
                index_topk=1)
    cases = {"text": ("not a torch file", "torch.load failed"), "tensor": (torch.zeros(3), "must be a dict"),
             "partial": ({"q": torch.zeros(3)}, "missing gate"), "extra": ({**good, "x": 1}, "unknown x"),
             "not_a_tensor": ({**good, "kv": [1, 2]}, "kv must be a torch.Tensor"),
             "rows": ({**good, "positions": torch.arange(5)}, "positions must have 4 rows"),
             "topk": ({**good, "index_topk": 1.5}, "index_topk must be an int")}
    for name, (content, match) in cases.items():
        path = tmp_path / f"{name}.pt"
        if isinstance(content, str):
            path.write_text(content)
        else:
            torch.save(content, path)
        yield str(path), match


def test_verify_load_refuses_bad_files(tmp_path, capsys):
    for path, match in _bad_steps(tmp_path):
        with pytest.raises(SystemExit) as e:
            qsa.cli.verify.main(["--device", "cpu", "--route", "reference", "--load", path])
        err = capsys.readouterr().err
        assert e.value.code == 2, path
        assert f"--load {path}" in err and match in err, err


def test_verify_physical_order_without_a_grouped_plan(capfd):
    """The reference route has no grouped plan: the physical order changes nothing there, and verify says so."""
    status = qsa.cli.verify.main(["--device", "cpu", "--route", "reference", "--plan-order", "physical", "-n", "1",
                          "--sample", "2"])
    out = capfd.readouterr().out
    assert status == 0, out
    assert "the physical order only reorders grouped plans; the reference route of this step has none" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cli_cuda_without_a_gpu(capsys):
    for module in (qsa.cli.demo, qsa.cli.verify):
        with pytest.raises(SystemExit):
            module.main(["--device", "cuda"])
        assert "no CUDA device is available" in capsys.readouterr().err


def test_progress_bar_prints_once_off_a_terminal(capsys):
    bar = qsa.cli.demo.ProgressBar("run A")
    for i in range(1, 6):
        bar.update(i, 5, "prefill")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "[" + "#" * 32 + "]" in lines[0] and "5/5" in lines[0]


def test_verify_cpu_default(capfd):
    """The CPU default (one relocation to keep the test short): every check passes, the graph check is
    skipped on the CPU, and both the grouped and the single-row route ran."""
    status = qsa.cli.verify.main(["--device", "cpu", "-n", "1"])
    out = capfd.readouterr().out
    assert status == 0, out
    assert "72 rows grouped + 4 single-row" in out
    for line in ("repeat", "relocation (permutation)", "permuted index order", "fp64 reference"):
        assert any(row.startswith(line) and " ok " in row for row in out.splitlines()), line
    assert any(row.startswith("cuda graph replay") and "skipped" in row for row in out.splitlines())


def test_verify_save_load_and_exit_status(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "step.pt")
    cpu_ref = ["--device", "cpu", "--route", "reference"]
    assert qsa.cli.verify.main([*cpu_ref, "--save", path, "-n", "2"]) == 0
    assert qsa.cli.verify.main([*cpu_ref, "--load", path, "-n", "3"]) == 0
    assert "loaded from" in capsys.readouterr().out

    real = qsa.cli.verify._attend

    def placement_dependent(step, kv, table, indices, route, order="logical", max_query_len=None):
        out, lse = real(step, kv, table, indices, route, order, max_query_len)
        return out + table[0, 0].to(out.dtype), lse

    monkeypatch.setattr(qsa.cli.verify, "_attend", placement_dependent)
    assert qsa.cli.verify.main([*cpu_ref, "--load", path, "-n", "3"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "out differ" in out


def test_verify_catches_the_physical_order(device):
    """fp16 data (rounding flips show more often than in bf16): with the physical-order plan a
    relocation changes the bits, and the verifier says so."""
    step = qsa.cli.verify.capture_step("cpu").to(device)
    step.q, step.gate, step.kv = step.q.half(), step.gate.half(), step.kv.half()
    v = qsa.cli.verify.Verifier(step, route="auto", plan_order="physical", sample=2, log=lambda *_: None)
    checks = v.relocations(1)
    assert checks[0].status == "FAIL" and "out" in checks[0].detail


def _rows_of(step, rows):
    """Rows ``rows`` of a captured step as a step of their own: the same caches, table and lengths."""
    return dataclasses.replace(step, q=step.q[rows], gate=step.gate[rows], iq=step.iq[rows],
                               token_to_req=step.token_to_req[rows], positions=step.positions[rows],
                               indices=step.indices[rows])


def test_verify_batch_invariance(monkeypatch):
    """``--route invariant``: the step's rows in sub-batches (reversed, half, alone) give the whole step's bits;
    a batch-dependent attention fails the check; other routes skip it (they promise a fixed batch shape's
    bits only). The step is 12 rows spread over the captured one (both requests, first and last rows)."""
    full = qsa.cli.verify.capture_step("cpu")
    step = _rows_of(full, torch.linspace(0, full.rows - 1, 12).round().long())
    assert step.rows == 12 and len(set(step.token_to_req.tolist())) == 2
    v = qsa.cli.verify.Verifier(step, route="invariant", sample=2, log=lambda *_: None)
    c = v.batch_invariance()
    assert (c.status, c.runs) == ("ok", 4), c.detail
    base = (v.base_out, v.base_lse)
    monkeypatch.setattr(qsa.cli.verify, "_attend_rows", lambda step, rows, route: (
        base[0][rows] + (len(rows) == 1), base[1][rows]))  # a row alone computed otherwise
    c = v.batch_invariance()
    assert c.status == "FAIL" and "alone" in c.detail
    assert qsa.cli.verify.Verifier(step, route="reference", sample=2, log=lambda *_: None).batch_invariance().skipped


@pytest.mark.gpu
def test_gpu_demo_and_verify(capsys):
    """On a GPU: the reference-shape demo with CUDA-graph decode, and verify with graph replays."""
    assert qsa.cli.demo.main(["--layers", "2", "--requests", "3", "--prompt-len", "3000", "--new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "bitwise equal" in out
    lens = [len(p) for p in qsa.cli.demo._prompts(3, 3000, 4096, 0)]
    check_kernels_ran(out, lens, qsa.cli.demo.GPU_DEFAULTS["chunk"], 16)  # decode steps replayed from a CUDA graph
    assert qsa.cli.verify.main(["-n", "6"]) == 0
    out = capsys.readouterr().out
    assert any(row.startswith("cuda graph replay") and " ok " in row for row in out.splitlines())
    assert qsa.cli.verify.main(["-n", "2", "--route", "invariant"]) == 0
    out = capsys.readouterr().out
    for check in ("cuda graph replay", "batch invariance"):
        assert any(row.startswith(check) and " ok " in row for row in out.splitlines()), check
