"""Workloads: a KV cache of random data in a shuffled page layout, selections with a controllable
adjacent-row overlap (or from the real selection stage on synthetic keys), and their statistics.

Definitions (also in ``benchmarks/README.md``):

* *overlap*: the mean, over pairs of adjacent rows of one request, of the fraction of a row's selected
  4-token blocks that the next row also selects (the causal tail is not a block and is not counted).
* *union per group*: distinct physical page4 microblocks that a group of 8 adjacent rows reads; the
  grouped route loads each of them once for the whole group.
"""

from __future__ import annotations
import qsa.cache.paged

from dataclasses import dataclass

import numpy as np
import torch

from .registry import Scenario

GROUP_ROWS = 8
INDEX_HEADS = 4
INDEX_DIM = 128
FP8_SCALE = 1.0 / 32
"""K and V scale of FP8 caches: N(0, 1) data stored as ``x / scale`` stays well inside E4M3's +-448."""
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Workload:
    """One attention problem on the device, ready for ``qsa.sparse_paged_attention``.

    Attributes:
        q: ``[rows, Hq, D]``; cache: :class:`qsa.cache.paged.PagedKVCache` (block 0 unused, filled with NaN).
        indices: ``[rows, 4k + 3]`` int32; block_table: ``[num_reqs, max_blocks]`` int32 (shuffled pages);
        token_to_req: ``[rows]`` int32; positions: ``[rows]`` int64; seq_lens: ``[num_reqs]`` int32.
        stats: see :func:`selection_stats`.
    """

    q: torch.Tensor
    cache: object
    indices: torch.Tensor
    block_table: torch.Tensor
    token_to_req: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    stats: dict

    @property
    def args(self) -> tuple:
        """Positional arguments of ``sparse_paged_attention`` after ``q``."""
        return (self.cache.k, self.cache.v, self.indices, self.block_table, self.token_to_req,
                self.positions, self.seq_lens)

    @property
    def cache_kwargs(self) -> dict:
        c = self.cache
        return dict(kv_cache_dtype=c.kv_cache_dtype, k_scale=c.k_scale, v_scale=c.v_scale)


# ------------------------------------------------------------------------------------------------
# rows and pages


def row_layout(rows: int, num_reqs: int, context: int):
    """``token_to_req`` and ``positions`` (numpy int64): rows spread evenly over the requests, each
    request's rows at the end of its context, consecutive."""
    if rows % num_reqs:
        raise ValueError(f"rows ({rows}) must be a multiple of num_reqs ({num_reqs})")
    per = rows // num_reqs
    if per > context:
        raise ValueError(f"{per} rows per request do not fit a context of {context}")
    req = np.repeat(np.arange(num_reqs, dtype=np.int64), per)
    pos = np.tile(np.arange(context - per, context, dtype=np.int64), num_reqs)
    return req, pos


def shuffled_block_table(num_reqs: int, context: int, block_size: int, generator: torch.Generator):
    """``([num_reqs, max_blocks] int32 table, num_blocks)``: every logical block of every request gets
    its own physical block, in a random order; physical block 0 is left out (it may hold another
    layer's state, and is filled with NaN here so any read of it shows)."""
    max_blocks = -(-context // block_size)
    used = num_reqs * max_blocks
    perm = torch.randperm(used, generator=generator) + 1
    return perm.reshape(num_reqs, max_blocks).to(torch.int32), used + 1


def fill_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                  kv_cache_dtype: str, device, seed: int):
    """An interleaved :class:`qsa.cache.paged.PagedKVCache` of N(0, 1) data (E4M3 of N(0, 1) / scale for FP8);
    block 0 holds NaN (0x7F bytes for FP8)."""
    from qsa.cache.paged import allocate_kv_cache, quantize_e4m3

    fp8 = kv_cache_dtype == "fp8_e4m3"
    scale = FP8_SCALE if fp8 else 1.0
    cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                              kv_cache_dtype=kv_cache_dtype, layout="interleaved", device=device,
                              k_scale=scale, v_scale=scale)
    store = cache.storage
    gen = torch.Generator(device=device).manual_seed(seed)
    per_block = store[0].numel()
    step = max(1, (1 << 26) // per_block)  # 64M elements per chunk bounds the fp32 temporaries
    for b0 in range(1, num_blocks, step):
        chunk = store[b0:b0 + step]
        if fp8:
            x = torch.randn(chunk.shape, generator=gen, device=device, dtype=torch.float16)
            chunk.copy_(quantize_e4m3(x, scale))
        else:
            chunk.normal_(generator=gen)
    store[0].fill_(0x7F if fp8 else float("nan"))
    return cache


# ------------------------------------------------------------------------------------------------
# selections


def visible_blocks(positions: np.ndarray, seq_lens_rows: np.ndarray) -> np.ndarray:
    """Candidate blocks per row (docs/spec.md section 2): ``min((pos + 1) // 4, seq_len // 4)``."""
    return np.minimum((positions + 1) // 4, seq_lens_rows // 4)


def walk_blocks(token_to_req: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray, *, topk: int,
                overlap: float, seed: int) -> np.ndarray:
    """Block selections with a controllable adjacent-row overlap.

    A random walk over block choices: the first row of a request picks ``topk`` distinct visible
    blocks at random; each next row of the same request keeps a random ``overlap`` fraction of the
    previous row's blocks (stochastically rounded, so the mean is exact) and replaces the rest with
    blocks it did not select, drawn uniformly from its visible range. Rows whose visible range is
    at most ``topk`` are dense (``0 .. visible - 1``), as the selection stage makes them.

    Returns:
        ``[rows, topk]`` int64, each row ascending, padded with -1 at the end.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    rng = np.random.default_rng(seed)
    rows = positions.shape[0]
    vis = visible_blocks(positions, seq_lens[token_to_req])
    out = np.full((rows, topk), -1, dtype=np.int64)
    inset = np.zeros(max(int(vis.max(initial=0)), 1), dtype=bool)
    cur = np.empty(0, dtype=np.int64)
    replace_mean = (1.0 - overlap) * topk
    for r in range(rows):
        v = int(vis[r])
        new_req = r == 0 or token_to_req[r] != token_to_req[r - 1]
        if new_req:
            inset[cur] = False
            cur = np.empty(0, dtype=np.int64)
        if v <= topk:
            inset[cur] = False
            cur = np.arange(v, dtype=np.int64)
            inset[cur] = True
        else:
            n_rep = 0
            if len(cur):
                n_rep = int(replace_mean) + int(rng.random() < replace_mean - int(replace_mean))
                n_rep = min(n_rep, v - len(cur), len(cur))
                if n_rep:
                    drop = rng.choice(len(cur), n_rep, replace=False)
                    inset[cur[drop]] = False
                    cur = np.delete(cur, drop)
            need = topk - len(cur)
            new = _draw_unselected(rng, inset, v, need, v - len(cur))
            inset[new] = True
            cur = np.concatenate([cur, new])
        out[r, :len(cur)] = np.sort(cur)
    return out


def _draw_unselected(rng, inset: np.ndarray, v: int, need: int, free: int) -> np.ndarray:
    """``need`` distinct blocks of ``[0, v)`` whose ``inset`` is False (``free`` of them exist)."""
    if need <= 0:
        return np.empty(0, dtype=np.int64)
    if free <= 4 * need:
        return rng.choice(np.flatnonzero(~inset[:v]), need, replace=False).astype(np.int64)
    got = np.empty(0, dtype=np.int64)
    while len(got) < need:
        draw = rng.integers(0, v, size=2 * (need - len(got)) + 8)
        draw = np.unique(np.concatenate([got, draw[~inset[draw]]]))
        got = draw if len(draw) <= need else rng.choice(draw, need, replace=False)
    return got.astype(np.int64)


def expand_blocks(blocks: torch.Tensor, positions: torch.Tensor, seq_row: torch.Tensor,
                  row_ok: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``[rows, k]`` (ascending, -1 padded at the end) -> tokens ``[rows, 4k + 3]`` int32 as the
    selection stage emits them (docs/spec.md section 2): ``4b .. 4b + 3`` per block, then the causal tail
    ``((pos + 1) // 4) * 4 .. pos``, then -1; tokens ``>= seq_len`` become -1."""
    rows, k = blocks.shape
    dev = blocks.device
    blocks = blocks.long()
    pos = positions.long()
    n_kept = (blocks >= 0).sum(1)
    toks = (4 * blocks[:, :, None] + torch.arange(4, device=dev)).reshape(rows, 4 * k)
    j = torch.arange(4 * k + 3, device=dev)[None, :]
    tail = ((pos + 1) // 4 * 4)[:, None] + (j - 4 * n_kept[:, None])
    out = torch.where(j < 4 * n_kept[:, None], torch.nn.functional.pad(toks, (0, 3), value=-1),
                      torch.where(tail <= pos[:, None], tail, -1))
    keep = (out >= 0) & (out < seq_row.long()[:, None])
    if row_ok is not None:
        keep &= row_ok[:, None]
    return torch.where(keep, out, -1).to(torch.int32)


def synthetic_index_keys(scn: Scenario, num_blocks: int, *, device, dyadic: bool, drift: float = 0.0):
    """Index queries ``[rows, 4, 128]`` and a compressed-key cache ``[num_blocks, block_size // 4, 128]``
    in bf16.

    ``dyadic``: entries ``i / 8`` with integer ``|i| <= 16``; every product and partial sum of a score
    is then exact in fp32, so scores, and hence the exact top-k, do not depend on summation order.
    ``drift`` > 0: the queries of one request follow a stationary AR(1) walk
    ``q_r = sqrt(1 - drift**2) * q_{r-1} + drift * e_r`` (N(0, 1) entries throughout), so adjacent rows
    select similar blocks, as real prefill rows do; smaller drift, higher overlap.
    """
    gen = torch.Generator().manual_seed(scn.seed + 17)
    rows = scn.rows
    shape_kc = (num_blocks, scn.block_size // 4, INDEX_DIM)
    if dyadic:
        q = torch.randint(-16, 17, (rows, INDEX_HEADS, INDEX_DIM), generator=gen).float() / 8
        kc = torch.randint(-16, 17, shape_kc, generator=gen).float() / 8
    else:
        kc = torch.randn(shape_kc, generator=gen)
        per = rows // scn.num_reqs
        q = torch.randn(scn.num_reqs, per, INDEX_HEADS, INDEX_DIM, generator=gen)
        keep = (1.0 - drift ** 2) ** 0.5
        for i in range(1, per):
            q[:, i] = keep * q[:, i - 1] + drift * q[:, i]
        q = q.reshape(rows, INDEX_HEADS, INDEX_DIM)
    return q.to(torch.bfloat16).to(device), kc.to(torch.bfloat16).to(device)


# ------------------------------------------------------------------------------------------------
# statistics


def kept_entries(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int, num_blocks: int):
    """``(keep, phys)``, both ``[rows, W]`` in the rows' own order: whether each entry passes the checks of
    docs/spec.md section 4 (a valid row; a token that is valid, visible, inside the sequence and the table, whose
    table entry is a block of the cache; duplicates are all marked), and its physical block."""
    idx = indices.long()
    num_reqs, max_blocks = block_table.shape
    req = token_to_req.long()
    pos = positions.long()
    row_ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req_c = torch.where(row_ok, req, 0)
    seq = seq_lens.long()[req_c] if num_reqs else torch.zeros_like(req)
    lb = torch.div(idx, block_size, rounding_mode="floor")
    in_table = (idx >= 0) & (lb < max_blocks)
    phys = block_table.long()[req_c[:, None], lb.clamp(0, max(max_blocks - 1, 0))]
    keep = (row_ok[:, None] & in_table & (idx < seq[:, None]) & (idx <= pos[:, None])
            & (phys >= 0) & (phys < num_blocks))
    return keep, phys


def kept_tokens(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int, num_blocks: int):
    """Each row's attended set ``T_r`` (docs/spec.md section 4), vectorised.

    Returns:
        ``(tokens, phys, keep)``: ``[rows, W]`` int64 tokens sorted ascending per row, their physical
        blocks, and a bool mask of the entries in ``T_r`` (valid, visible, first of duplicates).
    """
    idx = indices.long()
    keep, phys = kept_entries(indices, block_table, token_to_req, positions, seq_lens, block_size=block_size,
                              num_blocks=num_blocks)
    big = torch.iinfo(torch.int64).max
    tokens, order = torch.sort(torch.where(keep, idx, big), dim=1)
    phys = torch.gather(phys, 1, order)
    keep = tokens != big
    keep[:, 1:] &= tokens[:, 1:] != tokens[:, :-1]
    return tokens, phys, keep


def block_sets(tokens: torch.Tensor, keep: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Selected 4-token blocks per row: ``[rows, W]`` int64 ascending distinct blocks ``t // 4`` of kept
    tokens below the visible range (the causal tail's block is excluded), padded with int64 max."""
    big = torch.iinfo(torch.int64).max
    b = torch.where(keep & (tokens // 4 < visible[:, None]), tokens // 4, big)
    b = torch.sort(b, dim=1).values
    dup = torch.zeros_like(keep)
    dup[:, 1:] = b[:, 1:] == b[:, :-1]
    return torch.sort(torch.where(dup, big, b), dim=1).values


def adjacent_overlap(blocks: torch.Tensor, token_to_req: torch.Tensor) -> float | None:
    """Mean fraction of a row's blocks that the next row of the same request also selects."""
    big = torch.iinfo(torch.int64).max
    if blocks.shape[0] < 2:
        return None
    cur, nxt = blocks[:-1], blocks[1:].contiguous()
    pair = (token_to_req[:-1] == token_to_req[1:])
    size = (cur != big).sum(1)
    pair &= size > 0
    if not bool(pair.any()):
        return None
    where = torch.searchsorted(nxt, cur.contiguous()).clamp(max=nxt.shape[1] - 1)
    found = (torch.gather(nxt, 1, where) == cur) & (cur != big)
    frac = found.sum(1).double() / size.clamp(min=1).double()
    return float(frac[pair].mean())


def group_unions(phys: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor, *, block_size: int,
                 group_rows: int = GROUP_ROWS) -> torch.Tensor:
    """``[num_groups]`` int64 distinct physical microblocks each group of ``group_rows`` adjacent rows
    reads (the last group may be partial)."""
    rows, width = tokens.shape
    big = torch.iinfo(torch.int64).max
    mb = torch.where(keep, phys * (block_size // 4) + (tokens % block_size) // 4, big)
    groups = -(-rows // group_rows)
    pad = groups * group_rows - rows
    if pad:
        mb = torch.cat([mb, torch.full((pad, width), big, dtype=mb.dtype, device=mb.device)])
    out = torch.empty(groups, dtype=torch.int64, device=mb.device)
    step = max(1, (1 << 24) // (group_rows * width))
    for g0 in range(0, groups, step):
        s = torch.sort(mb[g0 * group_rows:(g0 + step) * group_rows].reshape(-1, group_rows * width), 1).values
        first = torch.ones_like(s, dtype=torch.bool)
        first[:, 1:] = s[:, 1:] != s[:, :-1]
        out[g0:g0 + step] = (first & (s != big)).sum(1)
    return out


def row_microblocks(phys: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor, *, block_size: int):
    """``[rows]`` int64 distinct microblocks of each row."""
    return group_unions(phys, tokens, keep, block_size=block_size, group_rows=1)


def selection_stats(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                    num_blocks: int, group_rows: int = GROUP_ROWS) -> dict:
    """Statistics of a selection that the report and the byte counts use.

    Returns:
        dict with ``set_sizes`` (``[rows]`` int64 ``|T_r|``, on the device), ``tokens_total``,
        ``overlap`` (None for a single row or rows of distinct requests), ``avg_union_per_group``
        (microblocks), ``union_total`` (microblocks over all groups), ``row_microblocks_total`` and
        ``sharing`` (row microblocks / union: how often the grouped route reuses each load).
    """
    tokens, phys, keep = kept_tokens(indices, block_table, token_to_req, positions, seq_lens,
                                     block_size=block_size, num_blocks=num_blocks)
    req = token_to_req.long().clamp(0, max(block_table.shape[0] - 1, 0))
    vis = torch.minimum((positions.long() + 1) // 4, seq_lens.long()[req] // 4)
    blocks = block_sets(tokens, keep, vis)
    unions = group_unions(phys, tokens, keep, block_size=block_size, group_rows=group_rows)
    per_row = row_microblocks(phys, tokens, keep, block_size=block_size)
    sizes = keep.sum(1)
    union_total = int(unions.sum())
    row_total = int(per_row.sum())
    return dict(
        set_sizes=sizes,
        tokens_total=int(sizes.sum()),
        overlap=adjacent_overlap(blocks, token_to_req.long()),
        avg_union_per_group=float(unions.double().mean()) if unions.numel() else 0.0,
        union_total=union_total,
        row_microblocks_total=row_total,
        sharing=row_total / union_total if union_total else None,
    )


# ------------------------------------------------------------------------------------------------
# whole workloads


def attention_workload(scn: Scenario, device) -> Workload:
    """Build the scenario's attention problem on ``device`` (deterministic in ``scn.seed``)."""
    gen = torch.Generator().manual_seed(scn.seed)
    dtype = TORCH_DTYPES[scn.dtype]
    req_np, pos_np = row_layout(scn.rows, scn.num_reqs, scn.context)
    seq_np = np.full(scn.num_reqs, scn.context, dtype=np.int64)
    table, num_blocks = shuffled_block_table(scn.num_reqs, scn.context, scn.block_size, gen)
    cache = fill_kv_cache(num_blocks, scn.block_size, scn.num_kv_heads, scn.head_dim, dtype=dtype,
                          kv_cache_dtype=scn.kv_cache_dtype, device=device, seed=scn.seed + 1)
    table = table.to(device)
    t2r = torch.from_numpy(req_np).to(torch.int32).to(device)
    pos = torch.from_numpy(pos_np).to(device)
    lens = torch.from_numpy(seq_np).to(torch.int32).to(device)

    if scn.selection == "walk":
        overlap = 0.0 if scn.overlap is None else scn.overlap
        blocks = walk_blocks(req_np, pos_np, seq_np, topk=scn.topk, overlap=overlap, seed=scn.seed + 2)
        indices = expand_blocks(torch.from_numpy(blocks).to(device), pos, lens.long()[t2r.long()])
    elif scn.selection == "indexer":
        from qsa.selection.api import select_tokens

        index_q, kc = synthetic_index_keys(scn, num_blocks, device=device, dyadic=False, drift=scn.drift)
        indices = select_tokens(index_q, kc, table, t2r, pos, lens, block_size=scn.block_size, k=scn.topk)
        del index_q, kc
    else:
        raise ValueError(f"unknown selection {scn.selection!r}")

    q = torch.randn(scn.rows, scn.num_q_heads, scn.head_dim, generator=gen).to(dtype).to(device)
    stats = selection_stats(indices, table, t2r, pos, lens, block_size=scn.block_size, num_blocks=num_blocks)
    return Workload(q, cache, indices.contiguous(), table, t2r, pos, lens, stats)


@dataclass
class SelectionWorkload:
    """Inputs of ``qsa.select_tokens`` (dyadic synthetic keys, so the exact top-k is well defined)."""

    index_q: torch.Tensor
    kc_cache: torch.Tensor
    block_table: torch.Tensor
    token_to_req: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    topk: int

    @property
    def args(self) -> tuple:
        return (self.index_q, self.kc_cache, self.block_table, self.token_to_req, self.positions,
                self.seq_lens)


def selection_workload(scn: Scenario, device) -> SelectionWorkload:
    gen = torch.Generator().manual_seed(scn.seed)
    req_np, pos_np = row_layout(scn.rows, scn.num_reqs, scn.context)
    table, num_blocks = shuffled_block_table(scn.num_reqs, scn.context, scn.block_size, gen)
    index_q, kc = synthetic_index_keys(scn, num_blocks, device=device, dyadic=True)
    return SelectionWorkload(
        index_q, kc, table.to(device),
        torch.from_numpy(req_np).to(torch.int32).to(device), torch.from_numpy(pos_np).to(device),
        torch.full((scn.num_reqs,), scn.context, dtype=torch.int32, device=device), scn.topk)
