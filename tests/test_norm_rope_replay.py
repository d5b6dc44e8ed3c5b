"""Replayed eager calls of the layer's fused norm and RoPE (``qsa.model.kernels.norm_rope``): the second call
of a fingerprint launches what the first recorded.

A replay must give the bits of the full path on the same inputs, with every input a new tensor at a new
address; arguments that share an address (the layer passes one RoPE table for q, k and the index queries
where their widths agree) must be served by the fingerprint of that sharing only; a call of another shape,
``eps`` or dtype, or with bad input, takes the full path and its checks. On the CPU the replays run under
the Triton interpreter (``replay.ON_INTERPRETER``).
"""

import pytest
import torch

import qsa.backend
from qsa import settings
from qsa.attention import replay
from qsa.model import kernels
from qsa.model.functional import apply_rope, rms_norm, rope_cos_sin
from qsa.model.kernels import norm_rope

EPS = 1e-6


@pytest.fixture(autouse=True)
def replays_on(monkeypatch):
    monkeypatch.setattr(replay, "ON_INTERPRETER", True)
    monkeypatch.setattr(settings, "REPLAY_STEPS", True)
    kernels._NORM_ROPES.clear()
    yield
    kernels._NORM_ROPES.clear()


def case(seed, device, *, shared_tables=False, dtype=torch.bfloat16, rows=5):
    """norm_rope's arguments as the layer passes them (q a strided view of ``qg``), new tensors with new
    values for every seed; with ``shared_tables`` the index queries take q's RoPE tables themselves."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, hi, di = 2, 1, 16, 2, 16 if shared_tables else 8
    positions = torch.randint(0, 5000, (rows,), generator=g)
    cos, sin = rope_cos_sin(positions, 8, 10_000.0)
    icos, isin = (cos, sin) if shared_tables else rope_cos_sin(positions, 4, 10_000.0)
    qg = (torch.randn(rows, hq, 2 * d, generator=g) * 2).to(dtype)
    a = dict(q=qg[..., :d], q_weight=torch.randn(d, generator=g) * 0.1, k=torch.randn(rows, hkv, d, generator=g).to(dtype),
             k_weight=torch.randn(d, generator=g) * 0.1, iq=torch.randn(rows, hi, di, generator=g).to(dtype),
             iq_weight=torch.randn(di, generator=g) * 0.1, cos=cos, sin=sin, icos=icos, isin=isin)
    moved = {}
    for name, t in a.items():  # one move per tensor, so that shared tables stay one tensor
        moved[name] = next((moved[n] for n in moved if a[n] is t), None)
        if moved[name] is None:
            moved[name] = t.to(device)
    moved["eps"] = EPS
    return moved


def full_path(a):
    """The bits of the full path (no replay) on ``a``."""
    return kernels._norm_rope_full(*kernels._arguments(tuple(a[n] for n in kernels._NAMES)), a["eps"])[0]


def entries():
    return list(kernels._NORM_ROPES.entries.values())


@pytest.mark.parametrize("shared_tables", [False, True])
def test_a_replay_gives_the_full_paths_bits(device, shared_tables):
    first = case(1, device, shared_tables=shared_tables)
    norm_rope(**first)
    assert len(entries()) == 1 and isinstance(entries()[0], replay.Replay), "the first call recorded no replay"
    second = case(2, device, shared_tables=shared_tables)  # the first case stays alive: new addresses
    got = norm_rope(**second)
    assert kernels._NORM_ROPES.hits == 1, "the second call was not replayed"
    want = full_path(second)
    for g, w in zip(got, want):
        assert g.is_contiguous() and torch.equal(g, w)
    # and the composition it stands for (one ulp apart at most where a sum of squares rounds otherwise)
    for g, x, w, c, s in zip(got, ("q", "k", "iq"), ("q_weight", "k_weight", "iq_weight"), ("cos", "cos", "icos"),
                             ("sin", "sin", "isin")):
        torch.testing.assert_close(g, apply_rope(rms_norm(second[x], second[w], EPS), second[c], second[s]),
                                   rtol=2 ** -7, atol=2 ** -7)


def test_a_stale_input_is_caught(device):
    """Known-wrong: a replay that launches the recorded address of q (or of the shared table) gives the
    first call's values, which the comparison above rejects."""
    for name in ("q", "cos"):
        kernels._NORM_ROPES.clear()
        first = case(1, device, shared_tables=True)
        norm_rope(**first)
        (step,) = entries()
        step.drop_input(name)
        second = case(2, device, shared_tables=True)
        got = norm_rope(**second)
        assert kernels._NORM_ROPES.hits == 1
        assert not all(torch.equal(g, w) for g, w in zip(got, full_path(second))), f"a stale {name} passes"


def test_another_sharing_of_addresses_is_another_fingerprint(device):
    """Tables recorded shared, then passed apart with the same shapes (and back): each call gets its own
    tables' values."""
    shared = case(1, device, shared_tables=True)
    norm_rope(**shared)
    apart = case(2, device, shared_tables=True)
    apart["icos"], apart["isin"] = apart["cos"].clone() * 0.5, apart["sin"].clone()
    got = norm_rope(**apart)
    assert kernels._NORM_ROPES.hits == 0 and len(entries()) == 2
    for g, w in zip(got, full_path(apart)):
        assert torch.equal(g, w)
    again = case(3, device, shared_tables=True)
    got = norm_rope(**again)
    assert kernels._NORM_ROPES.hits == 1
    for g, w in zip(got, full_path(again)):
        assert torch.equal(g, w)


def test_other_calls_take_the_full_path(device):
    """Another eps, dtype or row count is recorded apart; bad input after a replayed shape still raises
    the full path's error; no rows and the PyTorch path are never replayed."""
    norm_rope(**case(1, device))
    other_eps = dict(case(2, device), eps=1e-5)
    got = norm_rope(**other_eps)
    assert kernels._NORM_ROPES.hits == 0
    for g, w in zip(got, full_path(other_eps)):
        assert torch.equal(g, w)
    norm_rope(**case(3, device, dtype=torch.float16))
    norm_rope(**case(4, device, rows=3))
    assert kernels._NORM_ROPES.hits == 0 and len(entries()) == 4

    bad = case(5, device)
    bad["k_weight"] = bad["k_weight"][:8]
    with pytest.raises(ValueError, match="k_weight"):
        norm_rope(**bad)
    with pytest.raises(ValueError, match="eps"):
        norm_rope(**dict(case(6, device), eps=-1.0))

    kernels._NORM_ROPES.clear()
    none = case(7, device, rows=0)
    norm_rope(**none)
    norm_rope(**none)
    assert entries() == [None]


def test_the_pytorch_path_is_not_recorded(device, monkeypatch):
    monkeypatch.setattr(qsa.backend, "triton_available", lambda device: "no Triton here (test)")
    a = case(1, device)
    for _ in range(2):
        got = norm_rope(**a)
    assert entries() == [None]
    for g, x, w, c, s in zip(got, ("q", "k", "iq"), ("q_weight", "k_weight", "iq_weight"), ("cos", "cos", "icos"),
                             ("sin", "sin", "isin")):
        assert torch.equal(g, apply_rope(rms_norm(a[x], a[w], EPS), a[c], a[s]))
