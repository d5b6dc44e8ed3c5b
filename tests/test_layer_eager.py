"""The QSA layer's eager and compiled steps: replayed launches give the bits of the full path, and the
compressed-key update keeps skipping its sorts for ordered rows under ``torch.compile`` but never inside a
captured CUDA graph."""

import pytest
import torch

import qsa.selection.api
from qsa import settings
from qsa.attention import replay
from qsa.model import kernels, ops
from qsa.model.layer import QSAAttention, QSAConfig
from qsa.model.serving import run_layer

TINY = QSAConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8, index_heads=4,
                 index_head_dim=16, index_rotary_dim=8, index_topk=4, rope_theta=10000.0)


def inputs(seed, lens, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(L, TINY.hidden_size, generator=g).to(torch.bfloat16).to(device) for L in lens]


@pytest.fixture
def update_flags(monkeypatch):
    """The ``rows_ordered`` of every compressed-key update the steps make."""
    flags = []
    real = qsa.selection.api.update_compressed_keys

    def spy(*a, **kw):
        flags.append(kw.get("rows_ordered"))
        return real(*a, **kw)

    monkeypatch.setattr(qsa.selection.api, "update_compressed_keys", spy)
    return flags


def test_replayed_eager_steps_give_the_full_paths_bits(device, monkeypatch):
    """Every eager step twice over the same inputs, replays on and off: the same outputs, bit for bit, and
    the layer's norm and RoPE served by a replay (the interpreter's replays on the CPU)."""
    monkeypatch.setattr(replay, "ON_INTERPRETER", True)
    layer = QSAAttention(TINY, seed=3, device=device)
    xs = inputs(4, (11, 6), device)
    run = dict(chunk_size=8, decode_tokens=2, block_size=8, route="auto")
    monkeypatch.setattr(settings, "REPLAY_STEPS", False)
    want, _, _ = run_layer(layer, xs, **run, allocator_seed=1)
    monkeypatch.setattr(settings, "REPLAY_STEPS", True)
    kernels._NORM_ROPES.clear()
    got, _, _ = run_layer(layer, xs, **run, allocator_seed=2)
    assert kernels._NORM_ROPES.hits > 0, "no step's norm and RoPE was replayed"
    assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_step_passes_its_row_order(update_flags):
    """Under torch.compile (aot_eager) ordered steps skip the key sorts as eager ones do, steps with
    padding rows sort, and every output is bitwise the eager layer's."""
    layer = QSAAttention(TINY, seed=5)
    xs = inputs(6, (13, 5))
    run = dict(chunk_size=8, decode_tokens=2, block_size=8, route="reference")
    for pad_rows in (0, 2):
        eager, _, _ = run_layer(layer, xs, **run, pad_rows=pad_rows)
        eager_flags = list(update_flags)
        update_flags.clear()
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        got, _, _ = run_layer(compiled, xs, **run, pad_rows=pad_rows)
        assert update_flags == eager_flags, f"pad_rows={pad_rows}: {update_flags} against eager {eager_flags}"
        assert all(eager_flags) if pad_rows == 0 else not any(eager_flags)
        update_flags.clear()
        assert torch.equal(got, eager)


@pytest.mark.gpu
def test_gpu_a_captured_update_sorts(update_flags):
    """Inside CUDA-graph capture the update's implementation drops ``rows_ordered``: the graph may be
    replayed with rows in another order. Outside it the flag is passed on."""
    c = QSAConfig()
    layer = QSAAttention(c, seed=0, device="cuda")
    cache = layer.allocate_cache(16, 64, 2)
    rows = 8
    raw_k = torch.randn(rows, c.index_head_dim, dtype=c.dtype, device="cuda")
    req = torch.tensor([0] * 4 + [1] * 4, dtype=torch.int32, device="cuda")
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3], device="cuda")
    table = torch.arange(16, dtype=torch.int32, device="cuda").reshape(2, 8)
    args = (raw_k, req, pos, cache.kc, table, cache.partial, layer.index_k_norm, c.rms_norm_eps, c.index_rotary_dim,
            c.rope_theta, "triton", 64, None, None, True, None, None)
    ops.update_compressed_keys_impl(*args)
    ops.update_compressed_keys_impl(*args[:-3], False, None, None)  # the sorting path, compiled before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.update_compressed_keys_impl(*args)
    assert update_flags == [True, False, False], "the captured call skipped the sorts"
