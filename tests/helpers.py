"""Helpers the tests share: random attention cases, poisoned buffers, bitwise and reference checks.

Test modules import these from here, never from each other; ``conftest.py`` holds only pytest set-up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from qsa.attention.reference import assert_close_like_torch, reference_attention
from qsa.cache import BlockAllocator, PagedKVCache, allocate_kv_cache, quantize_e4m3

HAS_CUDA = torch.cuda.is_available()


def slow(*values):
    """A parametrize entry marked ``slow``: a further variant, left out of the default run."""
    return pytest.param(*values, marks=pytest.mark.slow)


def poisoned(shape, dtype, device):
    """An output buffer filled with NaN (or -1 for integers) so unwritten elements show."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -1, dtype=dtype, device=device)


def assert_bitwise(a, b, what):
    """``(out, lse)`` pairs ``a`` and ``b`` are equal bit for bit."""
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"{what}: outputs are not bitwise equal"


def ascending_rows(indices: torch.Tensor) -> torch.Tensor:
    """Each row as ``select_tokens`` orders it: distinct non-negative entries ascending, then -1."""
    big = torch.iinfo(torch.int64).max
    key = torch.sort(torch.where(indices < 0, big, indices.long()), dim=1).values
    dup = torch.zeros_like(key, dtype=torch.bool)
    dup[:, 1:] = key[:, 1:] == key[:, :-1]
    key = torch.sort(torch.where(dup, big, key), dim=1).values
    return torch.where(key == big, -1, key).to(torch.int32)


def check_against_reference(case, got, name="attention"):
    """``got = (out, lse)`` of ``case`` within the project's tolerance of the fp64 reference."""
    ref, ref_lse = case.run(reference_attention, compute_dtype=torch.float64)
    low, low_lse = case.run(reference_attention, compute_dtype=case.q.dtype)
    assert_close_like_torch(got[0], ref, low, lse=got[1], ref_lse=ref_lse, torch_lse=low_lse, name=name)


@dataclass
class AttentionCase:
    """A random sparse paged attention problem (see :func:`make_attention_case`).

    Attributes:
        q: ``[rows, Hq, D]``; gate: ``[rows, Hq, D]`` or None.
        cache: the :class:`~qsa.cache.PagedKVCache` (NaN / 0x7F in every slot no kept token uses).
        indices: ``[rows, W]`` int32; block_table: ``[num_reqs, max_blocks]`` int32;
        token_to_req: ``[rows]`` int32; positions: ``[rows]`` int64; seq_lens: ``[num_reqs]`` int32.
    """

    q: torch.Tensor
    gate: torch.Tensor | None
    cache: PagedKVCache
    indices: torch.Tensor
    block_table: torch.Tensor
    token_to_req: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor

    def run(self, fn, **kwargs):
        """``fn(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, ...)``."""
        c = self.cache
        kw = dict(gate=self.gate, kv_cache_dtype=c.kv_cache_dtype, k_scale=c.k_scale, v_scale=c.v_scale)
        kw.update(kwargs)
        return fn(self.q, c.k, c.v, self.indices, self.block_table, self.token_to_req, self.positions,
                  self.seq_lens, **kw)

    def plan_inputs(self) -> dict:
        """Keyword arguments of the planners (``indices`` .. ``num_blocks``)."""
        return dict(indices=self.indices, block_table=self.block_table, token_to_req=self.token_to_req,
                    positions=self.positions, seq_lens=self.seq_lens, block_size=self.cache.block_size,
                    num_blocks=self.cache.num_blocks)

    def relocated(self, mapping: torch.Tensor, *, num_blocks_out: int | None = None) -> "AttentionCase":
        """The same problem with the cache's pages moved by ``mapping`` (unused blocks NaN)."""
        cache, table = self.cache.relocated(self.block_table, mapping, num_blocks_out=num_blocks_out,
                                            fill="nan")
        return replace(self, cache=cache, block_table=table)

    def take_rows(self, rows) -> "AttentionCase":
        """The problem of rows ``rows`` (a list or tensor of row numbers, in that order, repeats allowed) of
        this one: the same cache, table and lengths."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.q.device)
        return replace(self, q=self.q[rows], gate=None if self.gate is None else self.gate[rows],
                       indices=self.indices[rows], token_to_req=self.token_to_req[rows],
                       positions=self.positions[rows])

    def with_permuted_indices(self, generator: torch.Generator) -> "AttentionCase":
        """The same problem with the entries of each ``indices`` row shuffled."""
        perm = torch.argsort(torch.rand(self.indices.shape, generator=generator), dim=1)
        return replace(self, indices=torch.gather(self.indices, 1, perm.to(self.indices.device)))


def make_attention_case(*, rows: int = 13, num_reqs: int = 3, num_q_heads: int = 2, num_kv_heads: int = 1,
                        head_dim: int = 16, block_size: int = 16, width: int = 24, max_seq_len: int = 70,
                        dtype=torch.float16, kv_cache_dtype: str = "auto", layout: str = "interleaved",
                        with_gate: bool = False, messy: bool = True, share_prefix: bool = True,
                        padding_rows: int = 2, spare_blocks: int = 3, seed: int = 0,
                        device="cpu") -> AttentionCase:
    """Build a random problem with the awkward cases of docs/spec.md section 4.

    Requests get random lengths and pages from a shuffled :class:`~qsa.cache.BlockAllocator` (block 0
    reserved); with ``share_prefix`` request 1 aliases request 0's first page. Only slots of tokens
    ``< seq_len`` are written (directly, not through the Triton kernel); the rest of the cache is NaN.
    ``messy`` adds duplicates, -1, tokens past the position, past ``seq_len`` and past the table, an
    entry -1 and an entry ``>= num_blocks`` in the block table. ``padding_rows`` rows get an invalid
    request or position -1.
    """
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    lens = [randint(1, max_seq_len) for _ in range(num_reqs)]
    if share_prefix and num_reqs >= 2:
        lens[0] = max(lens[0], block_size)
        lens[1] = max(lens[1], block_size + 1)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    needed = sum(-(-n // block_size) for n in lens)
    num_blocks = needed + spare_blocks + 1
    alloc = BlockAllocator(num_blocks, block_size, generator=g)
    for r, n in enumerate(lens):
        if r == 1 and share_prefix:
            alloc.share_prefix(0, 1, 1)
        alloc.allocate(r, n)
    table = alloc.block_table(range(num_reqs), max_blocks=max_blocks)

    cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                              kv_cache_dtype=kv_cache_dtype, layout=layout, device=device, fill="nan",
                              k_scale=0.5 if kv_cache_dtype == "fp8_e4m3" else 1.0,
                              v_scale=0.25 if kv_cache_dtype == "fp8_e4m3" else 1.0)
    for r, n in enumerate(lens):
        slots = alloc.slot_mapping(r, 0, n)
        for name, scale in (("k", cache.k_scale), ("v", cache.v_scale)):
            x = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
            if kv_cache_dtype == "fp8_e4m3":
                x = quantize_e4m3(x * scale * 4, scale)
            getattr(cache, name)[slots // block_size, slots % block_size] = x.to(device)

    if messy:
        # Invalidate one page of the last request: -1, and (if it has two) one out of range.
        last = num_reqs - 1
        nb_last = len(alloc.blocks(last))
        table[last, nb_last - 1] = -1
        if nb_last >= 2:
            table[last, 0] = num_blocks + 5

    token_to_req, positions, idx_rows = [], [], []
    for r in range(rows):
        req = randint(0, num_reqs - 1)
        pos = randint(0, lens[req] - 1)
        k = min(width, pos + 1)
        toks = torch.randperm(pos + 1, generator=g)[:k].tolist()
        if messy and width >= 8:
            extra = [-1, pos + randint(1, 5), lens[req] + randint(0, 3),
                     max_blocks * block_size + randint(0, 40), toks[0], toks[-1]]
            toks = toks[:width - len(extra)] + extra
        toks += [-1] * (width - len(toks))
        perm = torch.randperm(width, generator=g).tolist()
        idx_rows.append([toks[i] for i in perm])
        token_to_req.append(req)
        positions.append(pos)
    for r in range(min(padding_rows, rows)):
        if r % 2 == 0:
            token_to_req[r] = -1 if r % 4 == 0 else num_reqs + 2
        else:
            positions[r] = -1

    q = torch.randn(rows, num_q_heads, head_dim, generator=g).to(dtype)
    gate = torch.randn(rows, num_q_heads, head_dim, generator=g).to(dtype) if with_gate else None
    as_dev = dict(device=device)
    return AttentionCase(
        q=q.to(device), gate=gate.to(device) if gate is not None else None, cache=cache,
        indices=torch.tensor(idx_rows, dtype=torch.int32, **as_dev).reshape(rows, width),
        block_table=table.to(device),
        token_to_req=torch.tensor(token_to_req, dtype=torch.int32, **as_dev),
        positions=torch.tensor(positions, dtype=torch.int64, **as_dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, **as_dev))
