"""Tensor parallelism for the QSA layer through ``torch.distributed``.

The layer shards attention heads across ranks and keeps the selection replicated:

* query heads: rank ``r`` of ``n`` owns ``[r * Hq/n, (r + 1) * Hq/n)`` (24 heads: 24 at TP1, 12 at
  TP2, 6 at TP4);
* KV heads: split when ``Hkv % n == 0`` (2 heads at TP2: one each); replicated when ``n % Hkv == 0``
  (2 heads at TP4: ranks 0-1 hold head 0, ranks 2-3 head 1), so KV head ``j`` still serves query
  heads ``[j * G, (j + 1) * G)`` of the full model;
* q/gate, k and v projections are column shards; o_proj is a row shard whose partial products are
  summed with one all-reduce;
* the index projections, the compressed-key cache and ``select_tokens`` are computed identically on
  every rank (all query heads of a row share one selection), so ranks never exchange indices.

The all-reduce runs in ``reduce_dtype`` (fp32 by default: exact enough that TP2 of a bf16 layer is
one rounding away from TP1, and identical on every rank).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from ..utils import check_int


@dataclass(frozen=True)
class TPInfo:
    """Where this process sits in a tensor-parallel group.

    Attributes:
        rank: rank in the group, ``0 <= rank < world_size``.
        world_size: ranks sharing a layer (1 = no tensor parallelism).
        group: the ``torch.distributed`` process group, or None for the default group.
        reduce_dtype: dtype of the o_proj all-reduce (None: the activation dtype).
    """

    rank: int = 0
    world_size: int = 1
    group: object = None
    reduce_dtype: torch.dtype | None = torch.float32

    def __post_init__(self):
        check_int("world_size", self.world_size, 1)
        if not 0 <= check_int("rank", self.rank) < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {self.rank}, world_size {self.world_size}")
        if self.reduce_dtype is not None and (not isinstance(self.reduce_dtype, torch.dtype)
                                              or not self.reduce_dtype.is_floating_point):
            raise TypeError(f"reduce_dtype must be a floating torch.dtype or None, got {self.reduce_dtype!r}")

    @classmethod
    def from_distributed(cls, group=None, reduce_dtype: torch.dtype | None = torch.float32) -> "TPInfo":
        """The TP info of this process in ``group`` (default: the whole initialised world)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return cls(reduce_dtype=reduce_dtype)
        return cls(dist.get_rank(group), dist.get_world_size(group), group, reduce_dtype)


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank owns.

    Attributes:
        q_start, num_q_heads: the rank's query heads ``[q_start, q_start + num_q_heads)``.
        kv_start, num_kv_heads: the rank's KV heads ``[kv_start, kv_start + num_kv_heads)``.
    """

    q_start: int
    num_q_heads: int
    kv_start: int
    num_kv_heads: int


def shard_heads(num_q_heads: int, num_kv_heads: int, tp: TPInfo) -> HeadShard:
    """Split ``num_q_heads`` query and ``num_kv_heads`` KV heads over ``tp.world_size`` ranks.

    Raises:
        ValueError: the heads do not divide (``Hq % n``), or KV heads neither split nor replicate
            evenly (``Hkv % n`` and ``n % Hkv`` both non-zero).

    Example:
        >>> shard_heads(24, 2, TPInfo(rank=3, world_size=4))
        HeadShard(q_start=18, num_q_heads=6, kv_start=1, num_kv_heads=1)
    """
    n, r = tp.world_size, tp.rank
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if num_q_heads % n:
        raise ValueError(f"{num_q_heads} query heads do not split over {n} ranks")
    hq = num_q_heads // n
    if num_kv_heads % n == 0:
        hkv = num_kv_heads // n
        return HeadShard(r * hq, hq, r * hkv, hkv)
    if n % num_kv_heads == 0:
        # Each KV head is replicated on n / Hkv consecutive ranks; their query heads all map to it.
        return HeadShard(r * hq, hq, r * num_kv_heads // n, 1)
    raise ValueError(f"{num_kv_heads} KV heads neither split nor replicate evenly over {n} ranks")


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``tp`` (a no-op at TP1); returns a new tensor of ``x``'s dtype (``x`` is
    left as it is, whatever its dtype and layout)."""
    if tp.world_size == 1:
        return x
    import torch.distributed as dist

    y = torch.empty(x.shape, dtype=tp.reduce_dtype or x.dtype, device=x.device).copy_(x)
    dist.all_reduce(y, group=tp.group)
    return y.to(x.dtype)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_group(rank: int, world_size: int, port: int, *, backend: str = "gloo",
                     reduce_dtype: torch.dtype | None = torch.float32) -> TPInfo:
    """Join a process group of ``world_size`` local processes on ``127.0.0.1:port``.

    With ``backend="nccl"`` rank ``r`` uses ``cuda:r``.
    """
    import torch.distributed as dist

    info = TPInfo(rank, world_size, None, reduce_dtype)  # checked before joining: a bad rank would wait
    port = check_int("port", port, 1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    return info


def destroy() -> None:
    """Leave the process group joined by :func:`init_local_group`."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
