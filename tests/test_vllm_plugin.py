"""qsa.integrations.vllm_plugin against a stand-in of vLLM's module tree (fake modules put in sys.modules):
off unless QSA_VLLM asks; on, vLLM's op replaced in its module and where a model module bound it, the
first-call notice logged once per process; vLLM absent, nothing happens and nothing raises. A plugin that
ignores the variable fails ``test_off_by_default_nothing_swapped``."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import qsa
from qsa.integrations import vllm as qv
from qsa.integrations import vllm_plugin as plugin

LOGGER = "qsa.integrations.vllm_plugin"
NOTICE = "serves vLLM's QSA attention op"


def vllm_op(*args, **kwargs):
    """Stands for vLLM's op: records that it ran."""
    vllm_op.calls += 1
    return "vllm"


vllm_op.calls = 0


class FakeVllm:
    """A stand-in of the vLLM 0.33.0 modules the plugin meets: the op module, a model module that bound the
    name at import (``bound``), and vLLM's real model module, which imports it inside the method (``lazy``)."""

    def __init__(self, monkeypatch, *, with_model=True):
        names = ["vllm", "vllm.models"]
        if with_model:
            names += ["vllm.models.qwen4_exp", "vllm.models.qwen4_exp.nvidia", "vllm.models.qwen4_exp.nvidia.ops"]
        for name in names:
            mod = types.ModuleType(name)
            mod.__path__ = []  # a package
            monkeypatch.setitem(sys.modules, name, mod)
        for name in [n for n in sys.modules if n.startswith("vllm.") and n not in names]:
            monkeypatch.delitem(sys.modules, name)
        if not with_model:
            return
        self.op_module = types.ModuleType(plugin.OP_MODULE)
        self.op_module.qsa_sparse_paged_attention = vllm_op
        monkeypatch.setitem(sys.modules, plugin.OP_MODULE, self.op_module)
        self.model = types.ModuleType(plugin.MODEL_MODULE)
        self.model.qsa_sparse_paged_attention = vllm_op            # bound at import
        exec("def forward_qsa(*args, **kwargs):\n"                     # vLLM's style: imported at each call
             f"    from {plugin.OP_MODULE} import qsa_sparse_paged_attention\n"
             "    return qsa_sparse_paged_attention(*args, **kwargs)\n", self.model.__dict__)
        monkeypatch.setitem(sys.modules, plugin.MODEL_MODULE, self.model)
        monkeypatch.setattr(plugin, "_first_call_logged", False)


@pytest.fixture
def fake_vllm(monkeypatch):
    return FakeVllm(monkeypatch)


def tiny_call():
    """vLLM's arguments for 2 rows (fp16, D 16, page 4, one request of 8 tokens; row 1 has count 0)."""
    g = torch.Generator().manual_seed(0)
    server = torch.randn(3, 1, 4, 32, generator=g).half()          # [num_blocks, Hkv, page, 2*D]
    k, v = server.transpose(1, 2).split(16, dim=-1)
    logical = torch.tensor([[0, 1, 2, 3, 4, 5, -1, -1, 6], [0, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    q = torch.randn(2, 2, 16, generator=g).half()
    return (q, k, v, logical, torch.tensor([[2, 1]], dtype=torch.int32), torch.zeros(2, dtype=torch.int32), False), \
        dict(output_gate=torch.randn(2, 2, 16, generator=g).half())


def check_off(fake_vllm, monkeypatch):
    """With QSA_VLLM unset or not true, register() leaves vLLM's op in both places."""
    for value in (None, "", "0", "false", "no", "off"):
        if value is None:
            monkeypatch.delenv(plugin.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(plugin.ENV_VAR, value)
        plugin.register()
        assert fake_vllm.op_module.qsa_sparse_paged_attention is vllm_op, f"swapped with {plugin.ENV_VAR}={value!r}"
        assert fake_vllm.model.qsa_sparse_paged_attention is vllm_op, f"swapped with {plugin.ENV_VAR}={value!r}"


def test_off_by_default_nothing_swapped(fake_vllm, monkeypatch):
    check_off(fake_vllm, monkeypatch)


def test_the_off_check_catches_a_plugin_that_ignores_the_variable(fake_vllm, monkeypatch):
    """Known-wrong variant: a plugin that swaps whatever the variable says fails the check above."""
    monkeypatch.setattr(plugin, "enabled", lambda: True)
    with pytest.raises(AssertionError, match="swapped with"):
        check_off(fake_vllm, monkeypatch)
    plugin.unregister()


@pytest.mark.parametrize("value", ["1", "true", "ON"])
def test_on_swaps_both_places_and_logs_once(fake_vllm, monkeypatch, caplog, value):
    calls = []

    def adapter(*args, **kwargs):
        calls.append((args, kwargs))
        return "qsa"

    monkeypatch.setattr(qv, "qsa_sparse_paged_attention", adapter)  # the drop-in, recorded
    monkeypatch.setenv(plugin.ENV_VAR, value)
    plugin.register()
    plugin.register()  # vLLM may load plugins twice in a process: still one layer
    served = fake_vllm.op_module.qsa_sparse_paged_attention
    assert served is not vllm_op and served._qsa_serves_vllm
    assert fake_vllm.model.qsa_sparse_paged_attention is served
    assert served.vllm_op is vllm_op and served.qsa_op is adapter

    args, kw = tiny_call()
    before = vllm_op.calls
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(3):
            assert served(*args, **kw) == "qsa"                                      # the op module's name
            assert fake_vllm.model.forward_qsa(*args, **kw) == "qsa"                 # vLLM's call site
            assert fake_vllm.model.qsa_sparse_paged_attention(*args, **kw) == "qsa"  # a name bound at import
    assert vllm_op.calls == before, "vLLM's op ran although qsa serves it"
    assert len(calls) == 9
    a, k = calls[0]
    assert a[:7] == args and a[7:] == (None, None, None) and k == kw  # vLLM's arguments as they came
    notices = [r for r in caplog.records if r.name == LOGGER and NOTICE in r.getMessage()]
    assert len(notices) == 1, [r.getMessage() for r in caplog.records]
    msg = notices[0].getMessage()
    assert notices[0].levelno == logging.INFO and f"qsa {qsa.__version__}" in msg and "2 rows" in msg
    assert "route" in msg and "use_prefill_config=False" in msg


def test_unregister_puts_vllm_back(fake_vllm, monkeypatch):
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    assert fake_vllm.model.qsa_sparse_paged_attention is not vllm_op
    plugin.unregister()
    assert fake_vllm.op_module.qsa_sparse_paged_attention is vllm_op
    assert fake_vllm.model.qsa_sparse_paged_attention is vllm_op
    plugin.unregister()  # nothing registered: nothing happens


def test_served_call_equals_the_adapter(fake_vllm, monkeypatch, caplog):
    """The replacement computes what qsa's drop-in computes, bit for bit (CPU: the interpreter or the
    reference), and names the route in its notice."""
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    args, kw = tiny_call()
    want = qv.qsa_sparse_paged_attention(*args, **kw)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = fake_vllm.model.forward_qsa(*args, **kw)
    assert torch.equal(got, want)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # count 0: nothing attended
    (notice,) = [r.getMessage() for r in caplog.records if r.name == LOGGER and NOTICE in r.getMessage()]
    assert "xqa" in notice or "reference" in notice, notice


class NoVllm:
    """An import hook that finds no ``vllm``, as where vLLM is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_vllm_absent_no_error(monkeypatch, caplog):
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NoVllm(), *sys.meta_path])
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        plugin.register()
    assert "vllm" not in sys.modules
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("cannot be imported" in r.getMessage() for r in caplog.records)


def test_model_absent_no_error(monkeypatch, caplog):
    """vLLM without the qwen4_exp model (older or newer vLLM): nothing to replace, no error."""
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    FakeVllm(monkeypatch, with_model=False)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        plugin.register()
    assert plugin.OP_MODULE not in sys.modules
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("cannot be imported" in r.getMessage() for r in caplog.records)


def test_a_failing_op_module_leaves_vllm_alone(monkeypatch, caplog):
    """An op module that raises on import (not ImportError) is reported, never raised."""
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    FakeVllm(monkeypatch, with_model=False)

    def boom(name, *a, **k):
        raise RuntimeError("platform not ready")

    monkeypatch.setattr(plugin.importlib, "import_module", boom)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        plugin.register()
    assert any("platform not ready" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_importing_the_plugin_never_imports_vllm():
    code = ("import sys, qsa.integrations.vllm_plugin as p; assert callable(p.register); "
            "assert not [n for n in sys.modules if n == 'vllm' or n.startswith('vllm.')], 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_entry_point_is_declared():
    """pyproject.toml declares register() in vLLM's plugin group (the installed metadata may predate it)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    meta = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    group = meta["project"]["entry-points"]["vllm.general_plugins"]
    assert group == {"qsa": "qsa.integrations.vllm_plugin:register"}
    mod, func = group["qsa"].split(":")
    assert getattr(importlib.import_module(mod), func) is plugin.register


def test_notice_printed_once_in_a_fresh_process():
    """In a process with no logging configured (as vLLM's workers, which configure only the ``vllm`` logger),
    the first-call notice reaches stderr, once, over several calls."""
    code = f"""
import sys, types, torch
for name in ("vllm", "vllm.models", "vllm.models.qwen4_exp", "vllm.models.qwen4_exp.nvidia",
             "vllm.models.qwen4_exp.nvidia.ops"):
    m = types.ModuleType(name); m.__path__ = []; sys.modules[name] = m
op = types.ModuleType("{plugin.OP_MODULE}")
op.qsa_sparse_paged_attention = lambda *a, **k: "vllm"
sys.modules[op.__name__] = op
import qsa.integrations.vllm_plugin as p
p.register()
g = torch.Generator().manual_seed(0)
server = torch.randn(3, 1, 4, 32, generator=g).half()
k, v = server.transpose(1, 2).split(16, dim=-1)
logical = torch.tensor([[0, 1, 2, 3, 4, 5, -1, -1, 6]], dtype=torch.int32)
q = torch.randn(1, 2, 16, generator=g).half()
for _ in range(3):
    out = op.qsa_sparse_paged_attention(q, k, v, logical, torch.tensor([[2, 1]], dtype=torch.int32),
                                        torch.zeros(1, dtype=torch.int32), False,
                                        output_gate=torch.zeros(1, 2, 16).half())
    assert isinstance(out, torch.Tensor) and torch.isfinite(out).all()
print("done")
"""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[plugin.ENV_VAR] = "1"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "done"
    lines = [line for line in res.stderr.splitlines() if NOTICE in line]
    assert len(lines) == 1 and lines[0].startswith("INFO") and "[qsa]" in lines[0], res.stderr
