"""The QSA layer: projections, norms, RoPE, selection, cache writes, gated sparse attention, o_proj.

Tiny shapes on the CPU (the Triton kernels under the interpreter); the layer is driven over chunked
prefill and decode steps by :func:`qsa.model.serving.run_layer` and checked against an fp64 whole-sequence
reference, the loop reference of the selection, and itself on other page placements.
"""

import copy
from dataclasses import replace

import pytest
import torch

import qsa
import qsa.model.serving
import qsa.selection.reference
from qsa.selection.api import select_tokens
from qsa.model.functional import apply_rope, index_key_transform, rms_norm, rope_cos_sin
from qsa.model.layer import QSAAttention, QSAConfig, StepMetadata
from qsa.model.reference import layer_reference
from qsa.attention.reference import rounding_floor
from qsa.model.serving import run_layer
from qsa.model.tp import shard_heads, TPInfo

TINY = QSAConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8, index_heads=4,
                 index_head_dim=16, index_rotary_dim=8, index_topk=4, rope_theta=10000.0)
LENS = (29, 18)
RUN = dict(chunk_size=13, decode_tokens=2, block_size=8, pad_rows=1)


def inputs(seed=0, lens=LENS, hidden=TINY.hidden_size, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(L, hidden, generator=g).to(dtype).to(device) for L in lens]


def check_against_reference(layer, xs, out, indices, *, name="layer"):
    """``|out - fp64| <= 2 * |PyTorch bf16 - fp64| + floor`` (max norms), given the selection."""
    x = torch.cat(xs)
    lens = [t.shape[0] for t in xs]
    ref = layer_reference(layer, x, lens, indices)
    low = layer_reference(layer, x, lens, indices, compute_dtype=x.dtype)
    err = float((out.double() - ref).abs().max())
    torch_err = float((low.double() - ref).abs().max())
    bound = 2 * torch_err + rounding_floor(ref, out.dtype)
    assert err <= bound, f"{name}: max abs error {err:.3e} > bound {bound:.3e} (torch {torch_err:.3e})"
    return err, bound


def gather_indices(steps, total_rows):
    """Each output row's selection, from the steps' captures."""
    width = steps[0]["indices"].shape[1]
    idx = torch.full((total_rows, width), -1, dtype=torch.int32)
    for s in steps:
        idx[s["rows"]] = s["indices"][:len(s["rows"])].cpu()
    return idx


# ---------------------------------------------------------------------------------------------
# pieces


def test_default_config_is_the_reference_shape():
    c = QSAConfig()
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) == (2560, 24, 2, 256, 64)
    assert (c.index_heads, c.index_head_dim, c.index_topk, c.index_width) == (4, 128, 512, 2051)
    with pytest.raises(ValueError, match="multiple"):
        QSAConfig(num_heads=5, num_kv_heads=2)
    with pytest.raises(ValueError, match="rotary_dim"):
        QSAConfig(rotary_dim=7)
    for kw, match in (({"head_dim": 80, "rotary_dim": 16}, "head_dim must be one of"),
                      ({"index_head_dim": 96}, "index_head_dim must be a power of two"),
                      ({"index_head_dim": 8, "index_rotary_dim": 8}, "index_head_dim must be a power of two"),
                      ({"index_topk": 4096}, "index_topk must be in")):
        with pytest.raises(ValueError, match=match):
            QSAConfig(**kw)
    QSAConfig(head_dim=128, index_head_dim=64, index_topk=2048)  # the limits themselves are accepted


@pytest.mark.parametrize("tp,want", [(1, [(0, 24, 0, 2)]),
                                     (2, [(0, 12, 0, 1), (12, 12, 1, 1)]),
                                     (4, [(0, 6, 0, 1), (6, 6, 0, 1), (12, 6, 1, 1), (18, 6, 1, 1)])])
def test_shard_heads(tp, want):
    got = [shard_heads(24, 2, TPInfo(r, tp)) for r in range(tp)]
    assert [(s.q_start, s.num_q_heads, s.kv_start, s.num_kv_heads) for s in got] == want
    for s in got:  # the local grouping maps query head h to global KV head h // 12, as in the full model
        g_local = s.num_q_heads // s.num_kv_heads
        assert all(h // 12 == s.kv_start + (h - s.q_start) // g_local
                   for h in range(s.q_start, s.q_start + s.num_q_heads))
    with pytest.raises(ValueError):
        shard_heads(24, 2, TPInfo(0, 5))
    with pytest.raises(ValueError):
        shard_heads(24, 3, TPInfo(0, 2))


def test_rms_norm_and_rope():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 16, generator=g, dtype=torch.float64)
    w = torch.randn(16, generator=g, dtype=torch.float64) * 0.1
    y = rms_norm(x, w, 1e-6)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.allclose(y, want, rtol=1e-12, atol=0)
    pos = torch.tensor([0, 1, 7, 100, -1])
    cos, sin = rope_cos_sin(pos, 8, 10000.0)
    r = apply_rope(x, cos, sin)
    assert torch.equal(r[..., 8:], x[..., 8:])  # partial: dims past rotary_dim pass through
    assert torch.equal(r[0], x[0]) and torch.equal(r[4], x[4])  # position 0 (and padding -> 0)
    # NeoX pairs (i, i + 4): a rotation by pos * theta**(-2i/8)
    ang = 7 * 10000.0 ** (-torch.arange(4, dtype=torch.float64) * 2 / 8)
    a, b = x[2, :, :4], x[2, :, 4:8]
    assert torch.allclose(r[2, :, :4], a * torch.cos(ang) - b * torch.sin(ang), atol=1e-6)
    assert torch.allclose(r[2, :, 4:8], b * torch.cos(ang) + a * torch.sin(ang), atol=1e-6)
    # rotations preserve the norm of each pair and compose: rope(p) . rope(p') depends on p - p'
    t = index_key_transform(None, 1e-6, 8, 10000.0)(x[:, 0].float(), torch.tensor([0, 1, 2, 3, 4]))
    assert torch.allclose(t.norm(dim=-1), rms_norm(x[:, 0].float(), None, 1e-6).norm(dim=-1), rtol=1e-5)


@pytest.mark.parametrize("change,match", [
    (dict(num_kv_heads=0), "num_kv_heads must be an int >= 1"), (dict(head_dim=0), "head_dim"),
    (dict(hidden_size=0), "hidden_size"), (dict(num_heads=-4), "num_heads"), (dict(index_topk=0), "index_topk"),
    (dict(num_heads=True), "num_heads"), (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
    (dict(k_scale=float("nan")), "k_scale"), (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(dtype=torch.float32), "dtype"), (dict(num_heads=5), "multiple of num_kv_heads"),
])
def test_config_refuses_nonsense(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        replace(TINY, **change)


def test_step_inputs_are_checked_against_the_metadata_and_cache():
    layer = QSAAttention(TINY)
    cache = layer.allocate_cache(8, 8, 1)
    meta = StepMetadata.build([0, 0], [0, 1], [2], [[1, -1]], [8, 9], block_size=8, device="cpu",
                              route="reference")
    x = torch.zeros(2, TINY.hidden_size, dtype=TINY.dtype)
    with pytest.raises(ValueError, match=r"x must be \[T, hidden_size\] = \[2, 64\]"):
        layer(x[:1], meta, cache)
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.zeros(2, 32, dtype=TINY.dtype), meta, cache)
    with pytest.raises(TypeError, match="x must have the config's dtype"):
        layer(x.half(), meta, cache)
    with pytest.raises(ValueError, match="meta.block_size"):
        layer(x, meta, layer.allocate_cache(8, 16, 1))
    with pytest.raises(ValueError, match="positions must have token_to_req's shape"):
        StepMetadata.build([0, 0], [0], [2], [[1, -1]], [8, 9], block_size=8, device="cpu")
    with pytest.raises(ValueError, match="seq_lens"):
        StepMetadata.build([0, 0], [0, 1], [2, 2], [[1, -1]], [8, 9], block_size=8, device="cpu")
    with pytest.raises(ValueError, match="block_size"):
        StepMetadata.build([0, 0], [0, 1], [2], [[1, -1]], [8, 9], block_size=0, device="cpu")
    for kw, match in ((dict(block_size=0), "block_size"), (dict(num_blocks=-1), "num_blocks"),
                      (dict(fill="bogus"), "fill")):
        args = dict(num_blocks=8, block_size=8, num_reqs=1)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            layer.allocate_cache(args.pop("num_blocks"), args.pop("block_size"), args.pop("num_reqs"), **args)


def test_projections_are_one_weight_and_agree_with_separate_ones():
    """The five projections of x are views of one fused weight that an eager step multiplies once; a
    layer whose parameters stopped being views (replaced, moved) multiplies them one by one, and both
    agree within rounding. Moving or casting the module makes them views again."""
    layer = QSAAttention(TINY, seed=4)
    assert layer._in_proj_views() == layer._in_proj_ptrs
    assert all(getattr(layer, n).untyped_storage().data_ptr() == layer._in_proj.untyped_storage().data_ptr()
               for n in layer.IN_PROJ)
    x = torch.randn(5, TINY.hidden_size, generator=torch.Generator().manual_seed(1)).to(TINY.dtype)
    pos = torch.arange(5)
    fused = layer.project(x, pos)
    layer.v_proj.data = layer.v_proj.data.clone()  # no longer a view: the separate products
    assert layer._in_proj_views() != layer._in_proj_ptrs
    separate = layer.project(x, pos)
    for a, b in zip(fused, separate):
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(separate[3], F_linear(x, layer.v_proj).view(5, layer.num_kv_heads, TINY.head_dim))
    layer.to("cpu")
    assert layer._in_proj_views() == layer._in_proj_ptrs, "moving the module did not fuse the weights again"
    # known-wrong: a fused weight whose rows are out of the parameters' order gives other projections
    layer._in_proj_sizes = layer._in_proj_sizes[::-1]
    with pytest.raises(RuntimeError):
        layer.project(x, pos)


def F_linear(x, w):
    return torch.nn.functional.linear(x, w)


@pytest.mark.parametrize("req,pos,want", [([0, 0, 1, 1], [0, 1, 0, 5], True), ([1, 1, 0], [3, 4, 9], False),
                                          ([0, 0], [4, 3], False), ([0, 0, -1], [0, 1, -1], False),
                                          ([2], [7], True), ([], [], True), ([0, 0], [3, 3], True)])
def test_rows_ordered_of(req, pos, want):
    from qsa.model.layer import rows_ordered_of

    assert rows_ordered_of(req, pos) is want
    assert rows_ordered_of(torch.tensor(req, dtype=torch.int32), torch.tensor(pos)) is want


def test_step_rope_tables_are_kept_while_positions_are_unchanged():
    meta = StepMetadata.build([0, 0, 1], [3, 4, 0], [5, 1], [[0, 1], [2, 3]], [3, 4, 16], block_size=8,
                              device="cpu")
    cos, sin = meta.rope(8, 10000.0)
    assert meta.rope(8, 10000.0)[0] is cos, "the tables were computed again"
    want = rope_cos_sin(meta.positions, 8, 10000.0)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    assert not torch.equal(meta.rope(4, 10000.0)[0][:, :2], meta.rope(4, 99.0)[0][:, :2])
    meta.positions.copy_(torch.tensor([7, 8, 1]))  # a refill: new tables
    again = meta.rope(8, 10000.0)
    assert again[0] is not cos and torch.equal(again[0], rope_cos_sin(meta.positions, 8, 10000.0)[0])
    with torch.inference_mode():
        meta.positions = torch.tensor([1, 2, 3])
        first = meta.rope(8, 10000.0)
        assert meta.rope(8, 10000.0)[0] is not first[0]  # no version counter: never kept
        assert torch.equal(first[0], rope_cos_sin(meta.positions, 8, 10000.0)[0])


# the Triton kernels' ordered path is also covered, on its own, by test_indexer's ordered-rows tests
@pytest.mark.parametrize("route", ["reference", pytest.param("auto", marks=pytest.mark.lab)])
def test_ordered_steps_skip_the_key_sorts_with_the_same_bits(device, route, monkeypatch):
    """Steps whose rows come by request and position (no padding rows) feed the compressed keys without
    sorting them (``rows_ordered``): the same outputs and caches, bit for bit, as the sorted feeding."""
    import qsa.model.layer as layer_mod

    layer = QSAAttention(TINY, seed=1, device=device)
    xs = inputs(seed=2, device=device)
    run = dict(RUN, pad_rows=0)
    fed = []
    real = qsa.selection.api.update_compressed_keys

    def spy(*a, **kw):
        fed.append(kw.get("rows_ordered"))
        return real(*a, **kw)

    monkeypatch.setattr(qsa.selection.api, "update_compressed_keys", spy)
    out, _, cache = run_layer(layer, xs, **run, route=route, allocator_seed=3)
    assert fed and all(fed), "an ordered step still sorted"
    fed.clear()
    monkeypatch.setattr(layer_mod, "rows_ordered_of", lambda *a: False)
    want, _, want_cache = run_layer(layer, xs, **run, route=route, allocator_seed=3)
    assert fed and not any(fed)
    assert torch.equal(out, want)
    assert torch.equal(cache.kc.nan_to_num(3.0), want_cache.kc.nan_to_num(3.0))
    assert torch.equal(cache.partial, want_cache.partial)


@pytest.mark.parametrize("route", ["reference", "xqa"])
def test_a_step_of_no_token(route):
    layer = QSAAttention(TINY)
    meta = StepMetadata.build([], [], [0], [[-1, -1, -1, -1]], [], block_size=8, device="cpu", route=route)
    y = layer(torch.zeros(0, TINY.hidden_size, dtype=TINY.dtype), meta, layer.allocate_cache(8, 8, 1))
    assert y.shape == (0, TINY.hidden_size)


def test_weights_shard_consistently():
    """TP2 shards are slices of the TP1 weights (same seed, same function)."""
    full = QSAAttention(TINY, seed=3)
    parts = [QSAAttention(TINY, tp=TPInfo(r, 2), seed=3) for r in range(2)]
    D, H = TINY.head_dim, TINY.hidden_size
    assert torch.equal(torch.cat([p.qg_proj for p in parts]), full.qg_proj)
    assert torch.equal(torch.cat([p.k_proj for p in parts]), full.k_proj)
    assert torch.equal(torch.cat([p.o_proj for p in parts], dim=1), full.o_proj)
    for p in parts:
        assert torch.equal(p.index_q_proj, full.index_q_proj) and torch.equal(p.index_k_norm, full.index_k_norm)
        assert p.qg_proj.shape == (2 * 2 * D, H) and p.o_proj.shape == (H, 2 * D)


# ---------------------------------------------------------------------------------------------
# the whole layer


def _selection_like(s, device):
    """What the step's selection must equal: on the CPU the loop reference (fp32 dot products come out
    the same there); on a GPU, where tensor-core sums round differently, the same implementation
    called directly on the captured inputs (the layer's plumbing)."""
    m = s["meta"]
    args = (s["iq"], s["kc"], m.block_table, m.token_to_req, m.positions, m.seq_lens)
    if torch.device(device).type == "cpu":
        return qsa.selection.reference.select_tokens_reference(*args, k=TINY.index_topk)
    return select_tokens(*args, block_size=m.block_size, k=TINY.index_topk, backend=m.backend).cpu()


@pytest.mark.parametrize("route", ["reference", "auto", pytest.param("grouped", marks=pytest.mark.slow)])
def test_layer_matches_references(device, route):
    """Chunked prefill + decode (with padding rows) against: the fp64 layer given the selection, the
    loop reference of the selection on the layer's own index queries and keys, the reference
    compressed keys. Caches start as NaN, so a read of an unwritten slot would show."""
    lens = (21, 11)  # request 0 prefilled in two chunks of RUN's 13 rows, rows past index_topk's 16 tokens
    layer = QSAAttention(TINY, seed=1, device=device)
    xs = inputs(seed=2, lens=lens, device=device)
    out, steps, cache = run_layer(layer, xs, **RUN, route=route, capture=True, allocator_seed=5)
    assert len(steps) >= 4 and any(len(s["rows"]) == RUN["chunk_size"] for s in steps)  # chunked, then decode
    assert torch.isfinite(out).all()
    for s in steps:
        assert torch.equal(s["y"][len(s["rows"]):], torch.zeros_like(s["y"][len(s["rows"]):]))  # padding rows
        assert torch.equal(s["indices"].cpu(), _selection_like(s, device)), "selection differs"
    # compressed keys: mean of each group of 4 raw keys, RMSNorm, RoPE at 4b
    ik = torch.cat([s["ik"][:len(s["rows"])] for s in steps])
    rows = torch.cat([torch.tensor(s["rows"]) for s in steps])
    ik_by_row = torch.empty_like(ik)
    ik_by_row[rows.to(ik.device)] = ik
    transform = index_key_transform(layer.index_k_norm, TINY.rms_norm_eps, TINY.index_rotary_dim, TINY.rope_theta)
    table = steps[-1]["meta"].block_table
    start = 0
    for r, L in enumerate(lens):
        want = qsa.selection.reference.compressed_keys_reference(ik_by_row[start:start + L], transform).to(cache.kc.dtype)
        got = torch.stack([cache.kc[int(table[r, b // 2]), b % 2] for b in range(L // 4)])
        assert torch.equal(got, want)
        start += L
    idx = gather_indices(steps, sum(lens))
    assert ((idx >= 0).sum(1) < torch.cat([torch.arange(L) + 1 for L in lens])).any()  # sparse rows
    check_against_reference(layer, xs, out, idx, name=route)


@pytest.fixture(scope="module")
def reference_run():
    layer = QSAAttention(TINY, seed=1)
    xs = inputs(seed=2)
    out, steps, _ = run_layer(layer, xs, **RUN, route="reference", capture=True)
    return layer, xs, out, gather_indices(steps, sum(LENS))


@pytest.mark.parametrize("variant", ["no rope", "plain norm weight", "no gate", "k as v"])
def test_reference_check_rejects_wrong_layers(reference_run, variant):
    """The tolerance check above fails for layers that get one piece wrong."""
    layer, xs, out, idx = reference_run
    check_against_reference(layer, xs, out, idx, name="right")
    wrong = copy.deepcopy(layer)
    with torch.no_grad():
        if variant == "no rope":
            wrong.config = replace(TINY, rotary_dim=0)
        elif variant == "plain norm weight":
            wrong.q_norm -= 1
        elif variant == "no gate":  # gate rows of each head's packed projection zeroed: sigmoid(0) = 1/2
            wrong.qg_proj.view(TINY.num_heads, 2, TINY.head_dim, TINY.hidden_size)[:, 1] = 0
        else:
            wrong.v_proj.copy_(layer.k_proj)
    # the wrong reference and the real layer disagree beyond the bound
    with pytest.raises(AssertionError, match="max abs error"):
        check_against_reference(wrong, xs, out, idx, name=variant)


@pytest.mark.parametrize("route", ["reference", "auto"])
def test_layer_bitwise_across_page_placements(device, route):
    """Chunked prefill and decode (a step of both requests, padding rows) on two page placements: the same
    output bits. TINY with two query heads on one KV head and two index heads: every kernel of the step
    reads the pages as at any head count."""
    layer = QSAAttention(replace(TINY, num_heads=2, num_kv_heads=1, index_heads=2), seed=4, device=device)
    xs = inputs(seed=5, lens=(17, 10), device=device)  # request 0: two prefill chunks over three pages
    run = dict(chunk_size=13, decode_tokens=2, block_size=8, pad_rows=1)
    runs = [run_layer(layer, xs, **run, route=route, allocator_seed=s, num_blocks=40) for s in (11, 12)]
    tables = [r[1][-1]["meta"].block_table for r in runs]
    assert not torch.equal(tables[0], tables[1]), "the two placements must differ"
    assert len(runs[0][1]) >= 4 and len(runs[0][1][-1]["rows"]) == 2  # chunked prefill, decode of both
    outs = [r[0] for r in runs]
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_plan_buffers_shared_across_layers(device):
    """Two layers in one step: the second refills the first's plan buffers and workspace and gets the
    same bits as with fresh ones."""
    a, b = QSAAttention(TINY, seed=6, device=device), QSAAttention(TINY, seed=7, device=device)
    xs = inputs(seed=8, lens=(24,), device=device)
    ca = a.allocate_cache(8, 8, 1)
    cb = b.allocate_cache(8, 8, 1)
    cb_alone = b.allocate_cache(8, 8, 1)
    table = torch.tensor([[3, 1, 6]], dtype=torch.int32)
    slots = torch.cat([torch.arange(8) + 8 * p for p in (3, 1, 6)])
    build = dict(block_size=8, device=device, route="grouped", backend="torch")
    meta = StepMetadata.build([0] * 24, list(range(24)), [24], table, slots, **build)
    a(xs[0], meta, ca)
    plan, ws, buf = meta.plan, meta.plan.workspace, meta.attn_out
    assert plan is not None and ws is not None
    assert plan.single is None, "every row is grouped: no single-row lists are built"
    ptrs = (plan.grouped.mb_ids.data_ptr(), ws.bits.data_ptr())
    y_shared = b(xs[0], meta, cb)
    assert (meta.plan.grouped.mb_ids.data_ptr(), meta.plan.workspace.bits.data_ptr()) == ptrs
    assert meta.attn_out is buf
    fresh = StepMetadata.build([0] * 24, list(range(24)), [24], table, slots, **build)
    y_alone = b(xs[0], fresh, cb_alone)
    assert torch.equal(y_shared, y_alone)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_layer_under_torch_compile_aot_eager():
    """Dynamo traces the layer through the custom ops (fake implementations, mutation of the caches)
    with a full graph; the result is bitwise the eager one."""
    layer = QSAAttention(TINY, seed=9)
    xs = inputs(seed=10)
    eager, _, _ = run_layer(layer, xs, **RUN, route="reference")
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got, _, _ = run_layer(compiled, xs, **RUN, route="reference")
    assert torch.equal(got, eager)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_layer_under_torch_compile_inductor():
    """One step through inductor on the CPU: the same selection and an output within the reference
    bound (inductor fuses the norms and RoPE, so rounding may differ)."""
    layer = QSAAttention(TINY, seed=9)
    xs = inputs(seed=10, lens=(24,))
    eager, steps, _ = run_layer(layer, xs, chunk_size=24, block_size=8, route="reference", capture=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    got, _, _ = run_layer(compiled, xs, chunk_size=24, block_size=8, route="reference")
    check_against_reference(layer, xs, got, gather_indices(steps, 24), name="inductor")
    assert float((got.float() - eager.float()).abs().max()) <= 4 * rounding_floor(eager.float(), torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_layer_torch_compile(mode):
    """The reference configuration on the GPU under torch.compile (and its CUDA graphs with
    "reduce-overhead"): chunked prefill + decode bitwise reproducible across page placements, and
    within a few bf16 roundings of the eager layer (inductor fuses the norms and RoPE)."""
    layer = QSAAttention(QSAConfig(), seed=0, device="cuda")
    xs = inputs(seed=1, lens=(3000, 2400), hidden=2560, device="cuda")
    run = dict(chunk_size=1024, decode_tokens=6, block_size=64, route="auto")
    eager, _, _ = run_layer(layer, xs, **run, allocator_seed=1)
    torch._dynamo.reset()
    compiled = torch.compile(layer, mode=mode)
    outs = [run_layer(compiled, xs, **run, allocator_seed=s)[0] for s in (1, 2)]
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    err = float((outs[0].float() - eager.float()).abs().max())
    assert err <= 16 * rounding_floor(eager.float(), torch.bfloat16)  # a few flipped near-tie blocks allowed


@pytest.mark.gpu
def test_gpu_layer_matches_reference():
    layer = QSAAttention(QSAConfig(index_topk=64), seed=0, device="cuda")
    xs = inputs(seed=1, lens=(700, 333), hidden=2560, device="cuda")
    out, steps, _ = run_layer(layer, xs, chunk_size=512, decode_tokens=3, block_size=16, route="auto", capture=True)
    check_against_reference(layer, [x.cpu() for x in xs], out.cpu(), gather_indices(steps, 1033), name="gpu")
