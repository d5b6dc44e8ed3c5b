"""The QSA layer's reference: one layer over whole sequences in plain PyTorch, given each row's
selection, in fp64 (ground truth) or the activation dtype (what plain PyTorch gets)."""

from __future__ import annotations

import torch

from .functional import apply_rope, rms_norm, rope_cos_sin
from .layer import QSAAttention



def layer_reference(layer: QSAAttention, x: torch.Tensor, req_lens: list[int], indices: torch.Tensor, *,
                    compute_dtype=torch.float64) -> torch.Tensor:
    """The layer over whole sequences in plain PyTorch, given each row's selection.

    Args:
        layer: the layer whose weights are used (this rank's shard, no all-reduce).
        x: ``[sum(req_lens), hidden]`` inputs of every token of every request, request after request,
            positions ``0 .. len - 1``.
        req_lens: tokens of each request.
        indices: ``[sum(req_lens), W]`` the tokens each row attends (as the layer selected them).
        compute_dtype: float64 for ground truth, or the activation dtype for "what plain PyTorch gets".

    Returns:
        ``[sum(req_lens), hidden]`` in ``compute_dtype`` (this rank's partial o_proj product).
    """
    c = layer.config
    D, hq, hkv = c.head_dim, layer.num_q_heads, layer.num_kv_heads
    G = hq // hkv
    W = {n: p.detach().to(device=x.device, dtype=compute_dtype) for n, p in layer.named_parameters()}
    xs = x.to(compute_dtype)
    out = torch.zeros(x.shape[0], c.hidden_size, dtype=compute_dtype, device=x.device)
    start = 0
    for L in req_lens:
        xr = xs[start:start + L]
        pos = torch.arange(L, device=x.device)
        qg = (xr @ W["qg_proj"].T).view(L, hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k = (xr @ W["k_proj"].T).view(L, hkv, D)
        v = (xr @ W["v_proj"].T).view(L, hkv, D)
        cos, sin = rope_cos_sin(pos, c.rotary_dim, c.rope_theta)
        q = apply_rope(rms_norm(q, W["q_norm"], c.rms_norm_eps), cos, sin)
        k = apply_rope(rms_norm(k, W["k_norm"], c.rms_norm_eps), cos, sin)
        for i in range(L):
            toks = sorted({t for t in indices[start + i].tolist() if 0 <= t <= i})
            if not toks:
                continue
            kk = k[toks].permute(1, 0, 2)  # [Hkv, n, D]
            vv = v[toks].permute(1, 0, 2)
            s = torch.matmul(q[i].view(hkv, G, D), kk.transpose(1, 2)) * D ** -0.5
            a = torch.matmul(torch.softmax(s.float() if compute_dtype != torch.float64 else s, -1)
                             .to(compute_dtype), vv).reshape(hq, D)
            if compute_dtype == torch.float64:
                a = a * torch.sigmoid(gate[i])
            else:
                a = (a.float() * torch.sigmoid(gate[i].float())).to(compute_dtype)
            out[start + i] = a.reshape(-1) @ W["o_proj"].T
        start += L
    return out
