"""qsa as a drop-in for vLLM's QSA attention op.

**What it replaces.** vLLM 0.33.0 serves QSA models (the ``qwen4_exp`` family) with its own Triton op,
``vllm.models.qwen4_exp.nvidia.ops.qsa.qsa_sparse_paged_attention``. :func:`qsa_sparse_paged_attention`
here takes the same arguments, in the same layouts, and computes the same gated sparse attention on qsa's
kernels, so an engine can call it in that op's place (for instance from a plugin of vLLM's
``vllm.general_plugins`` entry-point group, which rebinds the name where the model code looks it up).
This module never imports vLLM.

**Arguments**, vLLM's -> :func:`qsa.sparse_paged_attention`'s:

* ``q`` ``[rows, Hq, D]`` bf16 (fp16 taken too) -> ``q``.
* ``k_cache``, ``v_cache``: ``[num_blocks, page, Hkv, D]`` views of one server tensor
  ``[num_blocks, Hkv, page, 2*D]`` (``kv.transpose(1, 2).split(D, -1)``) -> the same views: qsa takes any
  strides with D contiguous (here token stride ``2*D``, head stride ``page*2*D``, block stride
  ``Hkv*page*2*D``).
* a cache in q's dtype -> ``kv_cache_dtype="auto"``; ``k_scale``, ``v_scale`` are ignored, as vLLM does.
* a cache of ``float8_e4m3fn``, or of ``uint8`` storage -> ``kv_cache_dtype="fp8_e4m3"`` with ``k_scale``,
  ``v_scale`` (host floats; None means 1.0).
* ``logical_indices`` ``[rows, W + 1]`` int32 -> ``indices=logical_indices[:, :W]`` and
  ``index_counts=logical_indices[:, W]`` (views, no copy).
* ``block_table``, ``token_to_req`` -> the same.
* ``use_prefill_config=False`` (decode / MTP) -> ``max_query_len=1``: ``auto`` runs every row on the
  single-row xqa route; ``True`` (prefill) -> ``max_query_len=None`` (unknown): ``auto`` groups 8
  adjacent rows from 64 rows on. Kernel choice only.
* ``out`` -> ``out`` (returned).
* ``output_gate`` (mandatory) -> ``gate`` (a contiguous tensor of q's size is viewed as q, as vLLM does).
* the fixed softmax scale ``D ** -0.5`` -> ``softmax_scale=None`` (``D ** -0.5``).
* vLLM's rows ascend (selected blocks, then the causal tail) -> ``rows_sorted=True``, which qsa takes as
  a hint on the first ``count`` entries of each row (a row out of order is still exact, only slower).
* ``positions``, ``seq_lens`` (qsa's own, optional, keyword-only) -> ``positions``, ``seq_lens``; absent:
  no bound (below).

**What a row attends.** Row ``r`` attends the tokens ``logical_indices[r, :count]``, ``count`` the last
column clamped to ``[0, W]``, each once, dropping tokens that are negative, whose logical block is past
the table or whose table entry is not a page of the cache; entries past the count are never read,
whatever they hold. A row with count 0 (or a request id outside the table) gives 0. Without
``positions``/``seq_lens`` no causal or length bound is applied, as in vLLM (its expand step already
dropped invalid tokens); with them, tokens ``> positions[r]`` or ``>= seq_lens[req]`` are dropped too,
and ``positions[r] < 0`` makes a padding row (0), as in :func:`qsa.sparse_paged_attention`.

The missing bounds are realised as ``positions = max_blocks * page - 1`` for every row and
``seq_lens = max_blocks * page`` for every request, which no attended token can exceed (its block is in
the table): vectors kept per (device, value), grown when more rows come and never freed (a captured CUDA
graph may hold their address), sliced per size of call: no allocation, no fill and no host synchronisation after
the first call of a size. During CUDA-graph capture a call with more rows than any eager call had gets
fresh ``torch.full`` vectors instead: the graph fills them on every replay, and they are not kept, since
memory of the graph's pool holds nothing before a replay. (vLLM warms every capture size up eagerly
first, so captured calls normally slice.)

**Differences from vLLM's op.**

* An entry repeated within a row's count is attended once (qsa attends a token *set*); vLLM's kernel
  would add it once per occurrence. vLLM's expand step does not repeat a token: its blocks are complete
  4-token groups below the row's open group (chosen among the visible ones), its tail is the open group.
* Results agree with vLLM's within rounding, not bitwise: qsa's are held to an fp64 reference
  (``docs/spec.md`` section 4) and group their sums differently. They are deterministic for a fixed batch
  shape and bitwise unchanged when pages move (section 7).
* fp16 activations are taken (vLLM asserts bf16); a ``uint8`` cache always means FP8 E4M3.

**Not supported** (raises before any launch): ``float8_e5m2`` caches (TypeError); pages that are not a
multiple of 4 tokens (ValueError: qsa's page4 microblocks); head dims outside 16-256 (ValueError: no qsa
kernel takes them); fp32 activations (TypeError); scales as device tensors (ValueError: reading them would
synchronise); a gate that is neither q-shaped with stride 1 along D nor contiguous with q's size
(ValueError). Like vLLM's op, there is no lse output and no backward.

**Per-forward reuse.** :class:`ForwardPlans` (``plans=``) lets every QSA layer of a forward refill one
:class:`qsa.AttentionPlan` per batch shape instead of planning into new buffers; see its docstring for
when it helps.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..attention.api import AttentionPlan, plan_attention, run_attention, sparse_paged_attention
from ..attention.replay import tensor_key
from ..attention.routing import HEAD_DIMS
from ..utils import check_bool, check_int, check_tensor, same_device, type_name

__all__ = ["ForwardPlans", "qsa_sparse_paged_attention"]

ACT_DTYPES = (torch.bfloat16, torch.float16)
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
INT32_MAX = 2 ** 31 - 1


def qsa_sparse_paged_attention(q, k_cache, v_cache, logical_indices, block_table, token_to_req, use_prefill_config,
                               out=None, k_scale=None, v_scale=None, *, output_gate, positions=None, seq_lens=None,
                               plans: ForwardPlans | None = None):
    """vLLM's QSA attention op on qsa's kernels: ``out = round(attention) * sigmoid(output_gate)``.

    Args:
        q: ``[rows, Hq, D]`` bf16 or fp16, stride 1 along D; D in 16-256, a power of two.
        k_cache, v_cache: ``[num_blocks, page, Hkv, D]``, equal shapes and dtypes, stride 1 along D (vLLM's
            are views of one ``[num_blocks, Hkv, page, 2*D]`` tensor); q's dtype, or FP8 E4M3 as
            ``float8_e4m3fn`` or ``uint8``. ``page`` a multiple of 4, ``Hq % Hkv == 0``.
        logical_indices: ``[rows, W + 1]`` int32, stride 1 along columns: each row's logical tokens first
            (ascending: selected 4-token blocks, then the causal tail), the row's count of valid entries in
            the last column; entries past the count are never read.
        block_table: ``[num_reqs, max_blocks]`` int32, stride 1 along blocks (-1 or any id outside the
            cache: no page).
        token_to_req: ``[rows]`` int32 (int64 taken too).
        use_prefill_config: host bool: a prefill batch (True) or a decode / MTP batch (False). Chooses
            kernels only (``max_query_len=None`` or ``1``), never what a row attends.
        out: optional ``[rows, Hq, D]`` buffer in q's dtype, stride 1 along D; a new one when None.
        k_scale, v_scale: FP8 dequantisation scales (host floats, ``> 0``; None means 1.0): K and V are
            ``e4m3 * scale``. Ignored for a cache in q's dtype.
        output_gate: mandatory: q's shape and dtype (stride 1 along D), or any contiguous tensor of q's
            size and dtype (viewed as q, as vLLM does).
        positions: optional ``[rows]`` int64: drop tokens past each row's position (``< 0``: padding row).
        seq_lens: optional ``[num_reqs]`` int32: drop tokens ``>= seq_lens[req]``.
        plans: optional :class:`ForwardPlans`: refill its plan for this batch shape instead of planning
            into new buffers (call ``plans.begin_forward()`` once per forward first).

    Returns:
        ``out``: ``[rows, Hq, D]`` in q's dtype, every element written.

    No host synchronisation: the call can be captured in a CUDA graph.
    """
    kv_cache_dtype, gate = _checked_args(q, k_cache, v_cache, logical_indices, block_table, use_prefill_config,
                                         output_gate, plans)
    width = logical_indices.shape[1] - 1
    indices = logical_indices[:, :width]       # [rows, W], row stride W + 1
    index_counts = logical_indices[:, width]   # [rows], stride W + 1
    if positions is None or seq_lens is None:
        bound = min(block_table.shape[1] * k_cache.shape[1], INT32_MAX)
        if positions is None:
            positions = _BOUNDS.get(q.shape[0], bound - 1, torch.int64, q.device)
        if seq_lens is None:
            seq_lens = _BOUNDS.get(block_table.shape[0], bound, torch.int32, q.device)
    k_scale = 1.0 if k_scale is None else k_scale
    v_scale = 1.0 if v_scale is None else v_scale
    max_query_len = None if use_prefill_config else 1
    if plans is not None:
        return plans._attention(q, k_cache, v_cache, indices, index_counts, block_table, token_to_req, positions,
                                seq_lens, gate, out, kv_cache_dtype, k_scale, v_scale, max_query_len)
    return sparse_paged_attention(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens,
                                  gate=gate, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
                                  out=out, max_query_len=max_query_len, rows_sorted=True, index_counts=index_counts)


class ForwardPlans:
    """The attention plans of a model's forwards, refilled by every QSA layer of each forward.

    An engine creates one per model runner (one device, one stream), calls :meth:`begin_forward` once at
    the start of every forward, and passes it as ``plans=`` to each QSA layer's
    :func:`qsa_sparse_paged_attention`. A layer's call then refills the one :class:`qsa.AttentionPlan` of
    its batch shape (``qsa.plan_attention(..., out=plan)``) with its own selection and runs it
    (``qsa.run_attention``): the plan's work lists, split partials and grouped-planner workspace (zeroed
    once; the kernels leave it zeroed) are allocated by the first forward of a shape and serve every layer
    of every later forward of that shape, with no host synchronisation. The results are bitwise those of
    calls without ``plans=``.

    A batch shape is what decides a plan's buffers and launches: rows, ``W``, the table's shape, the cache's
    geometry and dtype, the heads, the ``max_query_len`` hint and the device.

    When it helps:

    * CUDA-graph capture of a whole forward (vLLM's full graphs). Without it, each layer's call plans into
      new buffers taken from the graph's memory pool, a zero-filled planner workspace among them, for every
      layer of every captured size. With it, the layers share the plan that the eager forward of that size
      made (vLLM runs each capture size eagerly before capturing it), and the graph holds no plan memory
      of its own.
    * Eager forwards: no plan buffers are allocated per layer after the first forward of a shape (qsa's
      planners may still take small per-call temporaries). With ``qsa.settings.REPLAY_STEPS`` on, a
      layer whose batch shape is the one its plan was last filled for replays the recorded planner and
      attention launches, as a plain call of a seen shape does.

    CUDA graphs: a plan made outside capture may be captured by any number of graphs (they and eager
    forwards use it in stream order, each refilling it before running it); once captured it is kept until
    :meth:`clear`, since a graph holds its buffers' addresses. A plan first needed during capture (a shape
    never run eagerly) is made in the graph's pool and serves only the rest of that captured forward, until
    the next :meth:`begin_forward`: its workspace is zero only inside that graph's replays, so no other
    forward may use it.

    Plans no graph captured are kept for the ``max_eager_plans`` most recently used batch shapes; older
    ones are freed (eager prefill batches come in many row counts, and the grouped plan of 8192 rows at
    ``W = 2051`` holds about 130 MB of work lists).

    One stream: a plan serves one layer at a time, so calls must be ordered (one stream per
    ``ForwardPlans``; no two forwards at once).

    Example:
        >>> plans = ForwardPlans()                        # once, by the model runner
        >>> plans.begin_forward()                         # at the start of every forward
        >>> out = qsa_sparse_paged_attention(q, k, v, logical_indices, block_table, token_to_req, False,
        ...                                  output_gate=gate, plans=plans)   # in each QSA layer
    """

    def __init__(self, *, max_eager_plans: int = 4):
        self.max_eager_plans = check_int("max_eager_plans", max_eager_plans, 1)
        self._plans: OrderedDict = OrderedDict()  # batch shape -> AttentionPlan made outside capture, LRU order
        self._pinned: set = set()   # shapes whose plan a CUDA graph captured: kept until clear()
        self._captured: dict = {}   # batch shape -> AttentionPlan made during this forward's capture
        self.max_query_len: int | None = None
        self.forwards = 0           # begin_forward calls so far
        self.calls = 0              # attention calls in the current forward

    def begin_forward(self, *, max_query_len: int | None = None) -> None:
        """Start a forward: drop the plans made during the previous forward's capture, if any, and set
        this forward's hint.

        Args:
            max_query_len: the most rows of one request in this forward, where the engine knows it (a host
                int ``>= 1``; vLLM's attention metadata carries it). For this forward it takes the place of
                ``use_prefill_config``'s hint: an MTP batch of 64 rows or more is then grouped (the rows of
                a request share their tokens), a one-request prefill groups its last partial group too.
                Chooses kernels only. Under CUDA graphs it must be the same when captured and replayed.
        """
        if max_query_len is not None:
            max_query_len = check_int("max_query_len", max_query_len, 1)
        self._captured = {}
        self.max_query_len = max_query_len
        self.forwards += 1
        self.calls = 0

    def cached_plans(self) -> tuple[AttentionPlan, ...]:
        """The plans kept for reuse (made outside capture), one per batch shape, least recently used first."""
        return tuple(self._plans.values())

    def captured_plans(self) -> tuple[AttentionPlan, ...]:
        """The kept plans that a CUDA graph captured (never freed before :meth:`clear`)."""
        return tuple(self._plans[key] for key in self._plans if key in self._pinned)

    def clear(self) -> None:
        """Forget every plan (their buffers are freed once no CUDA graph or tensor holds them). Drop the
        graphs captured with them first: a graph holds their addresses, not the buffers."""
        self._plans = OrderedDict()
        self._pinned = set()
        self._captured = {}

    def __repr__(self) -> str:
        return (f"ForwardPlans(shapes={len(self._plans)}, captured={len(self._pinned)}, forwards={self.forwards}, "
                f"calls={self.calls}, max_query_len={self.max_query_len})")

    def _attention(self, q, k_cache, v_cache, indices, index_counts, block_table, token_to_req, positions, seq_lens,
                   gate, out, kv_cache_dtype, k_scale, v_scale, max_query_len):
        if self.forwards == 0:
            raise RuntimeError("ForwardPlans.begin_forward() must be called at the start of every forward, "
                               "before its first QSA layer")
        if self.max_query_len is not None:
            max_query_len = self.max_query_len
        num_blocks, page, hkv, d = k_cache.shape
        key = (q.shape[0], q.shape[1], hkv, d, indices.shape[1], tuple(block_table.shape), num_blocks, page,
               kv_cache_dtype, max_query_len, str(q.device))
        capturing = _capturing(q.device)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            if capturing:
                self._pinned.add(key)
        elif capturing:
            plan = self._captured.get(key)
        fresh = plan is None
        plan = plan_attention(indices, block_table, token_to_req, positions, seq_lens, block_size=page,
                              num_blocks=num_blocks, num_q_heads=q.shape[1], num_kv_heads=hkv, head_dim=d,
                              out=plan, max_query_len=max_query_len, rows_sorted=True,
                              kv_cache_dtype=kv_cache_dtype, index_counts=index_counts)
        if fresh and capturing:
            self._captured[key] = plan
        elif fresh:
            self._plans[key] = plan
            self._evict()
        self.calls += 1
        return run_attention(plan, q, k_cache, v_cache, gate=gate, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                             v_scale=v_scale, out=out)

    def _evict(self) -> None:
        """Free the least recently used plans no graph captured, past ``max_eager_plans`` of them."""
        unpinned = [key for key in self._plans if key not in self._pinned]
        for key in unpinned[:max(0, len(unpinned) - self.max_eager_plans)]:
            del self._plans[key]


class _BoundVectors:
    """Constant int vectors (the bounds that stand in for absent ``positions`` / ``seq_lens``), one per
    (device, dtype, value), grown on demand; a vector replaced by a longer one is kept alive, since a
    captured CUDA graph may read it. The slice a call of ``n`` rows gets is kept too (up to ``SLICES_MAX``
    of them), so that a call of a seen size makes no new tensor."""

    SLICES_MAX = 1024

    def __init__(self):
        self._vectors: dict = {}
        self._retired: list = []
        self._slices: dict = {}  # (device, dtype, value, n) -> the view of a kept vector a call of n rows gets
        self._lock = threading.Lock()

    def get(self, n: int, value: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        view = self._slices.get((device, dtype, value, n))
        if view is not None:
            return view
        view = self._get(n, value, dtype, device)
        if view._base is not None:  # a slice of a kept vector, not a vector a capture made for itself
            if len(self._slices) >= self.SLICES_MAX:
                self._slices.clear()
            self._slices[(device, dtype, value, n)] = view
        return view

    def _get(self, n: int, value: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (str(device), dtype, value)
        vec = self._vectors.get(key)
        if vec is not None and vec.shape[0] >= n:
            return vec[:n]
        if _capturing(device):  # filled by the graph at every replay; not kept (see the module docstring)
            return torch.full((n,), value, dtype=dtype, device=device)
        with self._lock:
            vec = self._vectors.get(key)
            if vec is None or vec.shape[0] < n:
                size = max(n, 64 if vec is None else 2 * vec.shape[0])
                if vec is not None:
                    self._retired.append(vec)
                vec = torch.full((size,), value, dtype=dtype, device=device)
                self._vectors[key] = vec
        return vec[:n]


_BOUNDS = _BoundVectors()


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream of ``device`` is capturing a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_PASSED: dict = {}
"""Layouts :func:`_check_args` passed: each checked tensor's ``replay.tensor_key`` (shape, strides, dtype,
device) and the host arguments -> ``kv_cache_dtype``. Every check it makes is a function of these, so a
call of a layout seen before skips them (a serving engine calls with a few layouts, step after step)."""
_PASSED_MAX = 256


def _checked_args(q, k_cache, v_cache, logical_indices, block_table, use_prefill_config, output_gate, plans):
    """:func:`_check_args`, its verdict remembered per layout (plain tensors only)."""
    tensors = (q, k_cache, v_cache, logical_indices, block_table, output_gate)
    key = None
    if all(type(t) is torch.Tensor for t in tensors):
        key = (*map(tensor_key, tensors), type(use_prefill_config), use_prefill_config, type(plans))
        kv_cache_dtype = _PASSED.get(key)
        if kv_cache_dtype is not None:
            gate = output_gate if output_gate.shape == q.shape and output_gate.stride(2) == 1 else \
                output_gate.view_as(q)  # view_as: no torch.Size to parse
            return kv_cache_dtype, gate
    kv_cache_dtype, gate = _check_args(q, k_cache, v_cache, logical_indices, block_table, use_prefill_config,
                                       output_gate, plans)
    if key is not None:
        if len(_PASSED) >= _PASSED_MAX:
            _PASSED.clear()
        _PASSED[key] = kv_cache_dtype
    return kv_cache_dtype, gate


def _check_args(q, k_cache, v_cache, logical_indices, block_table, use_prefill_config, output_gate, plans):
    """Check what vLLM's layouts promise; return ``(kv_cache_dtype, gate)``. The rest (devices, ``out``,
    ``token_to_req``, ``positions``, ``seq_lens``, the scales) is checked by qsa's op, naming the argument."""
    check_tensor("q", q, ndim=3, dtypes=ACT_DTYPES, what="[rows, Hq, D] bf16/fp16")
    rows, hq, d = q.shape
    if q.stride(2) != 1:
        raise ValueError(f"q must have stride 1 along D (its last dimension), got strides {tuple(q.stride())}")
    if d not in HEAD_DIMS:
        raise ValueError(f"q's head dim D must be one of {HEAD_DIMS} (qsa's kernels), got shape {tuple(q.shape)}")
    layout = "[num_blocks, page, Hkv, D] (a view of the [num_blocks, Hkv, page, 2*D] cache tensor)"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, ndim=4, what=layout)
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must have one dtype, got {_dtype(k_cache)} and {_dtype(v_cache)}")
    if k_cache.dtype == q.dtype:
        kv_cache_dtype = "auto"
    elif k_cache.dtype in FP8_CACHE_DTYPES:
        kv_cache_dtype = "fp8_e4m3"
    else:
        raise TypeError(f"k_cache must have q's dtype ({_dtype(q)}) or hold FP8 E4M3 (float8_e4m3fn, or uint8 "
                        f"storage), got {_dtype(k_cache)}" + (": float8_e5m2 caches are not supported"
                                                              if k_cache.dtype == torch.float8_e5m2 else ""))
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    _, page, hkv, cache_d = k_cache.shape
    if cache_d != d:
        raise ValueError(f"k_cache head dim must be q's D ({d}), got shape {tuple(k_cache.shape)}")
    if page == 0 or page % 4:
        raise ValueError(f"k_cache page size (dim 1) must be a positive multiple of 4 (qsa reads pages in 4-token "
                         f"microblocks), got shape {tuple(k_cache.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k_cache's KV heads ({hkv})")
    check_tensor("logical_indices", logical_indices, ndim=2, dtypes=torch.int32,
                 what="[rows, W + 1] int32 (W selected tokens, then the count)")
    if logical_indices.shape[0] != rows:
        raise ValueError(f"logical_indices must have q's {rows} rows, got shape {tuple(logical_indices.shape)}")
    if logical_indices.shape[1] < 1:
        raise ValueError(f"logical_indices must have at least 1 column (the count is the last), got shape "
                         f"{tuple(logical_indices.shape)}")
    if logical_indices.shape[1] > 1 and logical_indices.stride(1) != 1:
        raise ValueError(f"logical_indices must have stride 1 along its columns, got strides "
                         f"{tuple(logical_indices.stride())}")
    if not same_device(logical_indices.device, q.device):
        raise ValueError(f"logical_indices must be on {q.device}, got {logical_indices.device}")
    check_tensor("block_table", block_table, ndim=2, dtypes=torch.int32, what="[num_reqs, max_blocks] int32")
    check_bool("use_prefill_config", use_prefill_config)
    if plans is not None and not isinstance(plans, ForwardPlans):
        raise TypeError(f"plans must be a ForwardPlans or None, got {type_name(plans)}")
    return kv_cache_dtype, _gate_view(output_gate, q)


def _gate_view(output_gate, q):
    """``output_gate`` as qsa's ``gate``: as it is where q-shaped with stride 1 along D, else viewed as q
    where contiguous with q's size (vLLM's ``output_gate.view_as(q)``)."""
    if output_gate is None:
        raise TypeError("output_gate is mandatory: q's shape and dtype, out = attention * sigmoid(output_gate)")
    check_tensor("output_gate", output_gate, dtypes=q.dtype, what="q's shape [rows, Hq, D], q's dtype")
    if not same_device(output_gate.device, q.device):
        raise ValueError(f"output_gate must be on {q.device}, got {output_gate.device}")
    if tuple(output_gate.shape) == tuple(q.shape) and output_gate.stride(2) == 1:
        return output_gate
    if output_gate.is_contiguous() and output_gate.numel() == q.numel():
        return output_gate.view_as(q)
    raise ValueError(f"output_gate must have q's shape {tuple(q.shape)} with stride 1 along D, or be contiguous "
                     f"with q's {q.numel()} elements, got shape {tuple(output_gate.shape)} and strides "
                     f"{tuple(output_gate.stride())}")


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")
