"""Paged KV cache: storage, FP8 E4M3 quantisation, the write kernel launcher, block bookkeeping.

Layouts (docs/spec.md section 3):

* interleaved: ``storage[num_blocks, 2, block_size, Hkv, D]``; ``k = storage[:, 0]``, ``v = storage[:, 1]``
  are strided views ``[num_blocks, block_size, Hkv, D]``.
* separate: contiguous ``k`` and ``v`` tensors ``[num_blocks, block_size, Hkv, D]`` (``storage`` is None).

Token ``t`` of a request lives in physical block ``block_table[req, t // block_size]`` at offset
``t % block_size``; its *slot* is ``physical_block * block_size + offset``.

FP8 E4M3 caches hold bytes (``torch.uint8``) with one fp32 scale per tensor and layer:
write ``(x.float() / scale).to(float8_e4m3fn)``, read ``e4m3.float() * scale``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .. import backend as backends
from ..attention import replay
from .kernels import cache_write_kernel
from ..utils import check_int, check_positive_float, check_tensor, next_pow2, overlaps_itself, same_device

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_E4M3_MAX = 448.0
E4M3_NAN_BYTE = 0x7F
"""The byte ``fill="nan"`` writes into FP8 caches (positive E4M3FN NaN)."""


def _torch_e4m3_saturates() -> bool:
    """How the installed torch casts values past the E4M3 range: to +-448 (seen in torch 2.13) or to
    NaN (seen in torch 2.11)."""
    probe = torch.tensor([470.0, 1e6, float("inf")]).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    return probe == [0x7E, 0x7E, 0x7E]


E4M3_SATURATES = _torch_e4m3_saturates()
"""Whether FP8 writes saturate overflow to +-448 (True) or produce NaN (False); follows torch."""

COLLISION_STRIDE = 2048
"""Default spacing of collision-prone block ids: ``page * COLLISION_STRIDE + COLLISION_OFFSET``."""
COLLISION_OFFSET = 7


def quantize_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``(x.float() / scale).to(float8_e4m3fn)`` as bytes (``torch.uint8``, same shape as ``x``).

    Round to nearest even; NaN stays NaN. Values that round past 448 (``|x / scale| > 464``, inf
    included) follow the installed torch: +-448 in newer releases, NaN in older ones (see
    :data:`E4M3_SATURATES`); the write kernel does the same.

    A NaN keeps the sign bit the division gives it (a GPU's fp32 division returns a positive
    canonical NaN, so ``-nan`` becomes 0x7F there and 0xFF on CPU); the kernel matches torch on the
    same device. The division is the correctly rounded fp32 one on every device: torch's CUDA
    ``tensor / python_float`` multiplies by a reciprocal instead (one fp32 ulp off at times, which can
    flip an E4M3 rounding), so the scale is passed as a tensor.
    """
    check_positive_float("scale", scale)
    s = torch.tensor(float(scale), dtype=torch.float32, device=x.device)
    return (x.float() / s).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_e4m3(u8: torch.Tensor, scale: float) -> torch.Tensor:
    """Bytes holding E4M3FN values -> fp32 ``e4m3.float() * scale``."""
    check_tensor("u8", u8, dtypes=torch.uint8)
    check_positive_float("scale", scale)
    return u8.view(torch.float8_e4m3fn).float() * float(scale)


def _check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


@dataclass
class PagedKVCache:
    """One layer's paged K/V cache.

    Attributes:
        k: ``[num_blocks, block_size, Hkv, D]`` K cache (a view of ``storage`` when interleaved).
        v: ``[num_blocks, block_size, Hkv, D]`` V cache.
        storage: ``[num_blocks, 2, block_size, Hkv, D]`` interleaved tensor, or None (separate layout).
        kv_cache_dtype: ``"auto"`` (k/v hold activations) or ``"fp8_e4m3"`` (k/v hold E4M3 bytes).
        k_scale: fp32 K scale of FP8 caches (1.0 otherwise).
        v_scale: fp32 V scale of FP8 caches.
    """

    k: torch.Tensor
    v: torch.Tensor
    storage: torch.Tensor | None = None
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self):
        _check_kv_cache_dtype(self.kv_cache_dtype)
        _check_cache_pair(self.k, self.v, self.kv_cache_dtype)
        check_positive_float("k_scale", self.k_scale)
        check_positive_float("v_scale", self.v_scale)
        if self.storage is not None:
            check_tensor("storage", self.storage, ndim=5,
                         shape=(self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim),
                         what="[num_blocks, 2, block_size, Hkv, D]")
            for i, (name, view) in enumerate((("k", self.k), ("v", self.v))):
                half = self.storage[:, i]
                if (view.data_ptr(), view.stride(), view.element_size()) != \
                        (half.data_ptr(), half.stride(), half.element_size()):
                    raise ValueError(f"{name} must be the view storage[:, {i}] of storage")
                if view.dtype != half.dtype:
                    raise ValueError(f"{name} must be the view storage[:, {i}] of storage with its dtype "
                                     f"{_dtype_name(half.dtype)}, got {_dtype_name(view.dtype)}")
        _check_disjoint(self.k, self.v)

    @classmethod
    def from_storage(cls, storage: torch.Tensor, *, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                     v_scale: float = 1.0) -> "PagedKVCache":
        """Wrap an interleaved ``[num_blocks, 2, block_size, Hkv, D]`` tensor."""
        check_tensor("storage", storage, ndim=5, what="[num_blocks, 2, block_size, Hkv, D]")
        if storage.shape[1] != 2:
            raise ValueError(f"storage must have shape [num_blocks, 2, block_size, Hkv, D], "
                             f"got {tuple(storage.shape)}")
        return cls(storage[:, 0], storage[:, 1], storage, kv_cache_dtype, k_scale, v_scale)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def layout(self) -> str:
        return "separate" if self.storage is None else "interleaved"

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the cache tensors (``torch.uint8`` for FP8)."""
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``k``, ``v`` ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]`` (see :func:`write_kv`)."""
        write_kv(self.k, self.v, k, v, slot_mapping, kv_cache_dtype=self.kv_cache_dtype,
                 k_scale=self.k_scale, v_scale=self.v_scale)

    def relocated(self, block_table: torch.Tensor, mapping: torch.Tensor, *,
                  num_blocks_out: int | None = None, fill=None) -> tuple["PagedKVCache", torch.Tensor]:
        """This cache with its blocks moved by ``mapping`` (see :func:`relocate`), and the new table."""
        kw = dict(num_blocks_out=num_blocks_out, fill=fill)
        if self.storage is not None:
            storage, table = relocate(self.storage, block_table, mapping, **kw)
            return PagedKVCache.from_storage(storage, kv_cache_dtype=self.kv_cache_dtype,
                                             k_scale=self.k_scale, v_scale=self.v_scale), table
        k, table = relocate(self.k, block_table, mapping, **kw)
        v, _ = relocate(self.v, block_table, mapping, **kw)
        return PagedKVCache(k, v, None, self.kv_cache_dtype, self.k_scale, self.v_scale), table


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                      dtype: torch.dtype = torch.float16, kv_cache_dtype: str = "auto",
                      layout: str = "interleaved", device=None, fill=None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> PagedKVCache:
    """Allocate a paged KV cache.

    Args:
        num_blocks, block_size, num_kv_heads, head_dim: cache geometry; ``block_size % 4 == 0``.
        dtype: activation dtype (fp16, bf16 or fp32) of an ``"auto"`` cache; ignored for FP8.
        kv_cache_dtype: ``"auto"`` or ``"fp8_e4m3"`` (stored as ``torch.uint8``).
        layout: ``"interleaved"`` (``storage[num_blocks, 2, block_size, Hkv, D]``) or ``"separate"``.
        device: where the cache lives; None (the default) means torch's current default device
            (``torch.get_default_device()``), as for torch's own factory functions.
        fill: None leaves ``torch.empty`` memory; ``"nan"`` fills every slot with NaN (the E4M3 NaN
            byte 0x7F for FP8) so tests can prove unused slots are never read; ``"zeros"`` zeroes.
        k_scale, v_scale: fp32 scales of FP8 caches.

    Returns:
        A :class:`PagedKVCache`.

    Example:
        >>> cache = allocate_kv_cache(64, 16, 1, 128, dtype=torch.bfloat16, fill="nan")
        >>> cache.k.shape
        torch.Size([64, 16, 1, 128])
    """
    for name, val in (("num_blocks", num_blocks), ("block_size", block_size),
                      ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if block_size % 4 != 0:
        raise ValueError(f"block_size must be a multiple of 4 (page4 microblocks), got {block_size}")
    _check_kv_cache_dtype(kv_cache_dtype)
    if layout not in ("interleaved", "separate"):
        raise ValueError(f"layout must be 'interleaved' or 'separate', got {layout!r}")
    if fill not in (None, "nan", "zeros"):
        raise ValueError(f"fill must be None, 'nan' or 'zeros', got {fill!r}")
    if kv_cache_dtype == "fp8_e4m3":
        storage_dtype = torch.uint8
    elif dtype in ACTIVATION_DTYPES:
        storage_dtype = dtype
    else:
        raise TypeError(f"dtype must be one of float16, bfloat16, float32, got {dtype}")

    shape = (block_size, num_kv_heads, head_dim)
    if layout == "interleaved":
        storage = _filled((num_blocks, 2, *shape), storage_dtype, device, fill)
        return PagedKVCache.from_storage(storage, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                                         v_scale=v_scale)
    k = _filled((num_blocks, *shape), storage_dtype, device, fill)
    v = _filled((num_blocks, *shape), storage_dtype, device, fill)
    return PagedKVCache(k, v, None, kv_cache_dtype, k_scale, v_scale)


def _filled(shape, dtype, device, fill) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if fill == "nan":
        t.fill_(E4M3_NAN_BYTE if dtype == torch.uint8 else float("nan"))
    elif fill == "zeros":
        t.zero_()
    return t


def _check_cache_pair(k_cache, v_cache, kv_cache_dtype: str) -> None:
    what = "[num_blocks, block_size, Hkv, D]"
    dtypes = (torch.uint8,) if kv_cache_dtype == "fp8_e4m3" else ACTIVATION_DTYPES
    check_tensor("k_cache", k_cache, ndim=4, dtypes=dtypes, what=what)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=k_cache.dtype, shape=tuple(k_cache.shape),
                 device=k_cache.device, what=what)
    if k_cache.shape[1] % 4 != 0:
        raise ValueError(f"k_cache block_size (dim 1) must be a multiple of 4, got {k_cache.shape[1]}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _offset_reachable(delta: int, dims: list) -> bool:
    """Whether ``delta = sum_d c_d * stride_d`` with ``|c_d| <= size_d - 1`` for ``dims``, a list of
    ``(stride, size)`` by increasing stride, each stride past the extent of the smaller ones. The
    residual left for the smaller dimensions is within +-extent < stride, so at most two ``c`` of the
    largest dimension qualify at each level."""
    if not dims:
        return delta == 0
    (stride, size), rest = dims[-1], dims[:-1]
    extent = sum((n - 1) * st for st, n in rest)
    lo = max(-(size - 1), -((extent - delta) // stride))
    hi = min(size - 1, (delta + extent) // stride)
    return any(_offset_reachable(delta - c * stride, rest) for c in range(lo, hi + 1))


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one device may have an element in common (host metadata only, no
    device work). Exact for two views with the same element size, shape and strides that do not
    overlap themselves (K and V interleaved along any dimension of one storage); otherwise any
    overlap of their address spans counts."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t):
        lo = t.data_ptr()
        return lo, lo + t.element_size() * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))

    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    size = a.element_size()
    delta = b_lo - a_lo
    if (b.element_size() != size or a.shape != b.shape or a.stride() != b.stride() or delta % size
            or overlaps_itself(a)):
        return True
    return _offset_reachable(delta // size, sorted((st, n) for n, st in zip(a.shape, a.stride()) if n > 1))


def _check_disjoint(k_cache, v_cache) -> None:
    if _shares_memory(k_cache, v_cache):
        raise ValueError("k_cache and v_cache must not share memory (V would overwrite K): pass two "
                         "tensors, or the views storage[:, 0] and storage[:, 1] of an interleaved storage; "
                         f"got data_ptr {k_cache.data_ptr():#x} / {v_cache.data_ptr():#x}, strides "
                         f"{tuple(k_cache.stride())} / {tuple(v_cache.stride())}")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, *, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
             v_scale: float = 1.0, backend: str | None = None) -> None:
    """Scatter new K/V rows into a paged cache (one Triton launch, no host synchronisation).

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``; strided views of an interleaved
            storage are fine, but no element may be shared by the two (ValueError).
            fp16/bf16/fp32 for ``"auto"``, ``torch.uint8`` for ``"fp8_e4m3"``.
        k, v: ``[T, Hkv, D]`` new rows (any strides). Same dtype as the cache for ``"auto"``;
            fp16/bf16/fp32 for FP8, quantised bit-exactly as :func:`quantize_e4m3`.
        slot_mapping: ``[T]`` int64 (or int32) ``physical_block * block_size + offset``. Slots < 0
            or >= ``num_blocks * block_size`` are skipped (nothing is written for them).
        kv_cache_dtype: ``"auto"`` or ``"fp8_e4m3"``.
        k_scale, v_scale: python floats, the FP8 scales.
        backend: "triton", or "torch" (the same writes in PyTorch, with a host synchronisation);
            default: Triton wherever it can run (see :func:`qsa.backend.kernel_backend`).

    Example:
        >>> cache = allocate_kv_cache(8, 16, 1, 64, fill="nan")
        >>> k = v = torch.randn(3, 1, 64, dtype=torch.float16)
        >>> write_kv(cache.k, cache.v, k, v, torch.tensor([16, 17, -1]))

    With ``settings.REPLAY_STEPS`` on a GPU, the first Triton call of a fingerprint (every tensor's shape,
    strides, dtype and device, ``kv_cache_dtype``, the scales, the backend, the stream, the settings)
    records its launch, and later calls with that fingerprint replay it with their own pointers
    (:mod:`qsa.attention.replay`): the checks and the binding are not repeated, except that the caches must
    lie as the recorded call's did relative to each other or be apart (the disjointness check depends on
    where they are, not only on their layout).
    """
    if type(k_cache) is torch.Tensor and type(kv_cache_dtype) is str and type(k_scale) in _SCALE_TYPES \
            and type(v_scale) in _SCALE_TYPES and (ctx := replay.context_of(k_cache)) is not None:
        stream, env = ctx
        try:
            key = (kv_cache_dtype, k_scale, v_scale, backends.resolve_backend(backend, k_cache.device), stream,
                   replay.tensor_key(k_cache), replay.tensor_key(v_cache), replay.tensor_key(k),
                   replay.tensor_key(v), replay.tensor_key(slot_mapping))
        except (AttributeError, TypeError, ValueError):  # not tensors, or a backend that cannot run
            key = None
        if key is not None and key[3] == "triton":  # the PyTorch path is never recorded
            entry = _WRITES.get(key, env)
            if entry is _WRITES:
                _write_kv_recorded(key, stream, k_cache, v_cache, k, v, slot_mapping, kv_cache_dtype, k_scale,
                                   v_scale, backend)
                return
            if entry is not None:
                step, delta, k_span, v_span = entry
                d = v_cache.data_ptr() - k_cache.data_ptr()
                if (d == delta or d >= k_span or -d >= v_span) and _WRITES.serve(
                        step, dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping), stream):
                    return
    _write_kv_full(k_cache, v_cache, k, v, slot_mapping, kv_cache_dtype, k_scale, v_scale, backend)


_SCALE_TYPES = (float, int)
"""Types of the scales a write_kv fingerprint holds by value (a bool, which equals an int, is refused by
the checks, so it never reaches a replay)."""

_WRITES = replay.ReplayCache()
"""write_kv's recorded launches, by call fingerprint: (Replay, v_cache - k_cache address offset of the
recorded call, byte spans of k_cache and v_cache), or None where the launch cannot be replayed."""


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last one (0 for no element)."""
    if t.numel() == 0:
        return 0
    return t.element_size() * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))


def _write_kv_recorded(key, stream, k_cache, v_cache, k, v, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                       backend) -> None:
    """The first call of fingerprint ``key``: the full path under a recorder, its launch cached as a replay
    with the caches' relative placement (None where it cannot be replayed). Inputs that share an address
    (``k`` and ``v`` one tensor) are served unrecorded, and the fingerprint stays open to distinct ones."""
    with replay.Recorder() as rec:
        _write_kv_full(k_cache, v_cache, k, v, slot_mapping, kv_cache_dtype, k_scale, v_scale, backend)
    inputs = dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)
    if replay.shares_pointers(inputs):
        return
    step = replay.replay_of(rec, inputs, [], k_cache.device, stream)
    if step is None:
        _WRITES.put(key, None)
        return
    # The checks passed for this placement of v_cache relative to k_cache; whether two views of the key's
    # layouts share an element depends on that offset alone, and they share none when their spans are apart.
    _WRITES.put(key, (step, v_cache.data_ptr() - k_cache.data_ptr(), _span(k_cache), _span(v_cache)))


def _write_kv_full(k_cache, v_cache, k, v, slot_mapping, kv_cache_dtype, k_scale, v_scale, backend) -> None:
    """write_kv's full path: every check, then the PyTorch writes or the launch."""
    _check_kv_cache_dtype(kv_cache_dtype)
    _check_cache_pair(k_cache, v_cache, kv_cache_dtype)
    _check_disjoint(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    what = "[T, Hkv, D]"
    in_dtypes = ACTIVATION_DTYPES if kv_cache_dtype == "fp8_e4m3" else k_cache.dtype
    check_tensor("k", k, ndim=3, dtypes=in_dtypes, shape=(None, num_kv_heads, head_dim), what=what)
    num_tokens = k.shape[0]
    check_tensor("v", v, ndim=3, dtypes=k.dtype, shape=tuple(k.shape), what=what)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64, torch.int32),
                 shape=(num_tokens,), what="[T]")
    if num_tokens > 1 and slot_mapping.stride(0) != 1:  # the kernel reads slot i at offset i
        raise ValueError(f"slot_mapping must be contiguous (stride 1), got stride {slot_mapping.stride(0)}")
    for name, t in (("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        if not same_device(t.device, k_cache.device):
            raise ValueError(f"{name} must be on the cache's device {k_cache.device}, got {t.device}")
    check_positive_float("k_scale", k_scale)
    check_positive_float("v_scale", v_scale)
    if num_tokens == 0:
        return
    if backends.resolve_backend(backend, k_cache.device) == "torch":
        slots = slot_mapping.to(torch.int64)
        ok = (slots >= 0) & (slots < num_blocks * block_size)
        blk, off = slots[ok] // block_size, slots[ok] % block_size
        for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
            x = x[ok]
            cache[blk, off] = quantize_e4m3(x, scale) if kv_cache_dtype == "fp8_e4m3" else x.to(cache.dtype)
        return

    grid = (num_tokens, num_kv_heads)
    replay.launch(
        cache_write_kernel, grid,
        k, v, slot_mapping, k_cache, v_cache,
        float(k_scale), float(v_scale),
        num_blocks * block_size, block_size,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        IS_FP8=kv_cache_dtype == "fp8_e4m3",
        SATURATE=E4M3_SATURATES,
    )


class OutOfBlocksError(RuntimeError):
    """The allocator has fewer free blocks than a request needs."""


class BlockAllocator:
    """Host-side page bookkeeping for tests, benchmarks and examples.

    Blocks are refcounted: :meth:`share_prefix` makes a request alias another's first blocks
    ("page aliasing"), and a block returns to the free list when its last user is freed.

    Args:
        num_blocks: physical blocks in the cache.
        block_size: tokens per block, a positive multiple of 4.
        reserve_block0: keep physical block 0 out of the free list (it may hold another layer's state).
        generator: None hands blocks out in ascending order; a ``torch.Generator``, a
            ``random.Random`` or an int seed shuffles the free list so ids are not simply 1, 2, 3...
    """

    def __init__(self, num_blocks: int, block_size: int, *, reserve_block0: bool = True,
                 generator=None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0 or block_size % 4:
            raise ValueError(f"block_size must be a positive multiple of 4 (page4 microblocks), got {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        first = 1 if reserve_block0 else 0
        ids = list(range(first, self.num_blocks))
        if isinstance(generator, torch.Generator):
            ids = [ids[i] for i in torch.randperm(len(ids), generator=generator).tolist()]
        elif isinstance(generator, random.Random):
            generator.shuffle(ids)
        elif isinstance(generator, int) and not isinstance(generator, bool):
            random.Random(generator).shuffle(ids)
        elif generator is not None:
            raise TypeError(f"generator must be None, a torch.Generator, a random.Random or an int seed, "
                            f"got {type(generator).__name__}")
        # Blocks are popped from the end; reverse so the first id of the list goes out first.
        self._free = ids[::-1]
        self._refcount = [0] * self.num_blocks
        self._blocks: dict = {}
        self._tokens: dict = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks(self, req_id) -> list[int]:
        """Physical blocks of ``req_id`` in logical order."""
        return list(self._get(req_id))

    def num_tokens(self, req_id) -> int:
        self._get(req_id)
        return self._tokens[req_id]

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def allocate(self, req_id, num_tokens: int) -> list[int]:
        """Grow ``req_id`` (created if new) to hold ``num_tokens`` tokens; returns its blocks.

        Raises:
            OutOfBlocksError: not enough free blocks (nothing is allocated then).
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        blocks = self._blocks.setdefault(req_id, [])
        self._tokens.setdefault(req_id, 0)
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > len(self._free):
            raise OutOfBlocksError(f"request {req_id!r} needs {need} more blocks for {num_tokens} tokens, "
                                   f"only {len(self._free)} of {self.num_blocks} are free")
        for _ in range(max(need, 0)):
            b = self._free.pop()
            self._refcount[b] = 1
            blocks.append(b)
        self._tokens[req_id] = max(self._tokens[req_id], num_tokens)
        return list(blocks)

    def __contains__(self, req_id) -> bool:
        """Whether ``req_id`` holds an allocation (``allocate`` made it, ``free`` has not released it)."""
        return req_id in self._blocks

    def free(self, req_id) -> None:
        """Release ``req_id``; blocks still used by another request stay allocated."""
        for b in self._get(req_id):
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)
        del self._blocks[req_id], self._tokens[req_id]

    def share_prefix(self, src_req, dst_req, num_blocks: int) -> list[int]:
        """Make new request ``dst_req`` start with ``src_req``'s first ``num_blocks`` physical blocks.

        Writes into a shared block are seen by both requests (there is no copy-on-write): share
        only blocks whose content both requests agree on.
        """
        src = self._get(src_req)
        if dst_req in self._blocks and self._blocks[dst_req]:
            raise ValueError(f"dst_req {dst_req!r} already holds blocks; share_prefix needs a new request")
        if not 0 <= num_blocks <= len(src):
            raise ValueError(f"num_blocks must be in [0, {len(src)}] (blocks of {src_req!r}), "
                             f"got {num_blocks}")
        shared = src[:num_blocks]
        for b in shared:
            self._refcount[b] += 1
        self._blocks[dst_req] = list(shared)
        self._tokens[dst_req] = min(num_blocks * self.block_size, self._tokens[src_req])
        return list(shared)

    def slot_mapping(self, req_id, start: int, end: int, device=None) -> torch.Tensor:
        """int64 ``[end - start]`` slots of tokens ``start..end-1`` of ``req_id``, on ``device`` (None: torch's
        current default device, ``torch.get_default_device()``)."""
        blocks = self._get(req_id)
        if not 0 <= start <= end <= len(blocks) * self.block_size:
            raise ValueError(f"token range [{start}, {end}) outside the {len(blocks) * self.block_size} "
                             f"allocated slots of request {req_id!r}")
        bs = self.block_size
        slots = [blocks[t // bs] * bs + t % bs for t in range(start, end)]
        return torch.tensor(slots, dtype=torch.int64, device=device)

    def block_table(self, req_ids, max_blocks: int | None = None, device=None) -> torch.Tensor:
        """int32 ``[len(req_ids), max_blocks]`` table, padded with -1 (default width: the longest;
        0 columns when no request holds a block), on ``device`` (None: torch's current default device,
        ``torch.get_default_device()``)."""
        rows = [self._get(r) for r in req_ids]
        if max_blocks is None:
            width = max((len(b) for b in rows), default=0)
        else:
            width = check_int("max_blocks", max_blocks, 0)
        table = torch.full((len(rows), width), -1, dtype=torch.int32, device="cpu")  # filled on the host
        for i, (req, b) in enumerate(zip(req_ids, rows)):
            if len(b) > width:
                raise ValueError(f"request {req!r} holds {len(b)} blocks, more than max_blocks={width}")
            table[i, :len(b)] = torch.tensor(b, dtype=torch.int32, device="cpu")
        return table.to(torch.get_default_device() if device is None else device)

    def _get(self, req_id) -> list[int]:
        if req_id not in self._blocks:
            raise KeyError(f"unknown request {req_id!r}")
        return self._blocks[req_id]


def random_mapping(num_blocks_in: int, *, num_blocks_out: int | None = None, generator=None,
                   collision_prone: bool = False, stride: int | None = None) -> torch.Tensor:
    """A random injective int64 mapping ``[num_blocks_in]`` of old physical block -> new one.

    Plain: a random permutation of ``range(num_blocks_out)`` (default ``num_blocks_in``), cut to
    ``num_blocks_in`` entries. ``collision_prone=True``: ids ``perm[i] * stride + 7``, multiples of a
    power of two plus a constant, so microblock ids collide in any power-of-two hash table smaller
    than ``stride * block_size // 4``. ``stride`` defaults to :data:`COLLISION_STRIDE` (2048) with
    ``num_blocks_out`` at least :func:`collision_prone_num_blocks` ``(num_blocks_in, stride)``; when
    ``num_blocks_out`` is given and too small, the default stride is halved until it fits (down to 16).
    """
    n = int(num_blocks_in)
    if n <= 0:
        raise ValueError(f"num_blocks_in must be positive, got {num_blocks_in}")
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    if not collision_prone:
        out = n if num_blocks_out is None else int(num_blocks_out)
        if out < n:
            raise ValueError(f"num_blocks_out ({out}) must be >= num_blocks_in ({n})")
        return torch.randperm(out, generator=generator)[:n].to(torch.int64)

    if stride is None:
        stride = COLLISION_STRIDE
        while (num_blocks_out is not None and stride > 16
               and collision_prone_num_blocks(n, stride) > num_blocks_out):
            stride //= 2
    if stride <= COLLISION_OFFSET:
        raise ValueError(f"stride must be > {COLLISION_OFFSET}, got {stride}")
    need = collision_prone_num_blocks(n, stride)
    if num_blocks_out is not None and num_blocks_out < need:
        raise ValueError(f"num_blocks_out={num_blocks_out} is too small for stride {stride}: need >= {need}")
    perm = torch.randperm(n, generator=generator).to(torch.int64)
    return perm * stride + COLLISION_OFFSET


def collision_prone_num_blocks(num_blocks_in: int, stride: int = COLLISION_STRIDE) -> int:
    """Smallest cache that holds the ids of ``random_mapping(..., collision_prone=True, stride=stride)``."""
    return (int(num_blocks_in) - 1) * stride + COLLISION_OFFSET + 1


def relocate(tensor: torch.Tensor, block_table: torch.Tensor, mapping: torch.Tensor, *,
             num_blocks_out: int | None = None, fill=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the physical blocks of a paged tensor and rewrite the block table to match.

    A test utility: it validates the mapping on the host (it synchronises), so keep it out of
    captured CUDA graphs.

    Args:
        tensor: any paged tensor whose dim 0 is the physical block (interleaved storage, a separate
            K or V cache, a compressed-key cache).
        block_table: ``[num_reqs, max_blocks]`` int32 table into ``tensor``.
        mapping: int64 ``[num_blocks_in]``; ``mapping[old]`` is the new physical id of block ``old``,
            or -1 to drop it (other negative values are refused). Must be injective on the mapped
            blocks and map every block the table uses.
        num_blocks_out: blocks of the new tensor (default: same as ``tensor``).
        fill: content of blocks nothing maps to: None -> zeros, ``"nan"`` -> NaN (0x7F for uint8).

    Returns:
        ``(new_tensor, new_table)``. Valid entries ``e`` of the table become ``mapping[e]``; invalid
        ones (< 0 or >= ``num_blocks_in``) become -1, so they stay invalid in a larger cache.
    """
    check_tensor("tensor", tensor, what="[num_blocks, ...]")
    check_tensor("block_table", block_table, ndim=2, dtypes=torch.int32, what="[num_reqs, max_blocks]")
    n_in = tensor.shape[0]
    check_tensor("mapping", mapping, ndim=1, dtypes=torch.int64, shape=(n_in,), what="[num_blocks_in]")
    n_out = n_in if num_blocks_out is None else int(num_blocks_out)
    if fill not in (None, "nan"):
        raise ValueError(f"fill must be None or 'nan', got {fill!r}")

    mapping = mapping.to(tensor.device)
    if bool((mapping < -1).any()):  # host sync, as the checks below (relocate is a test utility)
        raise ValueError(f"mapping must hold ids >= -1 (-1: drop), got {int(mapping.min())}")
    mapped = mapping >= 0
    if bool((mapping >= n_out).any()):
        raise ValueError(f"mapping has ids >= num_blocks_out ({n_out})")
    targets = mapping[mapped]
    if targets.unique().numel() != targets.numel():
        raise ValueError("mapping must be injective on the mapped blocks")

    table = block_table.to(torch.int64)
    valid = (table >= 0) & (table < n_in)
    if n_in == 0:  # no block: every entry is invalid
        new_ids = torch.full_like(table, -1)
    else:
        new_ids = mapping[table.clamp(0, n_in - 1).to(mapping.device)].to(block_table.device)
    if bool((valid & (new_ids < 0)).any()):
        raise ValueError("mapping drops (-1) a block the block table uses")
    new_table = torch.where(valid, new_ids, -1).to(torch.int32)

    shape = (n_out, *tensor.shape[1:])
    if fill == "nan":
        out = _filled(shape, tensor.dtype, tensor.device, "nan")
    else:
        out = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
    out[targets] = tensor[mapped]
    return out, new_table
