"""The math pieces of the QSA layer in plain PyTorch: RMSNorm, partial NeoX RoPE, and the index-key
transform the selection applies to compressed keys (docs/spec.md sections 1-2). ``torch.compile``
fuses them; the layer, its reference and the ``qsa::update_compressed_keys`` op share them."""

from __future__ import annotations

import torch

from ..selection.reference import norm_rope_keys


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with a zero-centred weight: ``x / rms(x) * (1 + weight)``, in fp32,
    returned in ``x``'s dtype."""
    xf = x.to(_math_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (1.0 + weight.to(xf.dtype))
    return y.to(x.dtype)


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for low-precision inputs, fp64 stays fp64 (the reference)."""
    return torch.promote_types(x.dtype, torch.float32)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float):
    """fp32 ``cos, sin`` ``[T, rotary_dim // 2]`` of NeoX RoPE; negative (padding) positions use 0."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=positions.device) / rotary_dim))
    angles = positions.clamp(min=0).to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(angles), torch.sin(angles)


def group_start_rope(positions: torch.Tensor, rotary_dim: int, theta: float):
    """:func:`rope_cos_sin` at each row's 4-token group start ``4 * (positions // 4)``: the RoPE of the
    compressed key the row feeds."""
    return rope_cos_sin(torch.div(positions, 4, rounding_mode="floor") * 4, rotary_dim, theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial NeoX RoPE of ``x`` ``[T, ..., D]``: its first ``2 * cos.shape[-1]`` dims are rotated as
    two halves, the rest pass through. Math in fp32, result in ``x``'s dtype."""
    half = cos.shape[-1]
    if half == 0:
        return x
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    xf = x.to(_math_dtype(x))
    c, s = cos.view(shape).to(xf.dtype), sin.view(shape).to(xf.dtype)
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).to(x.dtype)


def index_key_transform(norm_weight: torch.Tensor | None, eps: float, rotary_dim: int, theta: float):
    """The compressed-key transform: RMSNorm (``weight + 1``, the mean of squares summed in fp64) then
    RoPE at position ``4 * block`` (:func:`qsa.selection.reference.norm_rope_keys`).

    Returns ``f(kc [T, D] fp32, block_idx [T] int64) -> [T, D] fp32`` for
    :func:`qsa.selection.api.update_compressed_keys` (whose Triton path fuses the same math into its store
    when given it as ``norm_rope`` instead).
    """
    def transform(kc: torch.Tensor, block_idx: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(4 * block_idx, rotary_dim, theta) if rotary_dim else (None, None)
        return norm_rope_keys(kc, norm_weight, eps, cos, sin)

    return transform
