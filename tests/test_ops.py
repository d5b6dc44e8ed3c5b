"""Custom ops (torch.library) and the PyTorch implementations of selection and cache writes.

The PyTorch paths are checked exactly against the loop references and against the Triton kernels
(interpreter on the CPU); the ops pass ``torch.library.opcheck`` and run under ``torch.compile``.
"""

import dataclasses
import functools

import pytest
import torch

from helpers import HAS_CUDA
import qsa
import qsa.attention.routing
import qsa.backend
import qsa.model.ops
import qsa.selection.reference
from qsa.cache.paged import allocate_kv_cache, quantize_e4m3
from qsa.selection.api import select_tokens
from qsa.model.functional import index_key_transform, rope_cos_sin

NAN = float("nan")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def selection_case(*, seed=0, D=32, H=4, block_size=8, integer=True, dtype=torch.float32, device="cpu"):
    """Compressed keys in a shuffled paged layout with an aliased page, an invalid (-1) and an
    out-of-range table entry, rows of several requests, and padding rows."""
    g = _gen(seed)
    seq_lens = [70, 45, 9]
    num_reqs, max_blocks, rpb = 3, 5, block_size // 4
    num_blocks = num_reqs * max_blocks + 2
    if integer:  # small integers: exact dot products, many ties
        kc = torch.randint(-3, 4, (num_blocks, rpb, D), generator=g).to(dtype)
        kc[..., 0] = -0.0
    else:
        kc = torch.randn(num_blocks, rpb, D, generator=g).to(dtype)
    bt = torch.randperm(num_blocks, generator=g)[:num_reqs * max_blocks].view(num_reqs, max_blocks)
    bt = bt.to(torch.int32)
    bt[1, 0] = bt[0, 0]
    bt[0, 3] = -1
    bt[1, 2] = num_blocks + 7
    picks = [(0, 69), (0, 68), (1, 44), (0, 30), (2, 8), (1, 20), (0, 3), (-1, 5), (2, -1), (0, 67), (7, 2)]
    req = torch.tensor([r for r, _ in picks], dtype=torch.int32)
    pos = torch.tensor([p for _, p in picks], dtype=torch.int64)
    if integer:
        q = torch.randint(-2, 3, (len(picks), H, D), generator=g).to(dtype)
    else:
        q = torch.randn(len(picks), H, D, generator=g).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, kc, bt, req, pos, seq))


def _select_torch(*args, k, block_size=8):
    return select_tokens(*args, block_size=block_size, k=k, backend="torch")


@pytest.mark.parametrize("k", [1, 3, 8, 40])
@pytest.mark.parametrize("integer", [True, False])
def test_select_tokens_torch_matches_loop_reference(k, integer):
    args = selection_case(seed=k, integer=integer)
    got = _select_torch(*args, k=k)
    want = qsa.selection.reference.select_tokens_reference(*args, k=k)
    assert got.dtype == torch.int32 and got.shape == (args[0].shape[0], 4 * k + 3)
    assert torch.equal(got, want)
    assert (got[7] == -1).all() and (got[8] == -1).all() and (got[10] == -1).all()  # padding rows


def test_select_tokens_torch_ties_nan_and_signed_zero():
    """Scores tied everywhere (zero queries), one NaN block: ties go to the lower block index, NaN ranks
    below every number, -0.0 equals +0.0."""
    q, kc, bt, req, pos, seq = selection_case(seed=1)
    q = torch.zeros_like(q)
    q[0, 0, 1] = -0.0
    kc = kc.clone()
    kc[int(bt[0, 0]), 0, 1] = NAN  # logical block 0 of requests 0 and 1 (aliased page)
    got = _select_torch(q, kc, bt, req, pos, seq, k=4)
    want = qsa.selection.reference.select_tokens_reference(q, kc, bt, req, pos, seq, k=4)
    assert torch.equal(got, want)
    # row 0 (pos 69): all scores 0 except NaN block 0 -> blocks 1, 2, 3, 4
    assert got[0, :16].tolist() == list(range(4, 20))


def test_select_tokens_torch_matches_kernel(device):
    args = selection_case(seed=3, D=32, integer=True, device=device)

    assert torch.equal(_select_torch(*args, k=5).cpu(), select_tokens(*args, block_size=8, k=5).cpu())


def _select_ties_high(q, kc, bt, req, pos, seq, k):
    """A known-wrong selection: ties go to the HIGHER block index."""
    scores = qsa.selection.reference.block_scores_reference(q, kc, bt, req, pos, seq)
    vis = qsa.selection.reference.visible_blocks_reference(req, pos, seq)
    blocks = torch.full((q.shape[0], k), -1, dtype=torch.int32)
    for r in range(q.shape[0]):
        cand = [b for b in range(min(int(vis[r]), scores.shape[1])) if scores[r, b] > float("-inf")]
        cand.sort(key=lambda b: (-float(scores[r, b].nan_to_num(-1.0)), -b))
        chosen = sorted(cand[:k])
        blocks[r, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return qsa.selection.reference.expand_tokens_reference(blocks, req, pos, seq)


def test_wrong_selection_is_rejected():
    """The exact comparison catches a selection that breaks ties the other way (and the wrong
    variant is otherwise right: it agrees where there are no ties)."""
    q, *rest = selection_case(seed=2)
    q[:3] = 0  # all-tied rows
    case = (q, *rest)
    assert torch.equal(_select_torch(*case, k=3), qsa.selection.reference.select_tokens_reference(*case, k=3))
    assert not torch.equal(_select_ties_high(*case, k=3), _select_torch(*case, k=3))
    tie_free = selection_case(seed=2, integer=False)
    assert torch.equal(_select_ties_high(*tie_free, k=3), _select_torch(*tie_free, k=3))


def _feed(fn, raw, req_ids, positions, kc, bt, partial, chunks, transform, block_size):
    start = 0
    for n in chunks:
        sl = slice(start, start + n)
        fn(raw[sl], req_ids[sl], positions[sl], kc, bt, partial, block_size=block_size, transform=transform)
        start += n


@pytest.mark.parametrize("with_transform", [False, True])
def test_update_compressed_keys_torch_matches_kernel_and_reference(device, with_transform):
    from qsa.selection.api import update_compressed_keys

    D, block_size, L = 32, 8, 27
    g = _gen(4)
    raw = torch.randn(L, D, generator=g)
    transform = index_key_transform((torch.randn(D, generator=g) * 0.1).to(device), 1e-6, 16, 10000.0) \
        if with_transform else None
    bt = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    req_ids = torch.zeros(L, dtype=torch.int32)
    positions = torch.arange(L)
    results = []
    for fn, dev in ((functools.partial(update_compressed_keys, backend="torch"), device),
                    (functools.partial(update_compressed_keys, backend="triton"), device)):
        kc = torch.full((8, block_size // 4, D), NAN, device=dev)
        partial = torch.full((1, 3, D), NAN, device=dev)
        _feed(fn, raw.to(dev), req_ids.to(dev), positions.to(dev), kc, bt.to(dev), partial,
              [5, 3, 7, 1, 1, 10], transform, block_size)
        results.append((kc.cpu(), partial.cpu()))
    (kc_t, part_t), (kc_k, part_k) = results
    assert torch.equal(kc_t.nan_to_num(123.0), kc_k.nan_to_num(123.0))
    assert torch.equal(part_t, part_k)
    want = qsa.selection.reference.compressed_keys_reference(raw.to(device), transform).cpu()
    got = torch.stack([kc_t[int(bt[0, b // 2]), b % 2] for b in range(L // 4)])
    assert torch.equal(got, want)
    assert torch.equal(part_t[0, :3], raw[24:27])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_write_kv_torch_matches_kernel(device, kv_cache_dtype):
    from qsa.cache.paged import write_kv

    g = _gen(5)
    k = torch.randn(9, 2, 16, generator=g).to(torch.bfloat16)
    v = torch.randn(9, 2, 16, generator=g).to(torch.bfloat16)
    slots = torch.tensor([3, 17, -1, 40, 63, 64, 1000, 5, 0])
    caches = []
    for fn, dev in ((functools.partial(write_kv, backend="torch"), device),
                    (functools.partial(write_kv, backend="triton"), device)):
        c = allocate_kv_cache(8, 8, 2, 16, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, fill="nan",
                              device=dev, k_scale=0.5, v_scale=0.25)
        fn(c.k, c.v, k.to(dev), v.to(dev), slots.to(dev), kv_cache_dtype=kv_cache_dtype, k_scale=c.k_scale,
           v_scale=c.v_scale)
        caches.append(c.storage.cpu().view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    c = caches[0].view(torch.uint8 if kv_cache_dtype == "fp8_e4m3" else torch.bfloat16)
    want = quantize_e4m3(k[1], 0.5) if kv_cache_dtype == "fp8_e4m3" else k[1]
    assert torch.equal(c[2, 0, 1], want)  # slot 17 = block 2, offset 1


# ---------------------------------------------------------------------------------------------
# custom ops


def _attention_case(device, rows=11):
    from helpers import make_attention_case

    return make_attention_case(rows=rows, num_reqs=3, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                               width=20, max_seq_len=40, dtype=torch.bfloat16, with_gate=True, device=device)


def test_attention_op_matches_public_op():
    import qsa

    c = _attention_case("cpu")
    want, want_lse = c.run(qsa.sparse_paged_attention, return_lse=True, route="reference")
    got, got_lse = c.run(qsa.model.ops.sparse_paged_attention, return_lse=True, route="reference")
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    got_only = c.run(qsa.model.ops.sparse_paged_attention, route="reference")
    assert torch.equal(got_only, want)


def test_attention_op_passes_the_batch_hints(device, monkeypatch):
    """``max_query_len`` and ``rows_sorted`` reach the route choice through the custom op (the layer
    under ``torch.compile`` gets the direct xqa kernel as it does eagerly), and the result is the
    public op's, bit for bit."""
    import qsa
    from test_xqa_direct import ascending_rows

    c = _attention_case(device)
    c.indices = ascending_rows(c.indices)
    seen = []
    choose = qsa.attention.routing.choose
    monkeypatch.setattr(qsa.attention.routing, "choose", lambda *a, **kw: seen.append(kw) or choose(*a, **kw))
    want = c.run(qsa.sparse_paged_attention, return_lse=True, route="xqa", max_query_len=2, rows_sorted=True)
    got = c.run(qsa.model.ops.sparse_paged_attention, return_lse=True, route="xqa", max_query_len=2, rows_sorted=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert [(kw["max_query_len"], kw["rows_sorted"]) for kw in seen] == [(2, True), (2, True)]
    default = c.run(qsa.model.ops.sparse_paged_attention, route="xqa")
    assert (seen[-1]["max_query_len"], seen[-1]["rows_sorted"]) == (None, False)
    assert torch.equal(default, want[0])


def test_opcheck_attention():
    c = _attention_case("cpu")
    cache = c.cache
    for return_lse in (False, True):
        args = (c.q, cache.k, cache.v, c.indices, c.block_table, c.token_to_req, c.positions, c.seq_lens, c.gate,
                "auto", 1.0, 1.0, None, return_lse, "reference")
        torch.library.opcheck(torch.ops.qsa.sparse_paged_attention.default, args)
        torch.library.opcheck(torch.ops.qsa.sparse_paged_attention.default, (*args, 1, True))
    buf, padded, _ = _counted_op_case("cpu")
    W = padded.indices.shape[1]
    args = (c.q, cache.k, cache.v, buf[:, :W], c.block_table, c.token_to_req, c.positions, c.seq_lens, c.gate,
            "auto", 1.0, 1.0, None, True, "reference", None, False, buf[:, W])
    torch.library.opcheck(torch.ops.qsa.sparse_paged_attention.default, args)


OP_COUNTS = [3, 20, 0, 7, -2, 25, 11, 1, 15, 9, 5]
"""A raw count per row of ``_attention_case`` (W = 20): a whole row, 0, a negative count and one past W
(clamped to 20, 0, 0, 20) among short rows."""


def _counted_op_case(device):
    """``_attention_case`` served as a ``[rows, W + 1]`` buffer: ``(buf, padded, poisoned)``. ``buf[:, :W]``
    holds each row's first ``clamp(OP_COUNTS[r], 0, W)`` entries, then in-range but wrong tokens (ones the
    row could attend and its leading entries do not keep), and ``buf[:, W]`` the raw counts; ``padded`` is
    the case with -1 past each count; ``poisoned`` the rows that have such wrong tokens past their count
    (the others have none to take)."""
    from qsa.attention.reference import kept_tokens

    c = _attention_case(device)
    rows, W = c.indices.shape
    eff = [min(max(n, 0), W) for n in OP_COUNTS]
    compact = c.indices.cpu().clone()
    for r, n in enumerate(eff):
        compact[r, n:] = -1
    table, lens = c.block_table.tolist(), c.seq_lens.tolist()
    reqs, pos = c.token_to_req.tolist(), c.positions.tolist()
    bs, nb = c.cache.block_size, c.cache.num_blocks
    buf = torch.full((rows, W + 1), -1, dtype=torch.int32)
    buf[:, :W] = compact
    poisoned = []
    for r, n in enumerate(eff):
        kept = set(kept_tokens(compact[r].tolist(), reqs[r], pos[r], lens, table, bs, nb))
        wrong = [t for t in kept_tokens(range(max(pos[r] + 1, 0)), reqs[r], pos[r], lens, table, bs, nb)
                 if t not in kept]
        if wrong and n < W:
            poisoned.append(r)
            buf[r, n:W] = torch.tensor([wrong[i % len(wrong)] for i in range(W - n)], dtype=torch.int32)
    buf[:, W] = torch.tensor(OP_COUNTS, dtype=torch.int32)
    padded = dataclasses.replace(c, indices=compact.to(device))
    return buf.to(device), padded, poisoned


@pytest.mark.parametrize("route", ["reference", "xqa"])
def test_attention_op_reads_only_each_rows_count(device, route):
    """``index_counts`` through the custom op: the rows of a ``[rows, W + 1]`` buffer (``indices`` a view of
    row stride ``W + 1``, the counts its last column) give the bits of the same indices with -1 past each
    count, though the entries past the counts hold in-range tokens the rows could attend; the public op
    with the counts gives the same bits. The known-wrong variant, the buffer without its counts, reads
    those tokens: the comparison rejects it in exactly the rows that hold some."""
    buf, padded, poisoned = _counted_op_case(device)
    assert len(poisoned) >= 3
    W = padded.indices.shape[1]
    served = dataclasses.replace(padded, indices=buf[:, :W])
    counts = buf[:, W]
    assert served.indices.stride(0) == W + 1 and counts.stride(0) == W + 1
    op = qsa.model.ops.sparse_paged_attention
    want = padded.run(op, return_lse=True, route=route)
    got = served.run(op, return_lse=True, route=route, index_counts=counts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.isfinite(got[0]).all()
    public = served.run(qsa.sparse_paged_attention, return_lse=True, route=route, index_counts=counts)
    assert torch.equal(public[0], got[0]) and torch.equal(public[1], got[1])
    ignored = served.run(op, return_lse=True, route=route)
    differs = (ignored[0] != want[0]).flatten(1).any(1) | (ignored[1] != want[1]).any(1)
    assert differs.nonzero().flatten().tolist() == poisoned


def test_attention_op_with_counts_under_torch_compile():
    """Dynamo traces the op with and without ``index_counts`` (strided views of one buffer) in a full graph
    through the fake implementation; each compiled call is bitwise the eager op."""
    buf, padded, _ = _counted_op_case("cpu")
    W = padded.indices.shape[1]
    served = dataclasses.replace(padded, indices=buf[:, :W])

    def step(case, **kw):
        return case.run(qsa.model.ops.sparse_paged_attention, return_lse=True, route="reference", **kw)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for case, kw in ((served, dict(index_counts=buf[:, W])), (padded, {})):
        got, want = compiled(case, **kw), step(case, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(compiled(served, index_counts=buf[:, W])[0], step(padded)[0])


def test_attention_op_checks_index_counts_as_the_library_does():
    """A bad ``index_counts`` is refused by name through the op as by the library: a non-tensor by the wrapper
    (before the dispatcher would name the schema instead), dtype and shape inside the op."""
    buf, padded, _ = _counted_op_case("cpu")
    W = padded.indices.shape[1]
    served = dataclasses.replace(padded, indices=buf[:, :W])
    for value, err, msg in ((buf[:, W].tolist(), TypeError, "index_counts must be a torch.Tensor"),
                            (buf[:, W].long(), TypeError, "index_counts must have dtype int32, got int64"),
                            (buf[:-1, W], ValueError, r"index_counts must have shape \[11\]")):
        with pytest.raises(err, match=msg):
            served.run(qsa.model.ops.sparse_paged_attention, route="reference", index_counts=value)


def test_opcheck_select_and_cache_ops():
    q, kc, bt, req, pos, seq = selection_case(seed=6, D=16)
    torch.library.opcheck(torch.ops.qsa.select_tokens.default, (q, kc, bt, req, pos, seq, 4, "torch", 8))
    g = _gen(7)
    kv = torch.zeros(6, 2, 8, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(5, 2, 16, generator=g).to(torch.bfloat16)
    slots = torch.tensor([0, 9, -1, 47, 3])
    torch.library.opcheck(torch.ops.qsa.write_kv.default, (kv, k, k, slots, "auto", 1.0, 1.0, "torch"))
    raw = torch.randn(6, 16, generator=g)
    kcache = torch.zeros(6, 2, 16)
    partial = torch.zeros(2, 3, 16)
    w = torch.randn(16, generator=g)
    torch.library.opcheck(torch.ops.qsa.update_compressed_keys.default,
                          (raw, torch.zeros(6, dtype=torch.int32), torch.arange(6), kcache,
                           torch.tensor([[1, 4], [2, 3]], dtype=torch.int32), partial, w, 1e-6, 8, 10000.0,
                           "torch", 8, None, None, False, None, None))
    torch.library.opcheck(torch.ops.qsa.update_compressed_keys.default,
                          (raw, torch.zeros(6, dtype=torch.int32), torch.arange(6), kcache,
                           torch.tensor([[1, 4], [2, 3]], dtype=torch.int32), partial, w, 1e-6, 8, 10000.0,
                           "torch", 8, torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), True,
                           *rope_cos_sin(torch.div(torch.arange(6), 4, rounding_mode="floor") * 4, 8, 10000.0)))


def test_write_kv_op_mutates_only_given_slots():
    kv = torch.full((4, 2, 4, 1, 8), NAN, dtype=torch.float16)
    k = torch.ones(2, 1, 8, dtype=torch.float16)
    qsa.model.ops.write_kv(kv, k, 2 * k, torch.tensor([5, -1]), backend="torch")
    assert (kv[1, 0, 1] == 1).all() and (kv[1, 1, 1] == 2).all()
    assert torch.isnan(kv).sum() == kv.numel() - 16


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(7, 4, 16, dtype=torch.bfloat16)
        kv = torch.empty(5, 2, 8, 2, 16, dtype=torch.bfloat16)
        idx = torch.empty(7, 11, dtype=torch.int32)
        t2r = torch.empty(7, dtype=torch.int32)
        pos = torch.empty(7, dtype=torch.int64)
        bt = torch.empty(2, 3, dtype=torch.int32)
        seq = torch.empty(2, dtype=torch.int32)
        out, lse = torch.ops.qsa.sparse_paged_attention(q, kv[:, 0], kv[:, 1], idx, bt, t2r, pos, seq, None, "auto",
                                                        1.0, 1.0, None, True, "auto")
        assert out.shape == (7, 4, 16) and out.dtype == torch.bfloat16
        assert lse.shape == (7, 4) and lse.dtype == torch.float32
        counted = torch.ops.qsa.sparse_paged_attention(q, kv[:, 0], kv[:, 1], idx, bt, t2r, pos, seq, None, "auto",
                                                       1.0, 1.0, None, False, "auto", None, False,
                                                       torch.empty(7, 12, dtype=torch.int32)[:, 11])
        assert counted[0].shape == (7, 4, 16) and counted[1].shape == (0,)
        sel = torch.ops.qsa.select_tokens(torch.empty(7, 4, 32), torch.empty(5, 2, 32), bt, t2r, pos, seq, 6,
                                          "triton", 8)
        assert sel.shape == (7, 27) and sel.dtype == torch.int32


def test_kernel_backend():
    assert qsa.backend.kernel_backend("reference", "cpu") == "torch"
    # the interpreter is on in a CPU test run
    assert qsa.backend.kernel_backend("auto", "cuda" if HAS_CUDA else "cpu") == "triton"
    with pytest.raises(ValueError, match="backend"):
        qsa.model.ops.write_kv(torch.zeros(1, 2, 4, 1, 8), torch.zeros(0, 1, 8), torch.zeros(0, 1, 8),
                     torch.zeros(0, dtype=torch.int64), backend="cuda")


def test_degenerate_selection_and_key_feeding_shapes(device):
    """No request (every row padding), no cache block, no table column: the selection is the causal tails
    or all -1 on both backends, key feeding writes nothing and both backends agree; a cache of zero rows
    per block is refused."""
    from qsa.selection.api import tokens_from_scores, update_compressed_keys

    D = 16
    q, kc, bt, req, pos, seq = selection_case(D=D, device=device)
    no_req = (bt[:0], seq[:0])
    for backend in ("torch", "triton"):
        got = select_tokens(q, kc, no_req[0], req, pos, no_req[1], block_size=8, k=2, backend=backend)
        assert bool((got == -1).all()), backend
        want = qsa.selection.reference.select_tokens_reference(q, kc[:0], bt, req, pos, seq, k=2)
        got = select_tokens(q, kc[:0], bt, req, pos, seq, block_size=8, k=2, backend=backend)
        assert torch.equal(got.cpu(), want.cpu()), backend
        assert bool((got >= 0).any()), backend  # the causal tails remain
    got = tokens_from_scores(torch.zeros(req.shape[0], 4, device=device), req, pos, no_req[1], k=1)
    assert bool((got == -1).all())

    raw = torch.randn(4, D, generator=_gen(3)).to(device)
    r4, p4 = torch.zeros(4, dtype=torch.int32, device=device), torch.arange(4, device=device) + 2
    states = []
    for backend in ("torch", "triton"):
        kc_b = torch.full_like(kc, NAN)
        part0 = torch.zeros(0, 3, D, device=device)
        update_compressed_keys(raw, r4, p4, kc_b, no_req[0], part0, block_size=8, backend=backend)  # padding rows only
        assert bool(kc_b.isnan().all()), backend
        part1 = torch.full((1, 3, D), NAN, device=device)
        update_compressed_keys(raw, r4, p4, kc_b, bt[:1, :0], part1, block_size=8, backend=backend)
        assert bool(kc_b.isnan().all()), backend  # no table column: no page to write
        states.append(part1.cpu())
    assert torch.equal(states[0].nan_to_num(7.0), states[1].nan_to_num(7.0))
    with pytest.raises(ValueError, match=r"kc_cache must have block_size // 4 = 2 rows per block \(block_size=8\)"):
        update_compressed_keys(raw, r4, p4, kc[:, :0], bt, torch.zeros(3, 3, D, device=device), block_size=8)


def test_op_wrappers_check_scalars_as_the_library_does():
    """The op wrappers turn scalars into the schema's types only after the library's checks: no silent
    truncation of k, no bool or string scales."""
    q, kc, bt, req, pos, seq = selection_case(D=16)
    with pytest.raises(TypeError, match="k must be an int"):
        qsa.model.ops.select_tokens(q, kc, bt, req, pos, seq, block_size=8, k=2.9)
    with pytest.raises(TypeError, match="k must be an int"):
        qsa.model.ops.select_tokens(q, kc, bt, req, pos, seq, block_size=8, k=True)
    cache = allocate_kv_cache(4, 4, 1, 16, dtype=torch.float16, fill="zeros", kv_cache_dtype="fp8_e4m3")
    k = torch.randn(2, 1, 16, dtype=torch.float16)
    for bad, err in ((True, TypeError), ("2", TypeError), (NAN, ValueError)):
        with pytest.raises(err, match="k_scale"):
            qsa.model.ops.write_kv(cache.storage, k, k, torch.tensor([0, 1]), kv_cache_dtype="fp8_e4m3", k_scale=bad)
    for shape in ((4, 4, 1, 16), (4, 1, 4, 1, 16), (4, 3, 4, 1, 16)):
        with pytest.raises(ValueError, match="kv_cache must"):
            qsa.model.ops.write_kv(torch.zeros(shape, dtype=torch.float16), k, k, torch.tensor([0, 1]))
    from helpers import make_attention_case

    case = make_attention_case(rows=5, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=8, seed=2)
    for kw, match in ((dict(k_scale=True), "k_scale"), (dict(softmax_scale="0.5"), "softmax_scale"),
                      (dict(return_lse="no"), "return_lse"), (dict(rows_sorted=1), "rows_sorted"),
                      (dict(max_query_len=1.5), "max_query_len")):
        with pytest.raises(TypeError, match=match):
            case.run(qsa.model.ops.sparse_paged_attention, **kw)
