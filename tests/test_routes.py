"""Route admission where the Triton kernels cannot run: the interpreter's probe against NumPy, the notice
``route="auto"`` logs once when it falls back, and the ValueError of a forced route."""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import qsa
import qsa.attention.routing
import qsa.backend
import qsa.utils
from helpers import make_attention_case

CPU = torch.device("cpu")
BROKEN = ("the Triton interpreter cannot run qsa's kernels with numpy 9.9 with triton 9.9 (InterpreterError: "
          "TypeError('only 0-dimensional arrays can be converted to Python scalars')); NumPy 2.4 and newer "
          "break it: pip install 'numpy<2.4'")

needs_interpreter = pytest.mark.skipif(not qsa.utils.interpreter_enabled(),
                                       reason="the probe runs under the Triton interpreter")


@pytest.fixture
def fresh_notices(monkeypatch, caplog):
    """No notice logged yet in this process; WARNING records of the ``qsa`` logger captured."""
    monkeypatch.setattr(qsa.backend, "_logged", set())
    caplog.set_level(logging.WARNING, logger="qsa")
    return caplog


def notices(caplog) -> list[str]:
    """The WARNING (or louder) messages of the ``qsa`` logger: what a user sees without configuring logging."""
    return [r.getMessage() for r in caplog.records if r.name == "qsa" and r.levelno >= logging.WARNING]


def _case(head_dim=16):
    case = make_attention_case(rows=4, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=head_dim, width=8,
                               seed=3)
    args = (case.q, case.cache.k, case.cache.v, case.indices, case.block_table, case.token_to_req,
            case.positions, case.seq_lens)
    return args


def _numpy_24_interpreter(monkeypatch):
    """Make the interpreter turn tensors into loop bounds as it does under NumPy 2.4: ``int()`` of a
    1-element array that is not 0-dimensional raises TypeError."""
    from triton.runtime import interpreter

    real = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        real(tensor, scope)

        def index(self):
            data = self.handle.data
            if np.ndim(data):
                raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
            return int(data)

        scope.set_attr(tensor, "__index__", index)

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


# ----------------------------------------------------------------------------------------------
# the interpreter's probe


@needs_interpreter
def test_probe_passes_with_this_numpy():
    assert qsa.backend.interpreter_problem() is None
    assert qsa.backend.triton_available(CPU) is None
    hits = qsa.backend.interpreter_problem.cache_info().hits
    qsa.backend.triton_available(CPU)
    assert qsa.backend.interpreter_problem.cache_info().hits == hits + 1  # run once, then cached


@needs_interpreter
def test_probe_detects_an_interpreter_numpy_breaks(monkeypatch):
    """Under the NumPy 2.4 behaviour the probe names both versions and the fix; a real kernel (xqa, whose
    loop bounds come from memory) fails the same way, so the probe stands for the kernels."""
    import triton

    _numpy_24_interpreter(monkeypatch)
    probe = qsa.backend.interpreter_problem.__wrapped__  # uncached: this process's answer stays cached
    problem = probe()
    assert problem is not None
    assert f"numpy {np.__version__}" in problem and f"triton {triton.__version__}" in problem
    assert "pip install 'numpy<2.4'" in problem and "0-dimensional" in problem
    # Without the probe (the interpreter taken to work) the forced route fails deep in a kernel.
    monkeypatch.setattr(qsa.backend, "interpreter_problem", lambda: None)
    with pytest.raises(Exception, match="0-dimensional") as e:
        qsa.sparse_paged_attention(*_case(), route="xqa")
    assert not isinstance(e.value, ValueError)
    # With it, admission refuses the forced route before any kernel, naming the fix.
    monkeypatch.setattr(qsa.backend, "interpreter_problem", probe)
    with pytest.raises(ValueError, match=r"route='xqa' cannot run: .*pip install 'numpy<2.4'"):
        qsa.sparse_paged_attention(*_case(), route="xqa")


def test_probe_only_under_the_interpreter(monkeypatch):
    """Without the interpreter no probe kernel is defined or run: a CPU simply has no Triton backend."""
    def no_probe():
        raise AssertionError("the probe ran without the interpreter")

    monkeypatch.setattr(qsa.backend, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(qsa.backend, "interpreter_problem", no_probe)
    why = qsa.backend.triton_available(CPU)
    assert why.startswith("no Triton backend for device cpu") and "TRITON_INTERPRET=1" in why


def test_a_broken_interpreter_sends_auto_to_the_reference(monkeypatch, fresh_notices):
    """A failed probe: ``auto`` runs the reference (same bits as route="reference") with the notice naming
    the fix, selection and cache writes take PyTorch, and forced routes raise ValueError."""
    monkeypatch.setattr(qsa.backend, "interpreter_enabled", lambda: True)
    monkeypatch.setattr(qsa.backend, "interpreter_problem", lambda: BROKEN)
    assert qsa.backend.triton_available(CPU) == BROKEN
    args = _case()
    out = qsa.sparse_paged_attention(*args, route="auto")
    assert torch.equal(out.view(torch.int16), qsa.sparse_paged_attention(*args, route="reference").view(torch.int16))
    assert notices(fresh_notices) == [f"qsa: route 'auto' falls back to the PyTorch reference attention: {BROKEN}"]
    assert qsa.backend.kernel_backend("auto", CPU) == "torch"
    for route in ("grouped", "xqa", "splitk", "invariant"):
        with pytest.raises(ValueError, match=r"cannot run: .*pip install 'numpy<2.4'"):
            qsa.sparse_paged_attention(*args, route=route)
    with pytest.raises(ValueError, match="pip install 'numpy<2.4'"):
        qsa.backend.resolve_backend("triton", CPU)


# ----------------------------------------------------------------------------------------------
# the fallback notice


def test_cpu_without_the_interpreter_notice_once(monkeypatch, fresh_notices):
    monkeypatch.setattr(qsa.backend, "interpreter_enabled", lambda: False)
    for _ in range(3):
        assert qsa.attention.routing.choose("auto", rows=4, G=2, head_dim=64, device=CPU).route == "reference"
    msgs = notices(fresh_notices)
    assert len(msgs) == 1, msgs
    assert "falls back to the PyTorch reference" in msgs[0] and "no Triton backend for device cpu" in msgs[0]
    assert "set TRITON_INTERPRET=1 before importing qsa" in msgs[0] and "interpreter" in msgs[0]
    with pytest.raises(ValueError, match="route='grouped' cannot run: no Triton backend"):
        qsa.attention.routing.choose("grouped", rows=4, G=2, head_dim=64, device=CPU)
    assert len(notices(fresh_notices)) == 1  # a forced route raises, it logs nothing


@pytest.mark.parametrize("head_dim", [48, 512, 8])
def test_head_dim_no_kernel_takes(head_dim, monkeypatch, fresh_notices):
    monkeypatch.setattr(qsa.backend, "triton_available", lambda device: None)  # as on a GPU
    for _ in range(2):
        assert qsa.attention.routing.choose("auto", rows=64, G=2, head_dim=head_dim, device=CPU).route == "reference"
    assert notices(fresh_notices) == [f"qsa: route 'auto' falls back to the PyTorch reference attention: no "
                                      f"Triton kernel takes head_dim {head_dim} (they take {qsa.attention.routing.HEAD_DIMS})"]
    for route in ("grouped", "xqa", "splitk", "invariant"):
        with pytest.raises(ValueError, match="head_dim must be one of"):
            qsa.attention.routing.choose(route, rows=64, G=2, head_dim=head_dim, device=CPU)
    assert len(notices(fresh_notices)) == 1


def test_page4_refusal_notice(monkeypatch, fresh_notices):
    monkeypatch.setattr(qsa.backend, "triton_available", lambda device: None)
    G = 2 * qsa.attention.routing.MAX_TILE_ROWS
    for _ in range(2):
        assert qsa.attention.routing.choose("auto", rows=64, G=G, head_dim=64, device=CPU).route == "splitk"
    msgs = notices(fresh_notices)
    assert len(msgs) == 1 and "takes splitk, not the page4 routes" in msgs[0] and "heads per tile" in msgs[0]
    for route in ("grouped", "xqa"):
        with pytest.raises(ValueError, match="heads per tile"):
            qsa.attention.routing.choose(route, rows=64, G=G, head_dim=64, device=CPU)
    # a second distinct reason gets its own notice, once
    qsa.attention.routing.choose("auto", rows=64, G=2, head_dim=48, device=CPU)
    qsa.attention.routing.choose("auto", rows=64, G=2, head_dim=48, device=CPU)
    assert len(notices(fresh_notices)) == 2


def test_an_info_level_notice_is_not_seen(monkeypatch, fresh_notices):
    """The notice's check rejects the former INFO-level log, which nobody sees without configuring logging."""
    def info_log_once(message):
        if message not in qsa.backend._logged:
            qsa.backend._logged.add(message)
            qsa.backend.logger.info(message)

    monkeypatch.setattr(qsa.backend, "log_once", info_log_once)
    monkeypatch.setattr(qsa.backend, "interpreter_enabled", lambda: False)
    qsa.attention.routing.choose("auto", rows=4, G=2, head_dim=64, device=CPU)
    assert notices(fresh_notices) == []


def test_notice_printed_without_logging_configured():
    """A library user on a CPU, nothing configured: the notice reaches stderr, once for two calls."""
    code = ("import torch, qsa\n"
            "from helpers import make_attention_case\n"
            "c = make_attention_case(rows=4, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=8, seed=3)\n"
            "for _ in range(2):\n"
            "    qsa.sparse_paged_attention(c.q, c.cache.k, c.cache.v, c.indices, c.block_table, c.token_to_req,\n"
            "                               c.positions, c.seq_lens)\n"
            "print('ran')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.abspath(__file__)))  # helpers.py
    assert res.returncode == 0 and res.stdout.strip() == "ran", res.stderr
    if torch.cuda.is_available():
        return  # the GPU takes the kernels: no notice
    lines = [line for line in res.stderr.splitlines() if "falls back to the PyTorch reference" in line]
    assert len(lines) == 1, res.stderr
    assert "set TRITON_INTERPRET=1 before importing qsa" in lines[0]
