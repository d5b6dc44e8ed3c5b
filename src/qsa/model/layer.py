"""The QSA attention layer (docs/spec.md sections 1-2) and the per-step metadata all layers share.

One step of one layer, for ``T`` rows (tokens of any requests; padding rows allowed)::

    q, gate = split(q_proj(x) as [T, Hq, 2D])          packed per head: q = [..., :D], gate = [..., D:]
    k, v    = k_proj(x), v_proj(x)                     [T, Hkv, D]
    q, k    = rope(rmsnorm(q)), rope(rmsnorm(k))       per-head RMSNorm (weight + 1), partial NeoX RoPE
    iq      = rope(rmsnorm(index_q_proj(x)))           [T, 4, 128] index queries
    ik      = index_k_proj(x)                          [T, 128] raw index keys
    cache  <- k, v at slot_mapping                     (qsa::write_kv)
    kc     <- mean of every completed 4-token group of ik, then rmsnorm + rope at 4b
    idx     = select_tokens(iq, kc, ...)               [T, 4k + 3] (qsa::select_tokens)
    attn    = sparse_paged_attention(q, cache, idx, gate)   round(attn) * sigmoid(gate)
    y       = all_reduce(o_proj(attn))

Per step, :class:`StepMetadata` is built once (rows' requests and positions, lengths, block table, slot
mapping, the route, the attention plan's buffers) and every layer uses it; each layer has its own
selection, so each layer refills the same plan buffers with ``plan_attention(..., out=plan)``
before its attention, which keeps a step capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import backend as backends
from ..attention import routing
from ..attention.api import check_forward_only
from ..selection.api import MAX_K, check_index_dim
from . import ops
from .functional import apply_rope, group_start_rope, rms_norm, rope_cos_sin
from .kernels import norm_rope
from .tp import HeadShard, TPInfo, all_reduce, shard_heads
from ..utils import check_int, check_positive_float


@dataclass(frozen=True)
class QSAConfig:
    """Sizes of a QSA layer. The defaults are the reference configuration (docs/spec.md section 1).

    Attributes:
        hidden_size: model width.
        num_heads, num_kv_heads, head_dim: full-model attention shape (before tensor parallelism).
        rotary_dim, rope_theta: partial NeoX RoPE of q and k (first ``rotary_dim`` dims of a head).
        rms_norm_eps: epsilon of every RMSNorm.
        index_heads, index_head_dim: index queries ``[T, index_heads, index_head_dim]``, keys
            ``[T, index_head_dim]``.
        index_rotary_dim: RoPE width of the index queries and compressed keys.
        index_topk: blocks of 4 tokens each row selects (the attention width is ``4 * index_topk + 3``).
        dtype: activation and weight dtype (fp16 or bf16).
        kv_cache_dtype: ``"auto"`` (the activation dtype) or ``"fp8_e4m3"``.
        k_scale, v_scale: FP8 cache scales.
    """

    hidden_size: int = 2560
    num_heads: int = 24
    num_kv_heads: int = 2
    head_dim: int = 256
    rotary_dim: int = 64
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    index_heads: int = 4
    index_head_dim: int = 128
    index_rotary_dim: int = 64
    index_topk: int = 512
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "index_heads", "index_head_dim",
                     "index_topk"):
            check_int(name, getattr(self, name), 1)
        check_int("rotary_dim", self.rotary_dim)
        check_int("index_rotary_dim", self.index_rotary_dim)
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {self.dtype}")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")
        for name in ("rope_theta", "rms_norm_eps", "k_scale", "v_scale"):
            check_positive_float(name, getattr(self, name))
        if self.head_dim not in routing.HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {routing.HEAD_DIMS} (the attention kernels' widths), "
                             f"got {self.head_dim}")
        check_index_dim("index_head_dim", self.index_head_dim)
        if self.index_topk > MAX_K:
            raise ValueError(f"index_topk must be in [1, {MAX_K}] (the selection kernel's limit), "
                             f"got {self.index_topk}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        for name, rot, dim in (("rotary_dim", self.rotary_dim, self.head_dim),
                               ("index_rotary_dim", self.index_rotary_dim, self.index_head_dim)):
            if rot % 2 or not 0 <= rot <= dim:
                raise ValueError(f"{name} must be even and in [0, {dim}], got {rot}")

    @property
    def index_width(self) -> int:
        """Columns of a row's token selection: ``4 * index_topk + 3``."""
        return 4 * self.index_topk + 3


# ----------------------------------------------------------------------------------------------
# per-step metadata and per-layer caches


@dataclass
class StepMetadata:
    """What every layer of one step shares; built once per step (:meth:`build`).

    Rows are this step's tokens (chunked prefill and decode mixed; padding rows allowed). Requests
    are the rows of ``block_table`` (fixed request slots, so compressed-key partial groups persist).

    Attributes:
        token_to_req: ``[T]`` int32 request slot of each row (-1: padding row).
        positions: ``[T]`` int64 logical position of each row (-1: padding row).
        seq_lens: ``[num_reqs]`` int32 tokens of each request including this step's.
        block_table: ``[num_reqs, max_blocks]`` int32 logical -> physical block (-1: none).
        slot_mapping: ``[T]`` int64 cache slot of each row's new K/V (-1: not written).
        block_size: tokens per KV block.
        route: attention route for this step ("auto", "grouped", "xqa", "splitk", "invariant", "reference").
        max_query_len: the most rows of one request in this step (host int; 1 for a decode step, whose
            auto route is then xqa, see :func:`qsa.attention.routing.choose`).
        rows_ordered: the rows come by request and then by position (no padding row before a real one;
            host bool, :func:`rows_ordered_of`): an eager step's compressed-key update then skips its
            sorts (``update_compressed_keys(..., rows_ordered=True)``, the same bits).
        plan_order: "logical" (the contract) or "physical" (the demonstration of why it matters).
        backend: "triton" or "torch" for the selection and cache writes (:meth:`build` picks Triton
            wherever the route runs Triton kernels, see :func:`qsa.backend.kernel_backend`).
        plan: the attention plan, created by the first layer and refilled by the others
            (``plan_attention(..., out=plan)``): its buffers, split partials and the grouped planner's
            scratch serve every layer (CUDA-graph safe).
        attn_out: ``[T, Hq, D]`` attention output buffer shared by the layers.
        routes_run: attention calls per route that ran with this metadata (each layer's call adds one
            to every route whose kernel it launched: ``grouped`` and ``xqa`` both for a step split
            between them; ``reference`` for the PyTorch reference), for reports of what ran. Nothing is
            recorded while ``torch.compile`` traces the layer.

    The RoPE tables of the step's positions (:meth:`rope`) are computed by the first layer that asks and
    kept for the others while ``positions`` is unchanged (its version counter: refill it with torch ops,
    such as :meth:`copy_`).
    """

    token_to_req: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    route: str = "auto"
    plan_order: str = "logical"
    backend: str = "triton"
    max_query_len: int | None = None
    rows_ordered: bool = False
    plan: object = field(default=None, repr=False)
    attn_out: torch.Tensor | None = field(default=None, repr=False)
    routes_run: dict = field(default_factory=dict, repr=False)
    _ropes: dict = field(default_factory=dict, repr=False)

    TENSORS = ("token_to_req", "positions", "seq_lens", "block_table", "slot_mapping")

    @classmethod
    def build(cls, token_to_req, positions, seq_lens, block_table, slot_mapping, *, block_size: int,
              device, route: str = "auto", plan_order: str = "logical",
              backend: str | None = None) -> "StepMetadata":
        """From host lists or tensors; one copy to ``device`` per field. ``backend=None`` resolves to
        :func:`qsa.backend.kernel_backend` of the route and device."""
        def as_tensor(x, dtype):
            t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
            return t.to(device=device, dtype=dtype, copy=True)

        if route not in routing.ROUTES:
            raise ValueError(f"route must be one of {routing.ROUTES}, got {route!r}")
        if check_int("block_size", block_size, 4) % 4:
            raise ValueError(f"block_size must be a positive multiple of 4, got {block_size!r}")
        if plan_order not in ("logical", "physical"):
            raise ValueError(f"plan_order must be 'logical' or 'physical', got {plan_order!r}")
        if backend is None:
            backend = backends.kernel_backend(route, device)
        elif backend not in backends.BACKENDS:
            raise ValueError(f"backend must be one of {backends.BACKENDS} or None, got {backend!r}")
        meta = cls(as_tensor(token_to_req, torch.int32), as_tensor(positions, torch.int64),
                   as_tensor(seq_lens, torch.int32), as_tensor(block_table, torch.int32),
                   as_tensor(slot_mapping, torch.int64), int(block_size), route, plan_order, backend,
                   routing.max_query_len_of(token_to_req), rows_ordered_of(token_to_req, positions))
        rows = meta.token_to_req.shape
        for name in ("positions", "slot_mapping"):
            if getattr(meta, name).shape != rows:
                raise ValueError(f"{name} must have token_to_req's shape {tuple(rows)}, got "
                                 f"{tuple(getattr(meta, name).shape)}")
        if meta.token_to_req.dim() != 1 or meta.block_table.dim() != 2 \
                or meta.seq_lens.shape != meta.block_table.shape[:1]:
            raise ValueError(f"token_to_req must be [T], block_table [num_reqs, max_blocks] and seq_lens "
                             f"[num_reqs], got {tuple(rows)}, {tuple(meta.block_table.shape)} and "
                             f"{tuple(meta.seq_lens.shape)}")
        return meta

    @property
    def num_rows(self) -> int:
        return self.token_to_req.shape[0]

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def copy_(self, other: "StepMetadata") -> None:
        """Refill this step's tensors in place from ``other`` of the same shapes (CUDA-graph replay)."""
        for name in self.TENSORS:
            getattr(self, name).copy_(getattr(other, name))
        self.rows_ordered = other.rows_ordered

    def rope(self, rotary_dim: int, theta: float, *, group_start: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_cos_sin(positions, rotary_dim, theta)`` (with ``group_start``: at each row's 4-token group
        start ``4 * (positions // 4)``, the compressed keys' RoPE), computed once per step for every layer
        (and for q, k and the index queries where their widths agree). Computed afresh, not kept, under
        ``torch.compile``, during CUDA-graph capture (the graph must compute it itself) and for
        inference-mode positions (which have no version counter)."""
        pos = self.positions
        if torch.compiler.is_compiling() or pos.is_inference() or (
                pos.is_cuda and torch.cuda.is_current_stream_capturing()):
            return _rope_tables(pos, rotary_dim, theta, group_start)
        mark = (pos.data_ptr(), pos._version)
        kept = self._ropes.get((rotary_dim, theta, group_start))
        if kept is not None and kept[0] == mark:
            return kept[1]
        tables = _rope_tables(pos, rotary_dim, theta, group_start)
        self._ropes[(rotary_dim, theta, group_start)] = (mark, tables)
        return tables


def _rope_tables(pos, rotary_dim: int, theta: float, group_start: bool):
    return group_start_rope(pos, rotary_dim, theta) if group_start else rope_cos_sin(pos, rotary_dim, theta)


def rows_ordered_of(token_to_req, positions) -> bool:
    """Whether rows ``(token_to_req[i], positions[i])`` are non-decreasing in ``i`` by request, then by
    position: the order :func:`qsa.selection.api.update_compressed_keys` sorts rows into, so that its sorts
    may be skipped. Read on the host (a device tensor is copied back once: call it where the batch is
    built, as :meth:`StepMetadata.build` does)."""
    req = (token_to_req.cpu() if isinstance(token_to_req, torch.Tensor) else torch.tensor(token_to_req)).long()
    pos = (positions.cpu() if isinstance(positions, torch.Tensor) else torch.tensor(positions)).long()
    if req.numel() < 2:
        return True
    dr, dp = req[1:] - req[:-1], pos[1:] - pos[:-1]
    return bool(((dr > 0) | ((dr == 0) & (dp >= 0))).all())


@dataclass
class LayerCache:
    """One layer's caches (per rank).

    Attributes:
        kv: ``[num_blocks, 2, block_size, Hkv_local, D]`` interleaved K/V cache.
        kc: ``[num_blocks, block_size // 4, index_head_dim]`` compressed index keys.
        partial: ``[num_reqs, 3, index_head_dim]`` fp32 raw keys of each request's open group.
    """

    kv: torch.Tensor
    kc: torch.Tensor
    partial: torch.Tensor

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, 1]

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[0]

    @property
    def block_size(self) -> int:
        return self.kv.shape[2]


# ----------------------------------------------------------------------------------------------
# the layer


def _init(gen: torch.Generator, shape, std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


class QSAAttention(nn.Module):
    """The QSA attention layer: projections, norms, RoPE, selection, sparse paged attention, gate,
    o_proj (and the all-reduce under tensor parallelism).

    Weights are random from ``seed`` (the full-model weights are drawn, then this rank's shard is
    kept, so every TP degree computes the same function).

    Args:
        config: sizes (defaults: the reference configuration).
        tp: tensor-parallel position (default: TP1).
        seed: weight seed.
        device: where the weights live (None: torch's current default device, as for torch's factories).

    Example:
        >>> layer = QSAAttention(QSAConfig(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
        ...                                index_topk=16), device="cuda")
        >>> cache = layer.allocate_cache(num_blocks=64, block_size=16, num_reqs=4)
        >>> y = layer(x, meta, cache)        # x [T, hidden], meta: StepMetadata
    """

    def __init__(self, config: QSAConfig = QSAConfig(), *, tp: TPInfo | None = None, seed: int = 0,
                 device=None):
        super().__init__()
        device = torch.get_default_device() if device is None else torch.device(device)
        self.config = c = config
        self.tp = tp or TPInfo()
        self.shard: HeadShard = shard_heads(c.num_heads, c.num_kv_heads, self.tp)
        sh, D, H = self.shard, c.head_dim, c.hidden_size
        gen = torch.Generator().manual_seed(seed)
        w_std = H ** -0.5
        qg = _init(gen, (c.num_heads, 2 * D, H), w_std)
        k = _init(gen, (c.num_kv_heads, D, H), w_std)
        v = _init(gen, (c.num_kv_heads, D, H), w_std)
        o = _init(gen, (H, c.num_heads, D), (c.num_heads * D) ** -0.5)
        norms = {name: _init(gen, (dim,), 0.1) for name, dim in
                 (("q_norm", D), ("k_norm", D), ("index_q_norm", c.index_head_dim),
                  ("index_k_norm", c.index_head_dim))}
        iq = _init(gen, (c.index_heads * c.index_head_dim, H), w_std)
        ik = _init(gen, (c.index_head_dim, H), w_std)

        q_sl = slice(sh.q_start, sh.q_start + sh.num_q_heads)
        kv_sl = slice(sh.kv_start, sh.kv_start + sh.num_kv_heads)
        inputs = dict(qg_proj=qg[q_sl].reshape(-1, H), k_proj=k[kv_sl].reshape(-1, H),
                      v_proj=v[kv_sl].reshape(-1, H), index_q_proj=iq, index_k_proj=ik)
        for name, w in dict(inputs, o_proj=o[:, q_sl].reshape(H, -1), **norms).items():
            self.register_parameter(name, nn.Parameter(w.to(device=device, dtype=c.dtype).contiguous(),
                                                       requires_grad=False))
        self._fuse_in_proj()

    IN_PROJ = ("qg_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj")
    """The projections of x, in the order of their rows in the fused weight."""

    def _fuse_in_proj(self) -> None:
        """Make the five projections of x rows of one weight, each parameter a view of its rows, so that
        an eager step multiplies once (:meth:`project`); done again after the module is moved or cast."""
        weights = [getattr(self, name) for name in self.IN_PROJ]
        fused = torch.cat([w.detach() for w in weights])
        start = 0
        for w in weights:
            w.data = fused[start:start + w.shape[0]]
            start += w.shape[0]
        self._in_proj = fused
        self._in_proj_sizes = [w.shape[0] for w in weights]
        self._in_proj_ptrs = self._in_proj_views()

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._fuse_in_proj()
        return out

    def _in_proj_views(self) -> tuple:
        """The data pointers of the five projections now (views of the fused weight while they are)."""
        return tuple(getattr(self, name).data_ptr() for name in self.IN_PROJ)

    @property
    def num_q_heads(self) -> int:
        """Query heads on this rank."""
        return self.shard.num_q_heads

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank."""
        return self.shard.num_kv_heads

    def allocate_cache(self, num_blocks: int, block_size: int, num_reqs: int, *, fill: str | None = "nan",
                       device=None) -> LayerCache:
        """This layer's caches; ``fill="nan"`` poisons every slot (NaN, or byte 0x7F for FP8) so a read
        of an unwritten slot shows in the output."""
        c = self.config
        device = device if device is not None else self.qg_proj.device
        for name, value, least in (("num_blocks", num_blocks, 0), ("block_size", block_size, 4),
                                   ("num_reqs", num_reqs, 0)):
            check_int(name, value, least)
        if block_size % 4:
            raise ValueError(f"block_size must be a multiple of 4, got {block_size}")
        if fill not in (None, "nan", "zeros"):
            raise ValueError(f"fill must be None, 'nan' or 'zeros', got {fill!r}")
        fp8 = c.kv_cache_dtype == "fp8_e4m3"
        kv = torch.empty((num_blocks, 2, block_size, self.num_kv_heads, c.head_dim),
                         dtype=torch.uint8 if fp8 else c.dtype, device=device)
        kc = torch.empty((num_blocks, block_size // 4, c.index_head_dim), dtype=c.dtype, device=device)
        if fill == "nan":
            kv.fill_(0x7F if fp8 else float("nan"))
            kc.fill_(float("nan"))
        elif fill is not None:
            kv.zero_()
            kc.zero_()
        partial = torch.zeros((num_reqs, 3, c.index_head_dim), dtype=torch.float32, device=device)
        return LayerCache(kv, kc, partial)

    def project(self, x: torch.Tensor, positions):
        """Projections, norms and RoPE of ``x`` ``[T, hidden]`` at ``positions`` (``[T]``, or the step's
        :class:`StepMetadata`, whose RoPE tables are then shared by the layers, and whose Triton backend
        takes the norms and rotations in one launch, :func:`qsa.model.kernels.norm_rope`).

        Returns ``q, gate`` ``[T, Hq, D]``, ``k, v`` ``[T, Hkv, D]`` (this rank's heads), ``iq``
        ``[T, index_heads, index_head_dim]`` and the raw index keys ``ik`` ``[T, index_head_dim]``.
        """
        c = self.config
        T, D = x.shape[0], c.head_dim
        if isinstance(positions, StepMetadata):
            meta = positions
            (cos, sin), (icos, isin) = meta.rope(c.rotary_dim, c.rope_theta), meta.rope(c.index_rotary_dim,
                                                                                          c.rope_theta)
        else:
            cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta)
            icos, isin = rope_cos_sin(positions, c.index_rotary_dim, c.rope_theta)
        if not torch.compiler.is_compiling() and self._in_proj_views() == self._in_proj_ptrs:
            qg, k, v, iq, ik = F.linear(x, self._in_proj).split(self._in_proj_sizes, dim=1)
        else:  # under torch.compile, or after the parameters stopped being views of the fused weight
            qg, k, v, iq, ik = (F.linear(x, getattr(self, name)) for name in self.IN_PROJ)
        qg = qg.view(T, self.num_q_heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k, v = k.view(T, self.num_kv_heads, D), v.view(T, self.num_kv_heads, D)
        iq = iq.view(T, c.index_heads, c.index_head_dim)
        if isinstance(positions, StepMetadata) and positions.backend == "triton" \
                and not torch.compiler.is_compiling():
            # one launch for the three norms and rotations (the same values up to an ulp where the sum
            # of squares rounds differently; torch.compile fuses the PyTorch functions itself)
            q, k, iq = norm_rope(q, self.q_norm, k, self.k_norm, iq, self.index_q_norm, cos, sin, icos, isin,
                                 c.rms_norm_eps)
            return q, gate, k, v, iq, ik
        q = apply_rope(rms_norm(q, self.q_norm, c.rms_norm_eps), cos, sin)
        k = apply_rope(rms_norm(k, self.k_norm, c.rms_norm_eps), cos, sin)
        iq = apply_rope(rms_norm(iq, self.index_q_norm, c.rms_norm_eps), icos, isin)
        return q, gate, k, v, iq, ik

    def forward(self, x: torch.Tensor, meta: StepMetadata, cache: LayerCache,
                capture: dict | None = None) -> torch.Tensor:
        """One step of the layer for ``x`` ``[T, hidden]``; returns ``[T, hidden]`` (all-reduced).

        ``capture``, when given, receives this step's intermediate tensors (``q``, ``gate``, ``k``,
        ``v``, ``iq``, ``ik``, ``indices``, ``attn``) for tests and ``qsa verify``.
        """
        c = self.config
        if x.dim() != 2 or x.shape[0] != meta.num_rows or x.shape[1] != c.hidden_size:
            raise ValueError(f"x must be [T, hidden_size] = [{meta.num_rows}, {c.hidden_size}] (T: the metadata's "
                             f"rows), got {tuple(x.shape)}")
        if x.dtype != c.dtype:
            raise TypeError(f"x must have the config's dtype {c.dtype}, got {x.dtype}")
        if meta.block_size != cache.block_size:
            raise ValueError(f"meta.block_size ({meta.block_size}) must be the cache's block size ({cache.block_size})")
        q, gate, k, v, iq, ik = self.project(x, meta)
        check_forward_only(q, gate)  # before any cache write: a write of rows that require grad would enter autograd
        indices = self.select(k, v, iq, ik, meta, cache)
        attn = self.attention(q, gate, indices, meta, cache)
        y = F.linear(attn.reshape(x.shape[0], self.num_q_heads * c.head_dim), self.o_proj)
        if capture is not None:
            # attn lives in the step's shared buffer, which the next layer overwrites
            capture.update(q=q, gate=gate, k=k, v=v, iq=iq, ik=ik, indices=indices, attn=attn.clone())
        return all_reduce(y, self.tp)

    def select(self, k, v, iq, ik, meta: StepMetadata, cache: LayerCache) -> torch.Tensor:
        """Write the step's K/V and compressed index keys into the caches, then select each row's tokens.

        Under ``torch.compile`` through the custom ops (:mod:`qsa.model.ops`), which the compiler traces;
        eagerly through the ops' implementations with the same arguments, so that an eager step does not
        pay the custom-op dispatch (its schema handling and aliasing checks) three times."""
        c = self.config
        if torch.compiler.is_compiling():
            write, update, select = (torch.ops.qsa.write_kv, torch.ops.qsa.update_compressed_keys,
                                     torch.ops.qsa.select_tokens)
        else:
            write, update, select = ops.write_kv_impl, ops.update_compressed_keys_impl, ops.select_tokens_impl
        # Under torch.compile a constant of the traced graph, which Dynamo guards (a step ordered the other way
        # runs a graph of its own); the update sorts anyway during CUDA-graph capture, whose graph may be
        # replayed with rows in another order.
        ordered = meta.rows_ordered
        write(cache.kv, k, v, meta.slot_mapping, c.kv_cache_dtype, c.k_scale, c.v_scale, meta.backend)
        key_cos, key_sin = meta.rope(c.index_rotary_dim, c.rope_theta, group_start=True) if c.index_rotary_dim \
            else (None, None)
        update(ik, meta.token_to_req, meta.positions, cache.kc, meta.block_table, cache.partial, self.index_k_norm,
               c.rms_norm_eps, c.index_rotary_dim, c.rope_theta, meta.backend, cache.block_size, None, None,
               ordered, key_cos, key_sin)
        return select(iq, cache.kc, meta.block_table, meta.token_to_req, meta.positions, meta.seq_lens,
                      c.index_topk, meta.backend, cache.block_size)

    def attention(self, q, gate, indices, meta: StepMetadata, cache: LayerCache) -> torch.Tensor:
        """Gated sparse paged attention of this step's rows.

        Eagerly (and under CUDA-graph capture) the step's plan buffers are refilled for this layer's
        selection and reused; under ``torch.compile`` the functional custom op plans internally.
        """
        c = self.config
        kw = dict(kv_cache_dtype=c.kv_cache_dtype, k_scale=c.k_scale, v_scale=c.v_scale)
        if torch.compiler.is_compiling() or meta.route == "reference":
            if not torch.compiler.is_compiling() and q.shape[0]:
                _record_routes(meta, ("reference",))
            return ops.sparse_paged_attention(q, cache.k, cache.v, indices, meta.block_table,
                                              meta.token_to_req, meta.positions, meta.seq_lens, gate=gate,
                                              route=meta.route, max_query_len=meta.max_query_len,
                                              rows_sorted=True, **kw)
        from ..attention.api import plan_attention, run_attention

        meta.plan = plan_attention(indices, meta.block_table, meta.token_to_req, meta.positions, meta.seq_lens,
                                   block_size=cache.block_size, num_blocks=cache.num_blocks,
                                   num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                                   head_dim=c.head_dim, route=meta.route, out=meta.plan, order=meta.plan_order,
                                   max_query_len=meta.max_query_len, rows_sorted=True,
                                   kv_cache_dtype=c.kv_cache_dtype)
        if meta.attn_out is None or meta.attn_out.shape != q.shape or meta.attn_out.dtype != q.dtype:
            meta.attn_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        out = run_attention(meta.plan, q, cache.k, cache.v, gate=gate, out=meta.attn_out, **kw)
        _record_routes(meta, routes_launched(meta.plan))
        return out


def routes_launched(plan) -> tuple[str, ...]:
    """The routes whose kernels :func:`qsa.run_attention` launches for ``plan`` (as it dispatches them):
    ``grouped`` for the plan's grouped rows and ``xqa`` for the rest (planned or direct) on the page4
    routes, else the plan's one route; none for a plan of no rows."""
    choice = plan.routes
    if plan.num_rows == 0:
        return ()
    if choice.route in ("grouped", "xqa"):
        return tuple(name for name, ran in (("grouped", plan.grouped is not None),
                                            ("xqa", choice.direct or plan.single is not None)) if ran)
    return (choice.route,)


def _record_routes(meta: StepMetadata, names) -> None:
    for name in names:
        meta.routes_run[name] = meta.routes_run.get(name, 0) + 1


__all__ = ["LayerCache", "QSAAttention", "QSAConfig", "StepMetadata"]
