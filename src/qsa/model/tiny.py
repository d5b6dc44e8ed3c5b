"""A tiny decoder built from QSA layers: embedding, N x (RMSNorm, QSA attention, RMSNorm, SwiGLU MLP),
final RMSNorm, LM head. Weights are random from a seed; the point is to run the kernels the way a
serving engine does (chunked prefill, decode, many layers sharing one step's metadata), not to say
anything sensible.

Under tensor parallelism the attention layers shard their heads (see :mod:`qsa.model.tp`); the embedding,
MLPs and LM head are replicated, so every rank computes the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from .functional import rms_norm
from .layer import LayerCache, QSAAttention, QSAConfig, StepMetadata
from .tp import TPInfo
from ..utils import check_int


@dataclass(frozen=True)
class TinyConfig:
    """Sizes of the tiny model.

    Attributes:
        vocab_size: tokens.
        num_layers: QSA layers (each followed by an MLP).
        intermediate_size: MLP width (0: twice the hidden size).
        attn: the QSA layer sizes (its ``hidden_size`` is the model width).
        seed: weight seed (layer ``i`` uses ``seed + 1 + i``).
    """

    vocab_size: int = 1024
    num_layers: int = 2
    intermediate_size: int = 0
    attn: QSAConfig = field(default_factory=QSAConfig)
    seed: int = 0

    def __post_init__(self):
        check_int("vocab_size", self.vocab_size, 1)
        check_int("num_layers", self.num_layers, 0)
        check_int("intermediate_size", self.intermediate_size, 0)
        check_int("seed", self.seed)
        if not isinstance(self.attn, QSAConfig):
            raise TypeError(f"attn must be a QSAConfig, got {type(self.attn).__name__}")

    @property
    def hidden_size(self) -> int:
        return self.attn.hidden_size

    @property
    def mlp_size(self) -> int:
        return self.intermediate_size or 2 * self.hidden_size

    @classmethod
    def reference(cls, **kw) -> "TinyConfig":
        """The reference QSA layer shape (hidden 2560, 24/2 heads, D 256, index 4 x 128, top-512)."""
        return cls(**kw)

    @classmethod
    def small(cls, **kw) -> "TinyConfig":
        """CPU-sized: hidden 256, 8/2 heads of 64, index 4 x 64, top-16 blocks (sparse from 64 tokens)."""
        attn = QSAConfig(hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=32,
                         index_heads=4, index_head_dim=64, index_rotary_dim=32, index_topk=16,
                         rope_theta=10000.0)
        return cls(vocab_size=512, attn=attn, **kw)

    def with_attn(self, **kw) -> "TinyConfig":
        return replace(self, attn=replace(self.attn, **kw))


class MLP(nn.Module):
    """SwiGLU MLP (replicated under tensor parallelism)."""

    def __init__(self, hidden: int, inner: int, *, gen: torch.Generator, dtype, device):
        super().__init__()
        w_up = torch.randn((2 * inner, hidden), generator=gen) * hidden ** -0.5
        w_down = torch.randn((hidden, inner), generator=gen) * inner ** -0.5
        self.gate_up = nn.Parameter(w_up.to(device=device, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(w_down.to(device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, self.down)


class TinyQSAModel(nn.Module):
    """Embedding, ``num_layers`` x (QSA attention + MLP) with pre-norms and residuals, LM head.

    Args:
        config: sizes and seed.
        tp: tensor-parallel position (attention heads are sharded, the rest replicated).
        device: where the weights live (None: torch's current default device, as for torch's factories).
    """

    def __init__(self, config: TinyConfig = TinyConfig(), *, tp: TPInfo | None = None, device=None):
        super().__init__()
        device = torch.get_default_device() if device is None else torch.device(device)
        self.config = c = config
        dtype, H = c.attn.dtype, c.hidden_size
        gen = torch.Generator().manual_seed(c.seed)
        self.embed = nn.Parameter((torch.randn((c.vocab_size, H), generator=gen)).to(device=device, dtype=dtype),
                                  requires_grad=False)
        self.layers = nn.ModuleList(QSAAttention(c.attn, tp=tp, seed=c.seed + 1 + i, device=device)
                                    for i in range(c.num_layers))
        self.mlps = nn.ModuleList(MLP(H, c.mlp_size, gen=gen, dtype=dtype, device=device)
                                  for _ in range(c.num_layers))
        norms = torch.randn((2 * c.num_layers + 1, H), generator=gen) * 0.1
        self.norms = nn.Parameter(norms.to(device=device, dtype=dtype), requires_grad=False)
        head = torch.randn((c.vocab_size, H), generator=gen) * H ** -0.5
        self.lm_head = nn.Parameter(head.to(device=device, dtype=dtype), requires_grad=False)

    def allocate_caches(self, num_blocks: int, block_size: int, num_reqs: int, *, fill: str | None = "nan",
                        device=None) -> list[LayerCache]:
        """One :class:`~qsa.model.layer.LayerCache` per layer."""
        return [layer.allocate_cache(num_blocks, block_size, num_reqs, fill=fill, device=device)
                for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata, caches: list[LayerCache], *,
                logit_rows: torch.Tensor | None = None, capture_layer: int | None = None,
                capture: dict | None = None) -> torch.Tensor:
        """One step: ``input_ids`` ``[T]`` -> fp32 logits ``[len(logit_rows), vocab]`` (default: all rows).

        ``capture_layer``/``capture``: that layer's intermediates go into ``capture`` (see
        :meth:`qsa.model.layer.QSAAttention.forward`).
        """
        if len(caches) != len(self.layers):
            raise ValueError(f"caches must hold one LayerCache per layer ({len(self.layers)}), got {len(caches)}")
        eps = self.config.attn.rms_norm_eps
        h = F.embedding(input_ids, self.embed)
        for i, (attn, mlp) in enumerate(zip(self.layers, self.mlps)):
            cap = capture if i == capture_layer else None
            h = h + attn(rms_norm(h, self.norms[2 * i], eps), meta, caches[i], capture=cap)
            h = h + mlp(rms_norm(h, self.norms[2 * i + 1], eps))
        if logit_rows is not None:
            h = h[logit_rows]
        return F.linear(rms_norm(h, self.norms[-1], eps), self.lm_head).float()
