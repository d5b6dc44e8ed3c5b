"""A minimal serving loop for the tiny model: block allocator, chunked prefill, decode, and a CUDA
graph for decode steps on the GPU.

Requests live in fixed slots (rows of the block table, so the compressed-key cache's partial groups
persist between steps). The schedule depends only on prompt lengths: first the prompts are prefilled
in chunks of at most ``chunk_size`` tokens per step (a step may hold pieces of several requests),
then every step decodes one token for all requests, as a padded batch of ``max_reqs`` rows (so eager
and graph decode steps have the same shape). Sampling is greedy. Physical blocks come from a
:class:`qsa.cache.BlockAllocator`, shuffled by ``allocator_seed``: two engines that differ only in
that seed run the same computation on different page placements, and must produce the same bits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .layer import StepMetadata
from .tiny import TinyQSAModel


@dataclass(frozen=True)
class ServingConfig:
    """Engine settings.

    Attributes:
        num_blocks, block_size: KV cache geometry (every layer has its own cache of this shape).
        max_reqs: request slots (the decode batch is padded to this many rows).
        max_blocks_per_req: block-table width.
        chunk_size: prefill tokens per step.
        route: attention route ("auto" picks per step, see :mod:`qsa.attention.routing`).
        plan_order: "logical" (the contract) or "physical" (the demonstration).
        backend: selection and cache-write implementation ("triton", "torch"; None: follow the route).
        cuda_graph: replay decode steps from a CUDA graph (GPU only).
        allocator_seed: shuffle of the free block list (None: blocks in ascending order).
        poison: fill the caches with NaN so a read of an unwritten slot shows in the logits.
    """

    num_blocks: int
    block_size: int = 16
    max_reqs: int = 4
    max_blocks_per_req: int = 64
    chunk_size: int = 256
    route: str = "auto"
    plan_order: str = "logical"
    backend: str | None = None
    cuda_graph: bool = False
    allocator_seed: int | None = 0
    poison: bool = True

    def __post_init__(self):
        from .. import backend as backends
        from ..attention import routing
        from ..utils import check_bool, check_int

        for name, least in (("num_blocks", 1), ("block_size", 4), ("max_reqs", 1), ("max_blocks_per_req", 1),
                            ("chunk_size", 1)):
            check_int(name, getattr(self, name), least)
        if self.block_size % 4:
            raise ValueError(f"block_size must be a multiple of 4, got {self.block_size}")
        if self.route not in routing.ROUTES:
            raise ValueError(f"route must be one of {routing.ROUTES}, got {self.route!r}")
        if self.plan_order not in ("logical", "physical"):
            raise ValueError(f"plan_order must be 'logical' or 'physical', got {self.plan_order!r}")
        if self.backend is not None and self.backend not in backends.BACKENDS:
            raise ValueError(f"backend must be one of {backends.BACKENDS} or None, got {self.backend!r}")
        object.__setattr__(self, "cuda_graph", check_bool("cuda_graph", self.cuda_graph))  # frozen: set once here
        if self.cuda_graph and (self.route == "reference" or self.backend == "torch"):
            # The PyTorch reference and the torch selection read values on the host: no graph captures them.
            raise ValueError("cuda_graph needs the Triton routes and backend, got "
                             f"route={self.route!r}, backend={self.backend!r}")


@dataclass
class StepRecord:
    kind: str  # "prefill" or "decode"
    rows: int  # rows computed (decode: padded batch)
    tokens: int  # real tokens
    routes: dict = field(default_factory=dict)  # attention calls (one per layer) per route that ran
    # (StepMetadata.routes_run; a graph replay: those of the captured step)
    backend: str = ""  # how the selection and cache writes ran: "triton" or "torch"


@dataclass
class GenerationResult:
    """What :meth:`Engine.generate` returns.

    Attributes:
        tokens: generated tokens of each request.
        logits: ``[n, vocab]`` fp32 (CPU) logits of every sampled position, in emission order.
        steps: one record per step (with the attention routes that ran in it, :meth:`route_steps`).
        prefill_s, decode_s: wall time of the two phases (device synchronised).
        capture: the captured step (see :meth:`Engine.generate`), or None.
    """

    tokens: list[list[int]]
    logits: torch.Tensor
    steps: list[StepRecord]
    prefill_s: float
    decode_s: float
    capture: dict | None = None

    @property
    def prefill_tokens(self) -> int:
        return sum(s.tokens for s in self.steps if s.kind == "prefill")

    @property
    def decode_tokens(self) -> int:
        return sum(s.tokens for s in self.steps if s.kind == "decode")

    def route_steps(self) -> dict[str, dict[str, int]]:
        """``{route: {"prefill": steps, "decode": steps}}``: the steps of each kind in which a route's
        kernel ran (in any layer), from the steps' records; a step split between grouped and xqa rows
        counts for both."""
        tally: dict[str, dict[str, int]] = {}
        for s in self.steps:
            for route in s.routes:
                counts = tally.setdefault(route, {"prefill": 0, "decode": 0})
                counts[s.kind] += 1
        return tally

    def backends(self) -> set[str]:
        """How the selection and cache writes ran in these steps (``"triton"``, ``"torch"``)."""
        return {s.backend for s in self.steps}


@dataclass
class _Chunk:
    slot: int
    start: int
    end: int


def prefill_schedule(prompt_lens: list[int], chunk_size: int) -> list[list[_Chunk]]:
    """Split the prompts into steps of at most ``chunk_size`` tokens, requests in order."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    steps, cur, room = [], [], chunk_size
    for slot, n in enumerate(prompt_lens):
        start = 0
        while start < n:
            take = min(n - start, room)
            cur.append(_Chunk(slot, start, start + take))
            start += take
            room -= take
            if room == 0:
                steps.append(cur)
                cur, room = [], chunk_size
    if cur:
        steps.append(cur)
    return steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """Runs a :class:`~qsa.model.TinyQSAModel` over a batch of prompts.

    Args:
        model: the model (its device is the engine's).
        config: cache geometry, scheduling and route settings.
    """

    def __init__(self, model: TinyQSAModel, config: ServingConfig):
        from ..cache.paged import BlockAllocator

        self.model = model
        self.config = c = config
        self.device = model.embed.device
        if c.cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph needs the model on a CUDA device")
        self.caches = model.allocate_caches(c.num_blocks, c.block_size, c.max_reqs,
                                            fill="nan" if c.poison else "zeros")
        self.allocator = BlockAllocator(c.num_blocks, c.block_size, generator=c.allocator_seed)
        self.block_table = torch.full((c.max_reqs, c.max_blocks_per_req), -1, dtype=torch.int32)
        self.lengths = [0] * c.max_reqs
        self._graph = None

    def _grow(self, slot: int, num_tokens: int) -> None:
        need = -(-num_tokens // self.config.block_size)
        if need > self.config.max_blocks_per_req:  # checked before anything is allocated
            raise ValueError(f"request in slot {slot} needs {need} blocks, more than "
                             f"max_blocks_per_req={self.config.max_blocks_per_req}")
        blocks = self.allocator.allocate(slot, num_tokens)
        self.block_table[slot, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.lengths[slot] = num_tokens

    def _release(self, num_slots: int) -> None:
        """Free the first ``num_slots`` request slots (those a generation used), whatever they hold."""
        for s in range(num_slots):
            if s in self.allocator:
                self.allocator.free(s)
            self.block_table[s] = -1
            self.lengths[s] = 0

    def _meta(self, token_to_req, positions, slots) -> StepMetadata:
        c = self.config
        return StepMetadata.build(token_to_req, positions, self.lengths, self.block_table, slots,
                                  block_size=c.block_size, device=self.device, route=c.route,
                                  plan_order=c.plan_order, backend=c.backend)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, on_step=None,
                 capture_step: int | None = None, capture_layer: int = 0) -> GenerationResult:
        """Prefill ``prompts`` in chunks, then decode ``max_new_tokens - 1`` steps (greedy).

        Args:
            prompts: token lists, at most ``max_reqs``.
            max_new_tokens: tokens generated per request (the first comes from the prefill).
            on_step: ``f(step_index, total_steps, kind)`` called after each step.
            capture_step, capture_layer: record that step's layer intermediates, the metadata and a
                copy of the layer's caches after the step (the inputs ``qsa verify`` replays).

        Returns:
            :class:`GenerationResult`.
        """
        c = self.config
        if not 1 <= len(prompts) <= c.max_reqs:
            raise ValueError(f"need 1 to {c.max_reqs} prompts, got {len(prompts)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        try:
            return self._generate(prompts, max_new_tokens, on_step, capture_step, capture_layer)
        finally:  # the slots are free again after a generation, also one that failed part way
            self._release(len(prompts))

    def _generate(self, prompts, max_new_tokens, on_step, capture_step, capture_layer) -> GenerationResult:
        c, dev, model = self.config, self.device, self.model
        schedule = prefill_schedule([len(p) for p in prompts], c.chunk_size)
        total = len(schedule) + max_new_tokens - 1
        last_tok = torch.zeros(c.max_reqs, dtype=torch.int64, device=dev)
        sampled, logits_out, steps = [], [], []
        captured = None

        def step_capture(i):
            return {} if i == capture_step else None

        _sync(dev)
        t0 = time.perf_counter()
        for i, chunks in enumerate(schedule):
            ids, t2r, pos, slots, logit_rows, logit_slots = [], [], [], [], [], []
            for ch in chunks:
                self._grow(ch.slot, ch.end)
                ids += prompts[ch.slot][ch.start:ch.end]
                t2r += [ch.slot] * (ch.end - ch.start)
                pos += list(range(ch.start, ch.end))
                slots.append(self.allocator.slot_mapping(ch.slot, ch.start, ch.end))
                if ch.end == len(prompts[ch.slot]):
                    logit_rows.append(len(ids) - 1)
                    logit_slots.append(ch.slot)
            meta = self._meta(t2r, pos, torch.cat(slots))
            cap = step_capture(i)
            logits = model(torch.tensor(ids, dtype=torch.int64).to(dev), meta, self.caches,
                           logit_rows=torch.tensor(logit_rows, dtype=torch.int64).to(dev),
                           capture_layer=capture_layer, capture=cap)
            if cap is not None:
                captured = self._capture(cap, meta, capture_layer)
            ran = dict(meta.routes_run)
            if logit_rows:
                tok = logits.argmax(-1)
                last_tok[torch.tensor(logit_slots, device=dev)] = tok
                sampled.append((logit_slots, tok))
                logits_out.append(logits)
            steps.append(StepRecord("prefill", len(ids), len(ids), ran, meta.backend))
            if on_step:
                on_step(len(steps), total, "prefill")
        _sync(dev)
        t1 = time.perf_counter()

        n = len(prompts)
        active = torch.arange(c.max_reqs, device=dev) < n
        for i in range(len(schedule), total):
            for slot in range(n):
                self._grow(slot, self.lengths[slot] + 1)
            pos = [self.lengths[s] - 1 if s < n else -1 for s in range(c.max_reqs)]
            t2r = [s if s < n else -1 for s in range(c.max_reqs)]
            slots = torch.cat([self.allocator.slot_mapping(s, pos[s], pos[s] + 1) for s in range(n)] +
                              [torch.full((c.max_reqs - n,), -1, dtype=torch.int64)])
            meta = self._meta(t2r, pos, slots)
            cap = step_capture(i)
            if c.cuda_graph and cap is None:
                logits, ran = self._decode_graph(last_tok, meta)
            else:
                logits = model(last_tok, meta, self.caches, capture_layer=capture_layer, capture=cap)
                ran = dict(meta.routes_run)
            if cap is not None:
                captured = self._capture(cap, meta, capture_layer)
            tok = torch.where(active, logits.argmax(-1), last_tok)
            last_tok = tok
            sampled.append((list(range(n)), tok[:n]))
            logits_out.append(logits[:n])
            steps.append(StepRecord("decode", c.max_reqs, n, ran, meta.backend))
            if on_step:
                on_step(len(steps), total, "decode")
        _sync(dev)
        t2 = time.perf_counter()

        tokens = [[] for _ in prompts]
        for slots_, tok in sampled:
            for s, t in zip(slots_, tok.tolist()):
                tokens[s].append(t)
        logits_all = torch.cat(logits_out).cpu()
        return GenerationResult(tokens, logits_all, steps, t1 - t0, t2 - t1, captured)

    def _decode_graph(self, input_ids: torch.Tensor, meta: StepMetadata) -> tuple[torch.Tensor, dict]:
        """Decode through a CUDA graph: the first call runs eagerly on static buffers (warm-up) and
        captures; later calls copy the step's data into the static buffers and replay. Returns the
        logits and the attention routes the step ran (a replay: those launched in the capture)."""
        if self._graph is None:
            static_ids = input_ids.clone()
            logits = self.model(static_ids, meta, self.caches)  # warm-up: a real step, eagerly
            ran = dict(meta.routes_run)
            meta.routes_run.clear()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_logits = self.model(static_ids, meta, self.caches)
            self._graph = (graph, static_ids, meta, static_logits, dict(meta.routes_run))
            return logits.clone(), ran
        graph, static_ids, static_meta, static_logits, captured = self._graph
        static_ids.copy_(input_ids)
        static_meta.copy_(meta)
        graph.replay()
        return static_logits.clone(), dict(captured)

    def _capture(self, cap: dict, meta: StepMetadata, layer: int) -> dict:
        cache = self.caches[layer]
        lay = self.model.layers[layer]
        out = {name: t.detach().clone() for name, t in cap.items()}
        out.update({name: getattr(meta, name).clone() for name in StepMetadata.TENSORS})
        out.update(kv=cache.kv.clone(), kc=cache.kc.clone(), block_size=meta.block_size,
                   config=lay.config, num_q_heads=lay.num_q_heads, num_kv_heads=lay.num_kv_heads)
        return out


def run_layer(layer, xs: list[torch.Tensor], *, chunk_size: int, decode_tokens: int = 0, block_size: int = 16,
              num_blocks: int | None = None, allocator_seed=0, route: str = "auto", plan_order: str = "logical",
              backend: str | None = None, pad_rows: int = 0, capture: bool = False):
    """Drive one :class:`~qsa.model.layer.QSAAttention` over given inputs the way the engine schedules steps.

    Request ``i`` has inputs ``xs[i]`` ``[L_i, hidden]`` for positions ``0 .. L_i - 1``; its first
    ``L_i - decode_tokens`` tokens are prefilled in chunks, the rest decoded one per step. Every step
    gets ``pad_rows`` extra padding rows (request -1, position -1, no cache slot).

    Returns:
        ``(out, steps, cache)``: ``out`` ``[sum L_i, hidden]`` the layer's outputs, request after
        request; ``steps`` one dict per step with ``rows`` (indices into ``out``), ``meta``, ``y`` (all
        rows, padding last) and, with ``capture``, the layer's intermediates plus ``kc`` (a copy of the
        compressed-key cache after the step); ``cache`` the layer's cache at the end.
    """
    from ..cache.paged import BlockAllocator

    device = layer.qg_proj.device
    lens = [x.shape[0] for x in xs]
    n = len(xs)
    prefill = [L - decode_tokens for L in lens]
    if min(prefill) < 1:
        raise ValueError("every request needs at least one prefill token")
    max_blocks = max(-(-L // block_size) for L in lens)
    num_blocks = num_blocks or sum(-(-L // block_size) for L in lens) + 4
    cache = layer.allocate_cache(num_blocks, block_size, n, fill="nan")
    alloc = BlockAllocator(num_blocks, block_size, generator=allocator_seed)
    table = torch.full((n, max_blocks), -1, dtype=torch.int32)
    seq = [0] * n
    starts = [sum(lens[:i]) for i in range(n)]
    hidden = xs[0].shape[1]
    out = torch.full((sum(lens), hidden), float("nan"), dtype=xs[0].dtype, device=device)
    schedule = prefill_schedule(prefill, chunk_size)
    schedule += [[_Chunk(s, prefill[s] + i, prefill[s] + i + 1) for s in range(n)] for i in range(decode_tokens)]
    steps = []
    for chunks in schedule:
        x_rows, t2r, pos, slots, rows = [], [], [], [], []
        for ch in chunks:
            blocks = alloc.allocate(ch.slot, ch.end)
            table[ch.slot, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            seq[ch.slot] = ch.end
            x_rows.append(xs[ch.slot][ch.start:ch.end])
            t2r += [ch.slot] * (ch.end - ch.start)
            pos += list(range(ch.start, ch.end))
            slots.append(alloc.slot_mapping(ch.slot, ch.start, ch.end))
            rows += range(starts[ch.slot] + ch.start, starts[ch.slot] + ch.end)
        x_rows.append(torch.zeros(pad_rows, hidden, dtype=xs[0].dtype, device=device))
        slots.append(torch.full((pad_rows,), -1, dtype=torch.int64))
        meta = StepMetadata.build(t2r + [-1] * pad_rows, pos + [-1] * pad_rows, seq, table, torch.cat(slots),
                                  block_size=block_size, device=device, route=route, plan_order=plan_order,
                                  backend=backend)
        cap = {} if capture else None
        y = layer(torch.cat(x_rows).to(device), meta, cache, capture=cap)
        out[rows] = y[:len(rows)]
        step = dict(rows=rows, meta=meta, y=y)
        if capture:
            step.update(cap, kc=cache.kc.clone())
        steps.append(step)
    return out, steps, cache


__all__ = ["Engine", "GenerationResult", "ServingConfig", "StepRecord", "prefill_schedule", "run_layer"]
