"""qsa.integrations.vllm: vLLM's QSA attention op (arguments, layouts, semantics) on qsa's kernels.

Inputs are built in vLLM's exact layout from ``make_attention_case`` data: one server tensor
``[num_blocks, Hkv, page, 2*D]`` and its K/V views, ``logical_indices [rows, W + 1]`` holding each row's
token set ascending, then POISON (valid-looking tokens of a page of NaN that the table maps), then the
count. Outputs are held to the fp64 reference over the row's token set; a variant that drops the count
must fail that check (the poison shows).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch

import qsa
from qsa.attention.reference import assert_close_like_torch, reference_attention
from qsa.integrations import vllm as qv

from helpers import HAS_CUDA, make_attention_case, poisoned


# ----------------------------------------------------------------------------------------------------------
# vLLM-layout batches


@dataclass
class VllmBatch:
    """The arguments of one vLLM call, and what the reference needs."""

    q: torch.Tensor
    gate: torch.Tensor
    server: torch.Tensor            # [num_blocks, Hkv, page, 2*D]: page ``poison_page`` all NaN (0x7F)
    logical_indices: torch.Tensor   # [rows, W + 1] int32
    block_table: torch.Tensor       # [num_reqs, max_blocks + 1]: the last column maps the poison page
    token_to_req: torch.Tensor
    positions: torch.Tensor         # the case's (exact bounds); the adapter gets them only when asked
    seq_lens: torch.Tensor
    ref_indices: torch.Tensor       # [rows, W]: each row's token set, -1 after it
    kv_cache_dtype: str = "auto"
    k_scale: float | None = None
    v_scale: float | None = None

    @property
    def kv(self):
        return kv_views(self.server)

    def call(self, use_prefill_config, **kw):
        k, v = self.kv
        args = dict(k_scale=self.k_scale, v_scale=self.v_scale, output_gate=self.gate)
        args.update(kw)
        return qv.qsa_sparse_paged_attention(self.q, k, v, self.logical_indices, self.block_table, self.token_to_req,
                                             use_prefill_config, **args)

    def reference(self, compute_dtype, *, positions=None, seq_lens=None, ref_indices=None):
        k, v = self.kv
        if self.kv_cache_dtype == "fp8_e4m3":
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        return reference_attention(
            self.q, k, v, self.ref_indices if ref_indices is None else ref_indices, self.block_table,
            self.token_to_req, self.positions if positions is None else positions,
            self.seq_lens if seq_lens is None else seq_lens, gate=self.gate, kv_cache_dtype=self.kv_cache_dtype,
            k_scale=1.0 if self.k_scale is None else self.k_scale,
            v_scale=1.0 if self.v_scale is None else self.v_scale, compute_dtype=compute_dtype)[0]

    def check(self, out, name, **ref_kw):
        """``out`` within the project's tolerance of the fp64 reference (non-finite values fail)."""
        ref = self.reference(torch.float64, **ref_kw)
        low = self.reference(self.q.dtype, **ref_kw)
        assert_close_like_torch(out, ref, low, name=name)


def server_tensor(k, v, extra_pages: int = 1) -> torch.Tensor:
    """vLLM's ``[num_blocks, Hkv, page, 2*D]`` cache tensor holding ``k``, ``v`` ``[num_blocks, page, Hkv, D]``
    (K in the first D columns), with ``extra_pages`` more pages of NaN (E4M3 NaN byte 0x7F for uint8)."""
    nb, page, hkv, d = k.shape
    fill = 0x7F if k.dtype == torch.uint8 else float("nan")
    server = torch.full((nb + extra_pages, hkv, page, 2 * d), fill, dtype=k.dtype, device=k.device)
    server[:nb, ..., :d] = k.transpose(1, 2)
    server[:nb, ..., d:] = v.transpose(1, 2)
    return server


def kv_views(server):
    """vLLM's K/V views of its cache tensor: ``kv.transpose(1, 2).split(D, dim=-1)``."""
    return server.transpose(1, 2).split(server.shape[-1] // 2, dim=-1)


def token_set(case, r) -> list[int]:
    """``T_r`` of row ``r`` of ``case`` (docs/spec.md section 4), ascending."""
    req, pos = int(case.token_to_req[r]), int(case.positions[r])
    num_reqs, max_blocks = case.block_table.shape
    if not 0 <= req < num_reqs or pos < 0:
        return []
    seq_len, bs, nb = int(case.seq_lens[req]), case.cache.block_size, case.cache.num_blocks
    return sorted({t for t in case.indices[r].tolist()
                   if 0 <= t < seq_len and t <= pos and t // bs < max_blocks
                   and 0 <= int(case.block_table[req, t // bs]) < nb})


def vllm_batch(case, *, width: int, seed: int = 0, specials: bool = True) -> VllmBatch:
    """``case`` in vLLM's layout: each row its token set, then poison, then the count. With ``specials``,
    three rows change: one repeats its last token within its count, one has a count far past W (clamped to
    W; -1 after its tokens), one a negative count (nothing attended). Padding rows of the case have count 0."""
    g = torch.Generator().manual_seed(seed)
    c = case.cache
    nb, bs = c.num_blocks, c.block_size
    server = server_tensor(c.k, c.v)
    num_reqs, max_blocks = case.block_table.shape
    table = torch.cat([case.block_table, torch.full((num_reqs, 1), nb, dtype=torch.int32,
                                                    device=case.block_table.device)], dim=1)
    poison = torch.arange(max_blocks * bs, (max_blocks + 1) * bs)   # their page is the NaN page nb
    rows = case.q.shape[0]
    sets = [token_set(case, r) for r in range(rows)]
    assert max(len(s) for s in sets) < width
    full = [r for r in range(rows) if sets[r]]
    assert not specials or len(full) >= 4, "pick a seed with at least 4 rows that attend something"
    dup_row, big_row, neg_row = (full[0], full[1], full[2]) if specials else (-1, -1, -1)
    logical, ref = [], []
    for r, toks in enumerate(sets):
        fill = poison[torch.randint(0, bs, (width,), generator=g)].tolist()
        count = len(toks)
        entries = toks + fill[count:]
        if r == dup_row:      # the tail overlapping a selected block: counted once, as qsa's token set
            entries = toks + [toks[-1]] + fill[count + 1:]
            count += 1
        elif r == big_row:    # count past W: clamped (the count column and the next row are never read)
            entries = toks + [-1] * (width - count)
            count = width + 1000
        elif r == neg_row:    # negative count: nothing attended
            count, toks = -3, []
        logical.append(entries[:width] + [count])
        ref.append(toks + [-1] * (width - len(toks)))
    dev = case.q.device
    return VllmBatch(q=case.q, gate=case.gate, server=server,
                     logical_indices=torch.tensor(logical, dtype=torch.int32, device=dev),
                     block_table=table, token_to_req=case.token_to_req, positions=case.positions,
                     seq_lens=case.seq_lens, ref_indices=torch.tensor(ref, dtype=torch.int32, device=dev),
                     kv_cache_dtype=c.kv_cache_dtype,
                     k_scale=c.k_scale if c.kv_cache_dtype == "fp8_e4m3" else None,
                     v_scale=c.v_scale if c.kv_cache_dtype == "fp8_e4m3" else None)


def make_batch(device, *, rows=8, hq=4, hkv=2, width=16, dtype=torch.float16, kv_cache_dtype="auto", seed=0,
               specials=True) -> VllmBatch:
    case = make_attention_case(rows=rows, num_q_heads=hq, num_kv_heads=hkv, head_dim=16, block_size=16,
                               width=width, dtype=dtype, kv_cache_dtype=kv_cache_dtype, with_gate=True,
                               seed=seed, device=device)
    return vllm_batch(case, width=width + 4, seed=seed, specials=specials)


def empty_rows(b: VllmBatch) -> torch.Tensor:
    """Rows whose token set is empty (count <= 0, padding rows)."""
    return (b.ref_indices < 0).all(dim=1)


def bounds(b: VllmBatch):
    """The bounds the adapter uses without positions / seq_lens: no token of the table exceeds them."""
    bound = b.block_table.shape[1] * b.server.shape[2]
    rows, num_reqs = b.q.shape[0], b.block_table.shape[0]
    return (torch.full((rows,), bound - 1, dtype=torch.int64, device=b.q.device),
            torch.full((num_reqs,), bound, dtype=torch.int32, device=b.q.device))


def plan_buffers(plan) -> dict:
    """Data pointers of a plan's own buffers (not its inputs)."""
    from qsa.attention.replay import tensors_of

    found = []
    for name in ("single", "grouped", "tokens", "token_counts", "launches", "workspace"):
        tensors_of(getattr(plan, name), found)
    return {(tuple(t.shape), t.dtype): t.data_ptr() for t in found}


# ----------------------------------------------------------------------------------------------------------
# results


@pytest.mark.parametrize("kind", ["decode-fp16", "prefill-grouped-fp16", "decode-bf16"])
def test_matches_reference(kind, device):
    """Every row within tolerance of the fp64 reference over its token set: poison past the count never
    read, a repeated entry attended once, counts clamped to [0, W], empty rows exactly 0, out written
    and returned. The server layout's strides (token 2*D, head page*2*D) go to the kernels as they are."""
    prefill = kind.startswith("prefill")
    dtype = torch.bfloat16 if kind.endswith("bf16") else torch.float16
    b = make_batch(device, rows=64 if prefill else 8, dtype=dtype, hq=4, hkv=2, seed=4)
    k, v = b.kv
    page, d = k.shape[1], k.shape[3]
    assert k.stride()[1:] == (2 * d, page * 2 * d, 1) and v.data_ptr() == k.data_ptr() + d * k.element_size()
    if prefill:  # q as vLLM slices it from the packed projection [rows, Hq, 2*D]: not contiguous
        packed = torch.cat([b.q, b.gate], dim=2)
        b = replace(b, q=packed[..., :d])
        assert not b.q.is_contiguous()
    gate = b.gate
    if dtype == torch.bfloat16:  # vLLM views a contiguous gate as q
        gate = b.gate.reshape(b.q.shape[0], -1)
    out = poisoned(b.q.shape, dtype, b.q.device)
    got = b.call(prefill, out=out, output_gate=gate)
    assert got is out
    b.check(got, kind)
    assert (got[empty_rows(b)] == 0).all()


def test_without_count_fails_the_poison_check(device):
    """The known-wrong adapter (indices passed without the count bound) reads the poison: the check that
    passes the adapter must reject it."""
    b = make_batch(device)
    k, v = b.kv
    positions, seq_lens = bounds(b)
    wrong = qsa.sparse_paged_attention(b.q, k, v, b.logical_indices[:, :-1], b.block_table, b.token_to_req,
                                       positions, seq_lens, gate=b.gate, max_query_len=1, rows_sorted=True)
    with pytest.raises(AssertionError, match="non-finite"):
        b.check(wrong, "no count")


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill-grouped"])
def test_page_relocation_is_bitwise(prefill, device):
    """Pages moved into a cache twice the size, the table rewritten (invalid entries kept invalid): the
    same bits."""
    b = make_batch(device, rows=64 if prefill else 8, seed=3)
    nb = b.server.shape[0]
    g = torch.Generator().manual_seed(5)
    mapping = torch.randperm(2 * nb, generator=g)[:nb].to(device)
    server = torch.full((2 * nb, *b.server.shape[1:]), float("nan"), dtype=b.server.dtype, device=device)
    server[mapping] = b.server
    valid = (b.block_table >= 0) & (b.block_table < nb)
    table = torch.where(valid, mapping[b.block_table.clamp(0, nb - 1).long()].to(torch.int32),
                        torch.full_like(b.block_table, 2 * nb + 3))
    moved = replace(b, server=server, block_table=table)
    assert torch.equal(b.call(prefill), moved.call(prefill))


def test_fp8_float8_and_uint8_views(device):
    """An FP8 E4M3 cache as float8_e4m3fn views or as raw uint8 views of the server tensor: identical bits,
    within tolerance of the reference with the host-float scales."""
    b = make_batch(device, kv_cache_dtype="fp8_e4m3", seed=2)
    assert b.server.dtype == torch.uint8 and (b.k_scale, b.v_scale) == (0.5, 0.25)
    as_uint8 = b.call(False)
    as_float8 = replace(b, server=b.server.view(torch.float8_e4m3fn)).call(False)
    assert torch.equal(as_uint8, as_float8)
    b.check(as_float8, "fp8")
    assert (as_float8[empty_rows(b)] == 0).all()


def test_fp8_scales_default_to_one(device):
    """k_scale / v_scale None read the FP8 cache at scale 1.0 (and scales are ignored for a cache in q's
    dtype)."""
    b = replace(make_batch(device, kv_cache_dtype="fp8_e4m3", seed=3), k_scale=None, v_scale=None)
    b.check(b.call(False), "fp8, scales None")


def test_positions_and_seq_lens_bound_exactly(device):
    """With positions / seq_lens each row drops tokens past its position or its request's length; without
    them nothing is dropped (vLLM's expand step already did), up to the last slot of the table: each
    matches the reference of its set."""
    case = make_attention_case(rows=6, num_reqs=1, num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16,
                               width=8, max_seq_len=40, with_gate=True, messy=False, share_prefix=False,
                               padding_rows=0, seed=4, device=device)
    seq_len = int(case.seq_lens[0])
    pages = -(-seq_len // 16)
    table = case.block_table[:, :pages]  # no spare column: the last tokens are in the table's last slot
    server = server_tensor(case.cache.k, case.cache.v, 0)
    g = torch.Generator().manual_seed(8)
    unwritten = torch.isnan(server)     # slots past seq_len: made finite, so attending them shows
    server[unwritten] = torch.randn(int(unwritten.sum()), generator=g).to(server.dtype).to(device)
    rows, tokens = 6, pages * 16
    width = tokens + 2
    positions = torch.arange(seq_len - rows, seq_len, dtype=torch.int64, device=device)
    logical = torch.full((rows, width + 1), -1, dtype=torch.int32, device=device)
    logical[:, :tokens] = torch.arange(tokens, dtype=torch.int32, device=device)
    logical[:, width] = tokens
    b = VllmBatch(q=case.q, gate=case.gate, server=server, logical_indices=logical, block_table=table,
                  token_to_req=case.token_to_req, positions=positions, seq_lens=case.seq_lens,
                  ref_indices=logical[:, :width])
    shorter = case.seq_lens - 2
    unbounded_pos, unbounded_len = bounds(b)
    assert unbounded_pos[0] == tokens - 1 and unbounded_len[0] == tokens

    free = b.call(True)
    b.check(free, "no bounds", positions=unbounded_pos, seq_lens=unbounded_len)
    causal = b.call(True, positions=positions)
    b.check(causal, "positions", seq_lens=unbounded_len)
    lengths = b.call(True, seq_lens=shorter)
    b.check(lengths, "seq_lens", positions=unbounded_pos, seq_lens=shorter)
    both = b.call(True, positions=positions, seq_lens=shorter)
    b.check(both, "positions and seq_lens", seq_lens=shorter)
    for name, x in (("positions", causal), ("seq_lens", lengths), ("both", both)):
        assert not torch.equal(x, free), name


def test_zero_width_selection(device):
    """``logical_indices`` of one column (W = 0, the count only): every row gives 0."""
    b = make_batch(device, specials=False)
    logical = torch.full((b.q.shape[0], 1), 5, dtype=torch.int32, device=device)
    out = replace(b, logical_indices=logical).call(False)
    assert out.shape == b.q.shape and (out == 0).all()


# ----------------------------------------------------------------------------------------------------------
# per-forward reuse


def two_layers(device, rows):
    """Two layers of one forward: one batch (rows, requests, table), two selections, q, gates and caches."""
    a = make_batch(device, rows=rows, seed=6)
    g = torch.Generator().manual_seed(7)
    keep = torch.rand(a.ref_indices.shape, generator=g).to(device) < 0.6
    ref = torch.where(keep & (a.ref_indices >= 0), a.ref_indices, -1)
    ref = torch.sort(torch.where(ref < 0, torch.iinfo(torch.int32).max, ref), dim=1).values
    ref = torch.where(ref == torch.iinfo(torch.int32).max, -1, ref).to(torch.int32)
    logical = a.logical_indices.clone()
    counts = (ref >= 0).sum(dim=1).to(torch.int32)
    for r in range(rows):  # the kept tokens, then the old entries (poison and leftovers) past the count
        n = int(counts[r])
        logical[r, :n] = ref[r, :n]
    logical[:, -1] = counts
    server = a.server.clone()
    written = ~torch.isnan(server)
    server[written] = torch.randn(int(written.sum()), generator=g).to(server.dtype).to(device)
    b = replace(a, q=torch.randn(a.q.shape, generator=g).to(a.q.dtype).to(device),
                gate=torch.randn(a.q.shape, generator=g).to(a.q.dtype).to(device), server=server,
                logical_indices=logical, ref_indices=ref)
    return a, b


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill-grouped"])
def test_forward_plans_reuse_is_bitwise(prefill, device, monkeypatch):
    """Two layers with different selections, two forwards: ForwardPlans gives the bits of plain calls, one
    plan per batch shape, whose buffers stay where the first forward put them. The prefill batch is two
    groups of 8 rows (the grouping threshold lowered to 16 rows)."""
    if prefill:
        monkeypatch.setattr(qsa.settings, "GROUPED_MIN_ROWS", 16)
    a, b = two_layers(device, 16 if prefill else 8)
    plain_a, plain_b = a.call(prefill), b.call(prefill)
    b.check(plain_b, "layer b")
    plans = qv.ForwardPlans()
    plans.begin_forward()
    assert torch.equal(a.call(prefill, plans=plans), plain_a)
    assert torch.equal(b.call(prefill, plans=plans), plain_b)
    (plan,) = plans.cached_plans()
    assert plan.routes.route == ("grouped" if prefill else "xqa")
    buffers = plan_buffers(plan)
    plans.begin_forward()
    assert torch.equal(b.call(prefill, plans=plans), plain_b)
    assert torch.equal(a.call(prefill, plans=plans), plain_a)
    assert plans.cached_plans() == (plan,) and plan_buffers(plan) == buffers
    assert (plans.forwards, plans.calls) == (2, 2)


def test_forward_plans_hint_and_capture_rules(device, monkeypatch):
    """begin_forward(max_query_len=) replaces use_prefill_config's hint for the forward (a plan of its
    own); a plan first made during CUDA-graph capture serves that forward only and is never kept."""
    a, b = two_layers(device, 8)
    plans = qv.ForwardPlans()
    with pytest.raises(RuntimeError, match="begin_forward"):
        a.call(False, plans=plans)
    plans.begin_forward(max_query_len=8)
    assert torch.equal(a.call(False, plans=plans), a.call(False))  # a hint: the same token sets
    (plan,) = plans.cached_plans()
    monkeypatch.setattr(qv, "_capturing", lambda device: True)
    plans.begin_forward()
    b.call(False, plans=plans)
    a.call(False, plans=plans)
    assert plans.cached_plans() == (plan,) and len(plans._captured) == 1
    plans.begin_forward()
    assert not plans._captured


def test_forward_plans_keep_captured_and_recent_plans(device, monkeypatch):
    """Plans of batch shapes no graph captured are kept for the most recent ``max_eager_plans`` shapes; a
    plan a graph captured is kept whatever comes after."""
    b = make_batch(device, rows=6, hq=2, hkv=1, width=8, specials=False, seed=4)

    def rows(n):
        return replace(b, q=b.q[:n], gate=b.gate[:n], logical_indices=b.logical_indices[:n],
                       token_to_req=b.token_to_req[:n], positions=b.positions[:n])

    plans = qv.ForwardPlans(max_eager_plans=2)
    plans.begin_forward()
    rows(3).call(False, plans=plans)
    monkeypatch.setattr(qv, "_capturing", lambda device: True)
    rows(3).call(False, plans=plans)   # captured: kept from now on
    monkeypatch.setattr(qv, "_capturing", lambda device: False)
    (captured,) = plans.captured_plans()
    for n in (4, 5, 4, 6):  # 4 used again: 5 is the least recently used
        rows(n).call(False, plans=plans)
    kept = plans.cached_plans()
    assert [p.num_rows for p in kept] == [3, 4, 6] and kept[0] is captured
    plans.clear()
    assert not plans.cached_plans() and not plans.captured_plans()


def test_bound_vectors_are_kept_and_sliced(monkeypatch):
    """The bounds standing in for positions / seq_lens: one vector per (device, dtype, value), sliced per
    call, kept when outgrown (a graph may hold it); under capture a miss is a fresh vector, not kept."""
    vectors = qv._BoundVectors()
    monkeypatch.setattr(qv, "_capturing", lambda device: True)
    fresh = vectors.get(5, 9, torch.int64, torch.device("cpu"))
    assert fresh.tolist() == [9] * 5 and not vectors._vectors
    monkeypatch.setattr(qv, "_capturing", lambda device: False)
    first = vectors.get(5, 9, torch.int64, torch.device("cpu"))
    assert vectors.get(3, 9, torch.int64, torch.device("cpu")).data_ptr() == first.data_ptr()
    grown = vectors.get(1000, 9, torch.int64, torch.device("cpu"))
    assert grown.shape == (1000,) and (grown == 9).all() and vectors._retired[0].data_ptr() == first.data_ptr()
    assert vectors.get(4, 7, torch.int32, torch.device("cpu")).tolist() == [7] * 4


def test_bound_slices_are_kept_per_size_but_never_a_capture_s_own(monkeypatch):
    """A call of a seen size gets the same slice (no new tensor); a vector made during capture (the graph's
    own memory) is never handed to a later call, which gets a slice of a kept vector instead."""
    vectors = qv._BoundVectors()
    cpu = torch.device("cpu")
    monkeypatch.setattr(qv, "_capturing", lambda device: True)
    fresh = vectors.get(6, 3, torch.int32, cpu)
    monkeypatch.setattr(qv, "_capturing", lambda device: False)
    later = vectors.get(6, 3, torch.int32, cpu)
    assert later is not fresh and later._base is not None and later.tolist() == [3] * 6
    assert vectors.get(6, 3, torch.int32, cpu) is later
    assert vectors.get(6, 4, torch.int32, cpu) is not later and vectors.get(5, 3, torch.int32, cpu).shape == (5,)


# ----------------------------------------------------------------------------------------------------------
# argument checks


def _bad(b: VllmBatch, what: str):
    """Arguments of ``b``'s call with one thing wrong."""
    k, v = b.kv
    args = dict(q=b.q, k_cache=k, v_cache=v, logical_indices=b.logical_indices, block_table=b.block_table,
                token_to_req=b.token_to_req, use_prefill_config=False, output_gate=b.gate)
    rows, hq, d = b.q.shape
    if what == "q 2-D":
        args["q"] = b.q.reshape(rows, -1)
    elif what == "q fp32":
        args["q"] = b.q.float()
    elif what == "q strided D":
        args["q"] = torch.cat([b.q, b.q], dim=2)[..., ::2]
    elif what == "q D 8":
        args["q"] = b.q[..., :8]
    elif what == "cache dtype":
        args["k_cache"], args["v_cache"] = k.float(), v.float()
    elif what == "cache e5m2":
        args["k_cache"], args["v_cache"] = (x.to(torch.float8_e5m2) for x in (k, v))
    elif what == "cache dtypes differ":
        args["v_cache"] = v.to(torch.bfloat16)
    elif what == "cache 3-D":
        args["k_cache"] = k[0]
    elif what == "cache shapes differ":
        args["v_cache"] = v[:-1]
    elif what == "page 6":
        args["k_cache"], args["v_cache"] = k[:, :6], v[:, :6]
    elif what == "heads":
        args["q"], args["output_gate"] = b.q[:, :3], b.gate[:, :3]
    elif what == "indices int64":
        args["logical_indices"] = b.logical_indices.long()
    elif what == "indices 1-D":
        args["logical_indices"] = b.logical_indices[:, 0]
    elif what == "indices rows":
        args["logical_indices"] = b.logical_indices[:-1]
    elif what == "indices no column":
        args["logical_indices"] = b.logical_indices[:, :0]
    elif what == "indices strided":
        args["logical_indices"] = b.logical_indices[:, ::2]
    elif what == "table int64":
        args["block_table"] = b.block_table.long()
    elif what == "table 1-D":
        args["block_table"] = b.block_table[0]
    elif what == "use_prefill_config int":
        args["use_prefill_config"] = 1
    elif what == "gate None":
        args["output_gate"] = None
    elif what == "gate dtype":
        args["output_gate"] = b.gate.float()
    elif what == "gate shape":
        args["output_gate"] = b.gate[:-1]
    elif what == "gate strided":
        args["output_gate"] = b.gate.transpose(1, 2).contiguous().transpose(1, 2)
    elif what == "out dtype":
        args["out"] = torch.empty(b.q.shape, dtype=torch.float32, device=b.q.device)
    elif what == "k_scale string":
        args["k_scale"] = "1"
    elif what == "fp8 k_scale 0":
        args["k_cache"], args["v_cache"] = k.view(torch.uint8)[..., :d], v.view(torch.uint8)[..., :d]
        args["k_scale"] = 0.0
    elif what == "positions shape":
        args["positions"] = b.positions[:-1]
    elif what == "seq_lens int64":
        args["seq_lens"] = b.seq_lens.long()
    elif what == "token_to_req float":
        args["token_to_req"] = b.token_to_req.float()
    elif what == "plans":
        args["plans"] = object()
    else:
        raise AssertionError(what)
    return args


BAD = [
    ("q 2-D", ValueError, r"q must be 3-D"),
    ("q fp32", TypeError, r"q must have dtype bfloat16, float16"),
    ("q strided D", ValueError, r"q must have stride 1 along D"),
    ("q D 8", ValueError, r"q's head dim D must be one of"),
    ("cache dtype", TypeError, r"k_cache must have q's dtype"),
    ("cache e5m2", TypeError, r"float8_e5m2 caches are not supported"),
    ("cache dtypes differ", TypeError, r"k_cache and v_cache must have one dtype"),
    ("cache 3-D", ValueError, r"k_cache must be 4-D"),
    ("cache shapes differ", ValueError, r"v_cache shape .* must equal k_cache shape"),
    ("page 6", ValueError, r"k_cache page size .* multiple of 4"),
    ("heads", ValueError, r"q's heads \(3\) must be a multiple of k_cache's KV heads \(2\)"),
    ("indices int64", TypeError, r"logical_indices must have dtype int32"),
    ("indices 1-D", ValueError, r"logical_indices must be 2-D"),
    ("indices rows", ValueError, r"logical_indices must have q's 8 rows"),
    ("indices no column", ValueError, r"logical_indices must have at least 1 column"),
    ("indices strided", ValueError, r"logical_indices must have stride 1"),
    ("table int64", TypeError, r"block_table must have dtype int32"),
    ("table 1-D", ValueError, r"block_table must be 2-D"),
    ("use_prefill_config int", TypeError, r"use_prefill_config must be a bool"),
    ("gate None", TypeError, r"output_gate is mandatory"),
    ("gate dtype", TypeError, r"output_gate must have dtype float16"),
    ("gate shape", ValueError, r"output_gate must have q's shape"),
    ("gate strided", ValueError, r"output_gate must have q's shape"),
    ("out dtype", TypeError, r"out must have dtype float16"),
    ("k_scale string", TypeError, r"k_scale must be a float"),
    ("fp8 k_scale 0", ValueError, r"k_scale must be > 0"),
    ("positions shape", ValueError, r"positions must have shape"),
    ("seq_lens int64", TypeError, r"seq_lens must have dtype int32"),
    ("token_to_req float", TypeError, r"token_to_req must have dtype"),
    ("plans", TypeError, r"plans must be a ForwardPlans"),
]


@pytest.mark.parametrize("what,exc,match", BAD, ids=[w for w, _, _ in BAD])
def test_bad_arguments_raise_naming_them(what, exc, match, device):
    """Each bad argument is refused, also right after its batch's good layout passed the checks (the
    adapter remembers passed layouts: a bad one must never be taken for one)."""
    b = make_batch(device, specials=False)
    k, v = b.kv
    good = (b.q, k, v, b.logical_indices, b.block_table, False, b.gate, None)
    qv._checked_args(*good)
    assert qv._PASSED, "the good layout was not remembered"
    with pytest.raises(exc, match=match):
        qv.qsa_sparse_paged_attention(**_bad(b, what))


def test_a_remembered_layout_gives_the_checks_verdict():
    """The remembered verdict is the checks' own: the cache dtype, and the gate as the op takes it (viewed
    as q where it comes flat)."""
    b = make_batch("cpu", specials=False)
    k, v = b.kv
    flat = b.gate.reshape(b.q.shape[0], -1)
    for gate in (b.gate, flat):
        args = (b.q, k, v, b.logical_indices, b.block_table, True, gate, None)
        first, second = qv._checked_args(*args), qv._checked_args(*args)
        assert first[0] == second[0] == qv._check_args(*args)[0] == "auto"
        assert second[1].shape == b.q.shape and second[1].data_ptr() == gate.data_ptr()


def test_importing_qsa_never_imports_vllm():
    code = ("import sys, qsa, qsa.integrations, qsa.integrations.vllm as m; "
            "assert callable(m.qsa_sparse_paged_attention); "
            "assert not [n for n in sys.modules if n == 'vllm' or n.startswith('vllm.')], 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------------------------------------
# GPU: realistic size (W = 2051, page 16, D 256, Hq/Hkv 6/1)


def realistic_batch(rows_of, seq_lens, *, page=16, hq=6, hkv=1, d=256, k=512, seed=0, device="cuda"):
    """vLLM's inputs for requests of lengths ``seq_lens``, request ``i`` owning rows at its last
    ``rows_of[i]`` positions; each row: ``min(k, visible)`` random visible 4-token blocks ascending, expanded,
    then its causal tail, then -1, then the count (W = 4k + 3)."""
    g = torch.Generator().manual_seed(seed)
    width = 4 * k + 3
    pages = [-(-n // page) for n in seq_lens]
    max_blocks = max(pages) + 1
    nb = sum(pages) + 8
    perm = torch.randperm(nb, generator=g)
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    server = (torch.randn(nb, hkv, page, 2 * d, generator=g) * 0.5).to(torch.bfloat16)
    logical, t2r, pos = [], [], []
    for i, (n_rows, n) in enumerate(zip(rows_of, seq_lens)):
        for p in range(n - n_rows, n):
            visible = (p + 1) // 4
            blocks = torch.sort(torch.randperm(visible, generator=g)[:k]).values
            toks = (blocks[:, None] * 4 + torch.arange(4)).flatten().tolist() + list(range(4 * visible, p + 1))
            logical.append(toks + [-1] * (width - len(toks)) + [len(toks)])
            t2r.append(i)
            pos.append(p)
    rows = len(logical)
    as_dev = dict(device=device)
    return VllmBatch(q=(torch.randn(rows, hq, d, generator=g) * 0.5).to(torch.bfloat16).to(device),
                     gate=torch.randn(rows, hq, d, generator=g).to(torch.bfloat16).to(device),
                     server=server.to(device), logical_indices=torch.tensor(logical, dtype=torch.int32, **as_dev),
                     block_table=table.to(device), token_to_req=torch.tensor(t2r, dtype=torch.int32, **as_dev),
                     positions=torch.tensor(pos, dtype=torch.int64, **as_dev),
                     seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **as_dev),
                     ref_indices=torch.tensor([r[:-1] for r in logical], dtype=torch.int32, **as_dev))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_realistic_size():
    """A 128-row prefill chunk of one request at 6000 tokens and a 48-request decode batch: the fp64
    reference, bitwise page relocation, ForwardPlans = plain calls, and a captured two-layer forward
    replayed on new data = eager."""
    prefill = realistic_batch([128], [6000], seed=1)
    decode = realistic_batch([1] * 48, [300 + 97 * i for i in range(48)], seed=2)
    for b, use_prefill in ((prefill, True), (decode, False)):
        out = b.call(use_prefill)
        b.check(out, "prefill" if use_prefill else "decode")
        with_bounds = b.call(use_prefill, positions=b.positions, seq_lens=b.seq_lens)
        assert torch.equal(out, with_bounds)  # vLLM's rows hold no token past either bound
        nb = b.server.shape[0]
        mapping = torch.randperm(2 * nb, device="cuda")[:nb]
        server = torch.zeros((2 * nb, *b.server.shape[1:]), dtype=b.server.dtype, device="cuda")
        server[mapping] = b.server
        table = torch.where(b.block_table >= 0, mapping[b.block_table.clamp(min=0).long()].to(torch.int32),
                            b.block_table)
        assert torch.equal(out, replace(b, server=server, block_table=table).call(use_prefill))
        plans = qv.ForwardPlans()
        for _ in range(2):
            plans.begin_forward()
            assert torch.equal(out, b.call(use_prefill, plans=plans))

    # one decode forward of two layers (own selections, q and gates; one batch) captured in a CUDA graph,
    # then replayed with new inputs
    lens = [300 + 97 * i for i in range(48)]

    def layer(seed):  # decode's batch and cache, another selection, q and gate
        other = realistic_batch([1] * 48, lens, seed=seed)
        return replace(decode, q=other.q, gate=other.gate, logical_indices=other.logical_indices)

    static = [layer(4), layer(5)]
    fresh = [layer(6), layer(7)]
    outs = [torch.empty_like(decode.q) for _ in static]
    plans = qv.ForwardPlans()

    def forward():
        plans.begin_forward()
        for x, o in zip(static, outs):
            x.call(False, out=o, plans=plans)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # eager warm-up: makes the plan and the bound vectors outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for x, new in zip(static, fresh):
        x.q.copy_(new.q)
        x.gate.copy_(new.gate)
        x.logical_indices.copy_(new.logical_indices)
    graph.replay()
    torch.cuda.synchronize()
    for new, o in zip(fresh, outs):
        assert torch.equal(o, new.call(False))
