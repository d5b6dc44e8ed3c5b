"""Selection (the indexer, docs/spec.md section 2): compressed keys, block scores, exact top-k, token expansion.

The stage picks, for every query row, the ``k`` best 4-token blocks of its request and expands them to
the token list that :func:`qsa.sparse_paged_attention` consumes::

    kc   = mean_fp32(raw_k[4b : 4b + 4])                    (update_compressed_keys, per step)
    s[b] = sum_h relu(q[r, h] . kc[b]) * D**-0.5             (block_scores kernel, fp32)
    top  = exact top-k of s over visible candidate blocks     (topk kernel: threshold search, no sort)
    toks = 4 * top[j // 4] + j % 4, causal tail, -1 padding   (same topk kernel)

``visible(r) = min((pos + 1) // 4, seq_len // 4)``; block ``b`` of request ``req`` is a candidate when
``b < visible(r)`` and ``block_table[req, b // (block_size // 4)]`` is in ``[0, num_blocks)``.
Ordering is total and exact: score descending, ties by lower block index, -0.0 == +0.0, ``+-inf`` as
numbers, NaN (all equal) below every number. ``docs/selection.md`` derives the kernels and states what
is bitwise: top-k and expansion always; scores to fp32 rounding (bitwise when dot products are exact).

Everything runs on the device without host synchronisation and with fixed output shapes, so the
stage can be captured in a CUDA graph and replayed with new queries, keys, tables and lengths.
"""

from __future__ import annotations

import torch
import triton

from .. import backend as backends
from .. import settings
from ..attention import replay
from ..utils import (INT32_MAX, as_finite_float, check_bool, check_int, check_tensor, device_facts, dot_in_fp32,
                     interpreter_enabled, next_pow2, overlaps_itself, round_up, type_name)
from .kernels import (assemble_groups_kernel, block_scores_kernel, clear_invalid_pages_kernel, finish_groups_kernel,
                      store_compressed_kernel)
from .reference import GROUP, norm_rope_keys
from .topk import topk_kernel

MAX_K = 2048
"""Largest ``k`` accepted (blocks per row)."""

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

__all__ = [
    "MAX_K",
    "CompressedKeyCache",
    "block_scores",
    "select_tokens",
    "tokens_from_scores",
    "topk_blocks",
    "update_compressed_keys",
]




def _check_device(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cuda" and not interpreter_enabled():
        raise ValueError(f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1 for the CPU "
                         f"interpreter), got {t.device}")


def _check_same_device(ref_name: str, ref: torch.Tensor, **tensors) -> None:
    for name, t in tensors.items():
        if t.device != ref.device:
            raise ValueError(f"{name} must be on {ref.device} like {ref_name}, got {t.device}")


def check_index_dim(name: str, D: int) -> None:
    """``D`` is an index key width the selection kernels take: a power of two >= 16."""
    if D < 16 or D & (D - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (the index kernels' key widths), got {D}")


def _check_k(k) -> int:
    k = check_int("k", k)
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
    return k


def _check_rows(token_to_req, positions, rows=None) -> int:
    check_tensor("token_to_req", token_to_req, ndim=1, dtypes=_INDEX_DTYPES, what="[rows]")
    rows = token_to_req.shape[0] if rows is None else rows
    check_tensor("token_to_req", token_to_req, shape=(rows,), what="[rows]")
    check_tensor("positions", positions, shape=(rows,), dtypes=_INDEX_DTYPES, what="[rows]")
    _check_same_device("token_to_req", token_to_req, positions=positions)
    return rows


def _check_seq_lens(seq_lens, token_to_req, num_reqs=None) -> None:
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=_INDEX_DTYPES, what="[num_reqs]")
    if num_reqs is not None:
        check_tensor("seq_lens", seq_lens, shape=(num_reqs,), what="[num_reqs]")
    _check_same_device("token_to_req", token_to_req, seq_lens=seq_lens)


def _check_transform(transform) -> None:
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be callable or None, got {type_name(transform)}")


def _check_block_size(block_size, kc_cache) -> int:
    """``block_size`` (the main KV cache's tokens per block) is a positive multiple of 4 and ``kc_cache``
    (a checked 3-D tensor) has its ``block_size // 4`` rows per block."""
    block_size = check_int("block_size", block_size)
    if block_size <= 0 or block_size % GROUP:
        raise ValueError(f"block_size (the main KV cache's tokens per block) must be a positive multiple of 4, "
                         f"got {block_size}")
    if kc_cache.shape[1] != block_size // GROUP:
        raise ValueError(f"kc_cache must have block_size // 4 = {block_size // GROUP} rows per block "
                         f"(block_size={block_size}), got shape {tuple(kc_cache.shape)}")
    return block_size


def _check_cache(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *, block_size,
                 triton: bool = True):
    check_tensor("index_q", index_q, ndim=3, dtypes=_FLOAT_DTYPES, what="[rows, H_idx, D]")
    rows, H, D = index_q.shape
    check_tensor("kc_cache", kc_cache, ndim=3, dtypes=(index_q.dtype,),
                 what="[num_blocks, block_size // 4, D] with index_q's dtype")
    check_tensor("kc_cache", kc_cache, shape=(None, None, D), what="[num_blocks, block_size // 4, D]")
    _check_block_size(block_size, kc_cache)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), what="[num_reqs, max_blocks]")
    _check_rows(token_to_req, positions, rows)
    _check_seq_lens(seq_lens, token_to_req, block_table.shape[0])
    check_index_dim("index_q head width D", D)
    if H < 1:
        raise ValueError(f"index_q must have at least one head, got shape {tuple(index_q.shape)}")
    _check_same_device("index_q", index_q, kc_cache=kc_cache, block_table=block_table,
                       token_to_req=token_to_req)
    if triton:
        _check_device(index_q, "index_q")
    return rows, H, D




def _score_config(n_cols: int, dtype: torch.dtype) -> dict:
    """Tiles of the score kernel: BLOCK_R rows x all heads against BLOCK_N compressed keys, each
    program sweeping ``n_per_prog`` blocks (a multiple of BLOCK_N). The bf16/fp16 tile was the
    fastest of a sweep on an H200 (8192 rows x 16384 blocks: 0.68 ms, 126 registers, 72 KiB shared
    memory); fp32 operands take the exact (non-tf32) FMA path and a smaller tile."""
    if interpreter_enabled():
        return dict(BLOCK_R=16, BLOCK_N=16, n_per_prog=max(round_up(n_cols, 16), 16), num_warps=4,
                    num_stages=1)
    return dict(settings.SELECT_SCORE_TILE_FP32 if dtype == torch.float32 else settings.SELECT_SCORE_TILE)


def _launch_scores(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, out, *,
                   write_keys: bool, config: dict | None = None) -> None:
    rows, H, D = index_q.shape
    num_reqs, max_blocks = block_table.shape
    rpb = kc_cache.shape[1]
    n_cols = max_blocks * rpb
    if rows == 0 or n_cols == 0:
        return
    cfg = dict(_score_config(n_cols, index_q.dtype), **(config or {}))
    q = index_q if index_q.stride(2) == 1 else index_q.contiguous()
    kc = kc_cache if kc_cache.stride(2) == 1 else kc_cache.contiguous()
    bt = block_table.contiguous()
    n_per_prog = round_up(cfg["n_per_prog"], cfg["BLOCK_N"])
    row_progs = triton.cdiv(rows, cfg["BLOCK_R"])
    if config is None and q.device.type == "cuda":
        # Few rows (decode, MTP): cut the columns finer so the launch still has about two programs per
        # SM (8 decode rows over 2064 columns ran on 2 programs for 0.6 ms). Scores do not depend on it.
        want = triton.cdiv(2 * device_facts(str(q.device))["sm_count"], row_progs)
        n_per_prog = min(n_per_prog, max(cfg["BLOCK_N"], round_up(triton.cdiv(n_cols, want), cfg["BLOCK_N"])))
    grid = (row_progs, triton.cdiv(n_cols, n_per_prog))
    replay.launch(
        block_scores_kernel, grid,
        q, kc, bt, token_to_req.contiguous(), positions.contiguous(), seq_lens.contiguous(), out,
        rows, num_reqs, kc.shape[0], n_cols, n_per_prog, D ** -0.5,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), bt.stride(0), out.stride(0),
        ROWS_PER_PAGE=rpb, H=H, H_PAD=next_pow2(H), D=D, BLOCK_R=cfg["BLOCK_R"], BLOCK_N=cfg["BLOCK_N"],
        WRITE_KEYS=write_keys,
        DOT_FP32=dot_in_fp32(index_q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _launch_clear_invalid(keys, token_to_req, block_table, num_blocks: int, rows_per_page: int) -> None:
    rows, n_cols = keys.shape
    num_reqs, max_blocks = block_table.shape
    if rows == 0 or max_blocks == 0:
        return
    block_r, block_p = (16, 16) if interpreter_enabled() else settings.CLEAR_PAGES_TILE
    grid = (triton.cdiv(rows, block_r), triton.cdiv(max_blocks, block_p))
    replay.launch(
        clear_invalid_pages_kernel, grid,
        keys, token_to_req, block_table, rows, num_reqs, num_blocks, max_blocks, n_cols,
        keys.stride(0), block_table.stride(0), ROWS_PER_PAGE=rows_per_page, BLOCK_R=block_r,
        BLOCK_P=block_p, num_warps=4,
    )


def _topk_config(n_cols: int, width: int) -> dict:
    """One program per row. Measured on an H200 (8192 rows x 16384 blocks, k = 512): 8 warps and
    1024-block emission chunks beat 16 or 32 warps (fewer barrier participants, two programs per SM)."""
    if n_cols <= settings.SELECT_MAX_REGISTER_TILE:
        block_n = max(next_pow2(n_cols), 16)
        cfg = dict(SINGLE_TILE=True, BLOCK_N=block_n, num_warps=4 if block_n <= 2048 else 8)
    else:
        cfg = dict(SINGLE_TILE=False, **settings.SELECT_TOPK_LONG_ROW)
    cfg.update(RADIX_BITS=8, EMIT_BLOCK=min(cfg["BLOCK_N"], settings.SELECT_TOPK_EMIT),
               OUT_BLOCK=min(max(next_pow2(width), 16), 2048))
    if interpreter_enabled():
        cfg["EMIT_BLOCK"] = cfg["BLOCK_N"]
    return cfg


def _launch_topk(src, out, k, *, from_scores, visible=None, token_to_req=None, positions=None,
                 seq_lens=None, config: dict | None = None) -> None:
    """Block mode (``visible`` given): ``out`` is ``[rows, k]``. Token mode: ``out`` is
    ``[rows, 4k + 3]`` and visibility comes from the rows' requests."""
    rows, n_cols = src.shape
    if rows == 0:
        return
    emit_tokens = visible is None
    cfg = dict(_topk_config(n_cols, out.shape[1]), **(config or {}))
    dummy = out
    replay.launch(
        topk_kernel, (rows,),
        src, dummy if emit_tokens else visible,
        token_to_req if emit_tokens else dummy, positions if emit_tokens else dummy,
        seq_lens if emit_tokens else dummy, out,
        n_cols, seq_lens.shape[0] if emit_tokens else 0, k, src.stride(0), out.stride(0),
        FROM_SCORES=from_scores, EMIT_TOKENS=emit_tokens, SINGLE_TILE=cfg["SINGLE_TILE"],
        BLOCK_N=cfg["BLOCK_N"], RADIX_BITS=cfg["RADIX_BITS"], EMIT_BLOCK=cfg["EMIT_BLOCK"],
        OUT_BLOCK=cfg["OUT_BLOCK"], num_warps=cfg["num_warps"],
    )


def _row_major(scores):
    return scores if scores.stride(1) == 1 or scores.shape[1] <= 1 else scores.contiguous()




def block_scores(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *, block_size: int):
    """Block scores of every row over its request's compressed keys.

    Args:
        index_q: ``[rows, H_idx, D]`` fp16/bf16/fp32 index queries (D a power of two, 128 in QSA).
        kc_cache: ``[num_blocks, block_size // 4, D]`` compressed-key cache, ``index_q``'s dtype.
            Logical block ``b`` of request ``req`` is row ``b % (block_size // 4)`` of physical block
            ``block_table[req, b // (block_size // 4)]``.
        block_table: ``[num_reqs, max_blocks]`` int32, shared with the main KV cache.
        token_to_req: ``[rows]`` int32/int64 request of each row.
        positions: ``[rows]`` int64/int32 logical position of each row (-1: padding).
        seq_lens: ``[num_reqs]`` int32/int64.
        block_size: the main KV cache's tokens per block (a positive multiple of 4); ``kc_cache`` must
            have ``block_size // 4`` rows per block (ValueError otherwise).

    Returns:
        ``[rows, max_blocks * (block_size // 4)]`` fp32: ``sum_h relu(q[r,h] . kc[b]) * D**-0.5`` for
        candidate blocks, ``-inf`` elsewhere (a real score is never -inf: it is >= 0, +inf or NaN).
        Dot products accumulate in fp32 (bf16/fp16 operands on tensor cores).
    """
    rows, _, _ = _check_cache(index_q, kc_cache, block_table, token_to_req, positions, seq_lens,
                              block_size=block_size)
    n_cols = block_table.shape[1] * kc_cache.shape[1]
    out = torch.empty(rows, n_cols, dtype=torch.float32, device=index_q.device)
    _launch_scores(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, out,
                   write_keys=False)
    return out


def topk_blocks(scores, visible, k: int):
    """Exact top-k blocks of each row, in ascending block order.

    Args:
        scores: ``[rows, n]`` fp32 (fp16/bf16 are compared after an exact upcast).
        visible: ``[rows]`` int32/int64; row ``r`` chooses among blocks ``b < min(visible[r], n)``
            (negative counts as 0).
        k: blocks per row, ``1 <= k <= 2048`` (512 in QSA).

    Returns:
        ``[rows, k]`` int32: the ``min(k, limit)`` best blocks by score descending, ties by lower
        index, -0.0 == +0.0, infinities as numbers, NaN below every number; sorted ascending and
        padded with -1. With ``limit <= k`` that is ``0 .. limit - 1``. A row's result depends on
        that row alone; no host synchronisation.

    Example::

        >>> s = torch.tensor([[0.5, 2.0, 2.0, float("nan"), 1.0]], device="cuda")
        >>> qsa.topk_blocks(s, torch.tensor([5], device="cuda"), 2)
        tensor([[1, 2]], device='cuda:0', dtype=torch.int32)
    """
    k = _check_k(k)
    check_tensor("scores", scores, ndim=2, dtypes=_FLOAT_DTYPES, what="[rows, n]")
    check_tensor("visible", visible, shape=(scores.shape[0],), dtypes=_INDEX_DTYPES, what="[rows]")
    _check_same_device("scores", scores, visible=visible)
    _check_device(scores, "scores")
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    _launch_topk(_row_major(scores), out, k, from_scores=True, visible=visible.contiguous())
    return out


def tokens_from_scores(scores, token_to_req, positions, seq_lens, *, k: int = 512):
    """Top-k plus expansion on given scores: the token selection of :func:`select_tokens` with every
    block ``b < min(visible(r), n)`` a candidate.

    Args:
        scores: ``[rows, n]`` fp32/fp16/bf16 block scores.
        token_to_req, positions: ``[rows]`` int32/int64; seq_lens: ``[num_reqs]`` int32/int64.
        k: blocks per row, ``1 <= k <= 2048``.

    Returns:
        ``[rows, 4k + 3]`` int32 (see :func:`select_tokens`).
    """
    k = _check_k(k)
    check_tensor("scores", scores, ndim=2, dtypes=_FLOAT_DTYPES, what="[rows, n]")
    _check_rows(token_to_req, positions, scores.shape[0])
    _check_seq_lens(seq_lens, token_to_req)
    _check_same_device("scores", scores, token_to_req=token_to_req)
    _check_device(scores, "scores")
    out = torch.empty(scores.shape[0], 4 * k + 3, dtype=torch.int32, device=scores.device)
    _launch_topk(_row_major(scores), out, k, from_scores=True, token_to_req=token_to_req.contiguous(),
                 positions=positions.contiguous(), seq_lens=seq_lens.contiguous())
    return out


def select_tokens(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                  k: int = 512, out=None, backend: str | None = None):
    """The whole selection stage in one call: scores, exact top-k, expansion to tokens.

    Args:
        index_q: ``[rows, H_idx, D]`` fp16/bf16/fp32 index queries (QSA: H_idx = 4, D = 128).
        kc_cache: ``[num_blocks, block_size // 4, D]`` compressed keys, ``index_q``'s dtype.
        block_table: ``[num_reqs, max_blocks]`` int32 (the main KV cache's table).
        token_to_req: ``[rows]`` int32/int64; positions: ``[rows]`` int64/int32 (-1: padding);
        seq_lens: ``[num_reqs]`` int32/int64.
        block_size: the main KV cache's tokens per block (a positive multiple of 4); ``kc_cache`` must
            have ``block_size // 4`` rows per block (ValueError otherwise: the geometry is never inferred
            from ``kc_cache``).
        k: blocks per row, ``1 <= k <= 2048`` (512 in QSA).
        out: optional ``[rows, 4k + 3]`` int32 output.
        backend: "triton", or "torch" (:func:`_select_tokens_torch`: the same contract in PyTorch,
            with host synchronisation); default: Triton wherever it can run.

    Returns:
        ``[rows, 4k + 3]`` int32 tokens, ready for ``sparse_paged_attention``'s ``indices``: for
        the chosen blocks (the ``k`` best candidates, ascending) ``4b, 4b+1, 4b+2, 4b+3``; then the
        causal tail ``((pos + 1) // 4) * 4 .. pos`` (tokens ``>= seq_len`` become -1); then -1.
        Padding rows (invalid request or ``pos < 0``) are all -1. Blocks whose table entry is
        invalid are not candidates.

    Example::

        >>> idx = qsa.select_tokens(index_q, kc_cache, block_table, token_to_req, positions, seq_lens,
        ...                         block_size=16)
        >>> out = qsa.sparse_paged_attention(q, k_cache, v_cache, idx, block_table, token_to_req,
        ...                                  positions, seq_lens)

    With ``settings.REPLAY_STEPS`` on a GPU, the first Triton call of a fingerprint (every tensor's shape,
    strides, dtype and device, ``k``, ``block_size``, the backend, the stream, the settings) records its
    launches (scores, invalid pages, top-k), and later calls with that fingerprint replay them with their own pointers
    (:mod:`qsa.attention.replay`): the checks and the binding are not repeated. A recorded step keeps its
    score-key scratch (``rows x max_blocks * block_size // 4`` int32), so calls on one stream reuse it in
    order; a call whose scratch is over ``settings.REPLAY_MAX_SCRATCH_BYTES`` is never recorded.
    """
    if type(index_q) is torch.Tensor and type(k) is int and type(block_size) is int \
            and (ctx := replay.context_of(index_q)) is not None:
        stream, env = ctx
        try:
            key = (k, block_size, backends.resolve_backend(backend, index_q.device), stream,
                   replay.tensor_key(index_q), replay.tensor_key(kc_cache), replay.tensor_key(block_table),
                   replay.tensor_key(token_to_req), replay.tensor_key(positions), replay.tensor_key(seq_lens),
                   replay.tensor_key(out))
        except (AttributeError, TypeError, ValueError):  # not tensors, or a backend that cannot run
            key = None
        if key is not None and key[2] == "triton":  # the PyTorch path is never recorded
            entry = _SELECTIONS.get(key, env)
            if entry is _SELECTIONS:
                return _select_tokens_recorded(key, stream, index_q, kc_cache, block_table, token_to_req,
                                               positions, seq_lens, block_size, k, out, backend)
            if entry is not None:
                o = torch.empty(index_q.shape[0], 4 * k + 3, dtype=torch.int32, device=index_q.device) \
                    if out is None else out
                if _SELECTIONS.serve(entry, dict(index_q=index_q, kc_cache=kc_cache, block_table=block_table,
                                                 token_to_req=token_to_req, positions=positions, seq_lens=seq_lens,
                                                 out=o), stream):
                    return o
    return _select_tokens_full(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, block_size, k,
                               out, backend)


_SELECTIONS = replay.ReplayCache()
"""select_tokens' recorded steps, by call fingerprint (each owns its score-key scratch)."""


def _select_tokens_recorded(key, stream, index_q, kc_cache, block_table, token_to_req, positions, seq_lens,
                            block_size, k, out, backend):
    """The first call of fingerprint ``key``: the full path under a recorder, its launches cached as a
    replay (None where they cannot be replayed or the scratch is over the cap)."""
    with replay.Recorder() as rec:
        result = _select_tokens_full(index_q, kc_cache, block_table, token_to_req, positions, seq_lens,
                                     block_size, k, out, backend)
    inputs = dict(index_q=index_q, kc_cache=kc_cache, block_table=block_table, token_to_req=token_to_req,
                  positions=positions, seq_lens=seq_lens, out=result)
    if replay.shares_pointers(inputs):  # served unrecorded; the fingerprint stays open to distinct tensors
        return result
    step = None
    if sum(t.numel() * t.element_size() for t in rec.owned) <= settings.REPLAY_MAX_SCRATCH_BYTES:
        step = replay.replay_of(rec, inputs, [], index_q.device, stream)
    _SELECTIONS.put(key, step)
    return result


def _select_tokens_full(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, block_size, k, out,
                        backend):
    """select_tokens' full path: every check, then the PyTorch path or the three launches."""
    k = _check_k(k)
    rows, _, _ = _check_cache(index_q, kc_cache, block_table, token_to_req, positions, seq_lens,
                              block_size=block_size, triton=False)
    backend = backends.resolve_backend(backend, index_q.device)
    if backend == "triton":
        _check_device(index_q, "index_q")
    width = 4 * k + 3
    if out is None:
        out = torch.empty(rows, width, dtype=torch.int32, device=index_q.device)
    else:
        check_tensor("out", out, shape=(rows, width), dtypes=(torch.int32,), what="[rows, 4k + 3]")
        _check_same_device("index_q", index_q, out=out)
        if out.stride(1) != 1:
            raise ValueError("out must have a contiguous last dimension")
        if overlaps_itself(out):
            raise ValueError(f"out must not have elements that share memory, got strides {tuple(out.stride())}")
    if backend == "torch":
        out.copy_(_select_tokens_torch(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, k=k))
        return out
    n_cols = block_table.shape[1] * kc_cache.shape[1]
    keys = replay.owned(torch.empty(rows, n_cols, dtype=torch.int32, device=index_q.device))
    token_to_req, positions, seq_lens = (t.contiguous() for t in (token_to_req, positions, seq_lens))
    _launch_scores(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, keys,
                   write_keys=True)
    _launch_clear_invalid(keys, token_to_req, block_table.contiguous(), kc_cache.shape[0],
                          kc_cache.shape[1])
    _launch_topk(keys, out, k, from_scores=False, token_to_req=token_to_req, positions=positions,
                 seq_lens=seq_lens)
    return out




def _select_tokens_torch(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *,
                        k: int = 512) -> torch.Tensor:
    """:func:`select_tokens` in PyTorch (fp32 scores, exact top-k, expansion).

    Candidates of row ``r``: blocks ``b < min((pos + 1) // 4, seq_len // 4)`` whose table entry is
    valid. Order: score descending, ties by lower block index, -0.0 == +0.0, NaN below every number
    (a stable sort). Output as :func:`select_tokens`. Synchronises with the host.
    """
    rows, H, D = index_q.shape
    num_reqs, max_blocks = block_table.shape
    num_blocks, rows_per_page = kc_cache.shape[:2]
    n = max_blocks * rows_per_page
    dev = index_q.device
    if num_reqs == 0:  # every row is a padding row
        return torch.full((rows, 4 * k + 3), -1, dtype=torch.int32, device=dev)
    req = token_to_req.to(torch.int64)
    pos = positions.to(torch.int64).clamp(max=INT32_MAX)  # past it, the same tokens; no overflow of pos + 1
    row_ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req_c = torch.where(row_ok, req, 0)
    seq = seq_lens.to(torch.int64)[req_c]
    vis = torch.where(row_ok, torch.minimum((pos + 1) // GROUP, seq // GROUP), 0).clamp(0, n)

    pages = block_table.to(torch.int64)
    page_ok = (pages >= 0) & (pages < num_blocks)
    if num_blocks == 0:  # no valid page, no candidate: only the causal tails remain
        keys = torch.zeros(num_reqs, n, D, dtype=torch.float32, device=dev)
    else:
        keys = kc_cache[pages.clamp(0, num_blocks - 1)].reshape(num_reqs, n, D).float()
    cand = (torch.arange(n, device=dev)[None, :] < vis[:, None]) & \
        page_ok.repeat_interleave(rows_per_page, 1)[req_c]
    scores = torch.zeros(rows, n, dtype=torch.float32, device=dev)
    for r in torch.unique(req_c[row_ok]).tolist():
        sel = (req_c == r) & row_ok
        dots = torch.matmul(index_q[sel].float(), keys[r].T)  # [rows_r, H, n]
        scores[sel] = torch.relu(dots).sum(1) * (D ** -0.5)
    key = torch.where(torch.isnan(scores), -1.0, scores + 0.0)  # real scores are >= 0 or +inf
    key = torch.where(cand, key, float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    taken = torch.minimum(cand.sum(1), torch.tensor(k, device=dev))
    o_k = torch.arange(order.shape[1], device=dev)
    blocks = torch.where(o_k[None, :] < taken[:, None], order, n + 1)
    blocks = torch.sort(blocks, dim=1).values
    blocks = torch.nn.functional.pad(blocks, (0, k - blocks.shape[1]), value=n + 1)

    j = torch.arange(4 * k + 3, device=dev)[None, :]
    toks = (GROUP * blocks[:, :, None] + torch.arange(GROUP, device=dev)).reshape(rows, 4 * k)
    toks = torch.nn.functional.pad(toks, (0, 3))
    tail = ((pos + 1) // GROUP * GROUP)[:, None] + (j - GROUP * taken[:, None])
    out = torch.where(j < GROUP * taken[:, None], toks, torch.where(tail <= pos[:, None], tail, -1))
    out = torch.where((out >= 0) & (out < seq[:, None]) & row_ok[:, None], out, -1)
    return out.to(torch.int32)


def update_compressed_keys(raw_k, token_to_req, positions, kc_cache, block_table, partial, *, block_size: int,
                           next_pos=None, refusals=None, transform=None, norm_rope=None, backend: str | None = None,
                           rows_ordered: bool = False) -> None:
    """Write the compressed key of every 4-token group that completes in this step.

    The step's rows may come in any order: requests interleaved, a request's positions in any order. The
    rows are first sorted by (request, position) on the device (``torch.sort``, no host synchronisation)
    and everything is done in that order, so any order of the same rows writes the same bits. Of several
    rows with the same (request, position), the last one in the batch is used and the others are ignored
    (last wins). Rows with an invalid request or a negative position are padding and ignored.

    The group ``4b .. 4b + 3`` of a request is written when this step holds its closing row (position
    ``4b + 3``) and each earlier member is available: from this step's row of that position when there is
    one, else from the request's open group in ``partial``. The last row of each request, when its group
    stays open, saves that group's members so far into ``partial`` for the next step.

    What ``partial`` holds:

    * with ``next_pos`` (as :class:`CompressedKeyCache` passes it): ``next_pos[req] = e`` says that
      ``partial[req]`` holds positions ``4 * (e // 4) .. e - 1`` (none when ``e`` is -1). A row whose
      earlier members ``4 * (p // 4) .. p - 1`` are neither in this step nor held is *refused*: nothing of its
      group is written (neither the key nor ``partial``), so no key is ever built from stale data. After
      the step, ``next_pos[req] = P + 1`` for the request's largest position ``P`` of the step, or -1 when
      ``P``'s group stays open with a member missing. A row at a multiple of 4 needs nothing earlier (a
      request's first step, a prefix-cache hit of whole groups); a request slot given to a new request
      starts again from ``next_pos = 0`` (:meth:`CompressedKeyCache.reset`).
    * without ``next_pos``: ``partial`` is trusted to hold every earlier member that is not in this step
      (the caller feeds each request's positions in order, starting at a multiple of 4).

    Refused rows, with ``backend="torch"`` or tensors on the CPU: a ValueError naming the request and the
    position, raised at once, before anything is written. With the Triton kernels on a GPU (no host
    synchronisation): the refused rows' groups are skipped and, when ``refusals`` is given, counted there;
    :meth:`CompressedKeyCache.check` turns the count into that ValueError.

    Args:
        raw_k: ``[T, D]`` raw index keys of this step's tokens (any float dtype).
        token_to_req: ``[T]`` int32/int64; positions: ``[T]`` int64/int32 (-1: padding, ignored).
        kc_cache: ``[num_blocks, block_size // 4, D]`` fp16/bf16/fp32, written in place at row
            ``b % (block_size // 4)`` of ``block_table[req, b // (block_size // 4)]`` (skipped when
            that entry is invalid).
        block_table: ``[num_reqs, max_blocks]`` int32.
        partial: ``[num_reqs, 3, D]`` fp32, contiguous; slot ``j`` holds the raw key at position
            ``4 * (p // 4) + j`` of the request's open group. Updated in place.
        block_size: the main KV cache's tokens per block (a positive multiple of 4); ``kc_cache`` must
            have ``block_size // 4`` rows per block.
        next_pos: optional ``[num_reqs]`` int64, contiguous: each request's next expected position (see
            above; start at 0). Updated in place.
        refusals: optional ``[3]`` int64, contiguous: the number of refused rows, then the request and
            position of the first refusal recorded (the lowest (request, position) of its step). Updated in
            place by the GPU kernel path.
        transform: optional ``f(kc [T, D] fp32, block_idx [T] int64) -> [T, D]`` applied to the fp32
            means before the cast (RMSNorm, RoPE at position ``4 * block_idx``). It sees one row per
            token, in (request, position) order; only rows of tokens closing a group (``p % 4 == 3``) are
            stored, so it must be row-wise and tolerate arbitrary values in the other rows.
        norm_rope: optional ``(weight, eps, cos, sin)``, the layer's transform given by its parts instead
            of ``transform`` (not both): :func:`qsa.selection.reference.norm_rope_keys` of the means, with
            ``weight`` ``[D]`` (any float dtype) or None, ``eps`` a finite float >= 0, and ``cos, sin``
            ``[T, half]`` fp32 (``2 * half <= D``, last dim contiguous) of each batch row's group start
            ``4 * (positions[i] // 4)``, or both None for no rotation. The Triton path computes it inside
            its store, for the closing rows only, with no PyTorch op; the same bits as the PyTorch path
            (see ``norm_rope_keys``).
        backend: "triton" (the kernels), or "torch" (the same stores in PyTorch, with a host
            synchronisation); default: Triton wherever it can run.
        rows_ordered: the caller's promise that the rows already come in the order the sorts would give
            them: ``(token_to_req[i], positions[i])`` non-decreasing in ``i``, by request and then by
            position (a decode or prefill batch of requests in slot order, with no padding row: padding
            rows come last, after larger requests). The sorts are then skipped and every bit is the
            same; a batch that breaks the promise may build wrong keys (never a read out of bounds).
            :meth:`qsa.model.layer.StepMetadata.build` works it out on the host.

    ``kc[b] = (((k[4b] + k[4b+1]) + k[4b+2]) + k[4b+3]) * 0.25`` in fp32, the same for any chunking and
    any order of the rows. The Triton path runs on the device with no host synchronisation (on the CPU
    interpreter it checks for refusals on the host).

    With ``settings.REPLAY_STEPS`` on a GPU, a Triton call with ``rows_ordered`` and no ``transform`` records
    its launches the first time its fingerprint is seen (every tensor's shape, strides, dtype and device,
    ``eps``, ``block_size``, the stream, the settings) and later calls replay them with their own pointers
    (:mod:`qsa.attention.replay`): the checks and the binding are not repeated. Calls that sort, or that
    run a ``transform`` callable, take the full path every time.
    """
    if rows_ordered is True and transform is None and type(raw_k) is torch.Tensor and type(block_size) is int \
            and (norm_rope is None or (type(norm_rope) is tuple and len(norm_rope) == 4
                                       and type(norm_rope[1]) in replay.PLAIN)) \
            and (ctx := replay.context_of(raw_k)) is not None \
            and (next_pos is None or not _refuses_at_once("triton", raw_k.device)):
        stream, env = ctx
        weight, eps, cos, sin = (None, None, None, None) if norm_rope is None else norm_rope
        try:
            key = (block_size, backends.resolve_backend(backend, raw_k.device), stream, norm_rope is None, eps,
                   replay.tensor_key(raw_k), replay.tensor_key(token_to_req), replay.tensor_key(positions),
                   replay.tensor_key(kc_cache), replay.tensor_key(block_table), replay.tensor_key(partial),
                   replay.tensor_key(next_pos), replay.tensor_key(refusals), replay.tensor_key(weight),
                   replay.tensor_key(cos), replay.tensor_key(sin))
        except (AttributeError, TypeError, ValueError):  # not tensors, or a backend that cannot run
            key = None
        if key is not None and key[1] == "triton":  # the PyTorch path is never recorded
            inputs = dict(raw_k=raw_k, token_to_req=token_to_req, positions=positions, kc_cache=kc_cache,
                          block_table=block_table, partial=partial, next_pos=next_pos, refusals=refusals,
                          weight=weight, cos=cos, sin=sin)
            entry = _UPDATES.get(key, env)
            if entry is _UPDATES:
                with replay.Recorder() as rec:
                    _update_compressed_keys_full(raw_k, token_to_req, positions, kc_cache, block_table, partial,
                                                 block_size, next_pos, refusals, None, norm_rope, backend, True)
                if not replay.shares_pointers(inputs):  # else served unrecorded, the fingerprint left open
                    _UPDATES.put(key, replay.replay_of(rec, inputs, [], raw_k.device, stream))
                return
            if entry is not None and _UPDATES.serve(entry, inputs, stream):
                return
    _update_compressed_keys_full(raw_k, token_to_req, positions, kc_cache, block_table, partial, block_size,
                                 next_pos, refusals, transform, norm_rope, backend, rows_ordered)


_UPDATES = replay.ReplayCache()
"""update_compressed_keys' recorded steps, by call fingerprint (each owns its group and mean scratch)."""


def _check_norm_rope(norm_rope, T: int, D: int, device) -> tuple:
    """``norm_rope`` checked: ``(weight, eps, cos, sin, half)``."""
    if not isinstance(norm_rope, tuple) or len(norm_rope) != 4:
        raise TypeError(f"norm_rope must be a tuple (weight, eps, cos, sin), got {type_name(norm_rope)}")
    weight, eps, cos, sin = norm_rope
    if weight is not None:
        check_tensor("norm_rope weight", weight, shape=(D,), dtypes=_WEIGHT_DTYPES, device=device,
                     what=f"[D] = [{D}]")
    eps = as_finite_float("norm_rope eps", eps)
    if eps < 0:
        raise ValueError(f"norm_rope eps must be >= 0, got {eps}")
    if (cos is None) != (sin is None):
        raise ValueError("norm_rope cos and sin must both be tensors or both be None")
    half = 0
    if cos is not None:
        check_tensor("norm_rope cos", cos, ndim=2, dtypes=(torch.float32,), device=device, what="[T, half] fp32")
        check_tensor("norm_rope sin", sin, shape=tuple(cos.shape), dtypes=(torch.float32,), device=device,
                     what="[T, half] fp32, the shape of cos")
        half = cos.shape[1]
        if cos.shape[0] != T or 2 * half > D:
            raise ValueError(f"norm_rope cos must be [T, half] with T = {T} and 2 * half <= D = {D}, got "
                             f"{tuple(cos.shape)}")
        for name, t in (("cos", cos), ("sin", sin)):
            if half > 1 and t.stride(1) != 1:
                raise ValueError(f"norm_rope {name} must have its last dim contiguous (stride 1), got strides "
                                 f"{tuple(t.stride())}")
    return weight, eps, cos, sin, half


def _update_compressed_keys_full(raw_k, token_to_req, positions, kc_cache, block_table, partial, block_size,
                                 next_pos, refusals, transform, norm_rope, backend, rows_ordered) -> None:
    """update_compressed_keys' full path: every check, then the PyTorch path or the launches."""
    check_tensor("raw_k", raw_k, ndim=2, dtypes=_FLOAT_DTYPES, what="[T, D]")
    T, D = raw_k.shape
    _check_rows(token_to_req, positions, T)
    check_tensor("kc_cache", kc_cache, shape=(None, None, D), dtypes=_FLOAT_DTYPES,
                 what="[num_blocks, block_size // 4, D]")
    _check_block_size(block_size, kc_cache)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), what="[num_reqs, max_blocks]")
    num_reqs = block_table.shape[0]
    check_tensor("partial", partial, shape=(num_reqs, GROUP - 1, D), dtypes=(torch.float32,),
                 what="[num_reqs, 3, D]")
    if not partial.is_contiguous():
        raise ValueError("partial must be contiguous")
    for name, t, shape, what in (("next_pos", next_pos, (num_reqs,), "[num_reqs] int64"),
                                 ("refusals", refusals, (3,), "[3] int64 (count, request, position)")):
        if t is not None:
            check_tensor(name, t, shape=shape, dtypes=(torch.int64,), what=what)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
    _check_transform(transform)
    if norm_rope is not None:
        if transform is not None:
            raise ValueError("give transform or norm_rope, not both")
        weight, eps, cos, sin, half = _check_norm_rope(norm_rope, T, D, raw_k.device)
    rows_ordered = check_bool("rows_ordered", rows_ordered)
    if kc_cache.stride(2) != 1:
        raise ValueError("kc_cache must have a contiguous last dimension")
    if D < 1 or D & (D - 1):
        raise ValueError(f"raw_k width D must be a power of two >= 1, got {D}")
    extra = {name: t for name, t in (("next_pos", next_pos), ("refusals", refusals)) if t is not None}
    _check_same_device("raw_k", raw_k, token_to_req=token_to_req, positions=positions,
                       kc_cache=kc_cache, block_table=block_table, partial=partial, **extra)
    backend = backends.resolve_backend(backend, raw_k.device)
    if backend == "triton":
        _check_device(raw_k, "raw_k")
    if T == 0 or num_reqs == 0:  # nothing, or only padding rows
        return

    # Stable sorts by position, then by request: the rows of a request adjacent, ascending, duplicates in
    # batch order (the last one wins). Out-of-range requests and negative positions sort anywhere; they
    # are recognised by the assembly and store nothing.
    if rows_ordered:
        perm = None if backend == "triton" else torch.arange(T, dtype=torch.int64, device=raw_k.device)
    else:
        by_pos = torch.sort(positions, stable=True).indices
        perm = by_pos[torch.sort(token_to_req[by_pos], stable=True).indices]
    if backend == "torch":
        grp, mean, rows = _assemble_torch(raw_k, token_to_req, positions, partial, next_pos, perm)
    else:
        raw = raw_k if raw_k.stride(1) == 1 else raw_k.contiguous()
        t2r, pos = token_to_req.contiguous(), positions.contiguous()
        grp = replay.owned(torch.empty(T, GROUP, D, dtype=torch.float32, device=raw_k.device))
        mean = replay.owned(torch.empty(T, D, dtype=torch.float32, device=raw_k.device))
        # block, request, position, flags of each sorted row
        rows = [replay.owned(r) for r in torch.empty(4, T, dtype=torch.int64, device=raw_k.device)]
        ordered = perm is None
        replay.launch(
            assemble_groups_kernel, (T,),
            raw, t2r if ordered else perm, t2r, pos, partial, partial if next_pos is None else next_pos, grp,
            mean, rows[0], rows[1], rows[2], rows[3], T, num_reqs, raw.stride(0), D=D,
            TRACK=next_pos is not None, ORDERED=ordered,
        )
    if next_pos is not None and _refuses_at_once(backend, raw_k.device):
        _raise_first_refusal(rows[3], perm, token_to_req, positions, next_pos)
    kc_new = mean
    if transform is not None:
        kc_new = transform(mean, rows[0])
        if not isinstance(kc_new, torch.Tensor) or kc_new.shape != (T, D):
            raise ValueError(f"transform must return a [T, D] = [{T}, {D}] tensor")
        kc_new = kc_new.float().contiguous()              # rounded once, to the cache dtype, at the store
    elif norm_rope is not None and backend == "torch":
        kc_new = norm_rope_keys(mean, weight, eps, None if cos is None else cos[perm],
                                None if sin is None else sin[perm])
    if backend == "torch":
        _store_compressed_torch(kc_new, grp, rows, perm, token_to_req, positions, kc_cache, block_table,
                                partial, next_pos)
        return
    bt = block_table.contiguous()
    fused = norm_rope is not None
    if fused and weight is None:
        weight = replay.owned(torch.zeros(D, dtype=torch.float32, device=raw_k.device))  # 1 + 0, never written
    replay.launch(
        store_compressed_kernel, (T,),
        kc_new, grp, rows[1], rows[2], bt, kc_cache, partial, t2r if ordered else perm,
        weight if fused else mean, cos if fused and half else mean, sin if fused and half else mean,
        T, num_reqs, kc_cache.shape[0], bt.shape[1], kc_cache.shape[1],
        kc_cache.stride(0), kc_cache.stride(1), bt.stride(0),
        weight.stride(0) if fused else 0, cos.stride(0) if fused and half else 0,
        sin.stride(0) if fused and half else 0, eps if fused else 0.0,
        D=D, NORM_ROPE=fused, HALF=half if fused else 0, ORDERED=ordered, enable_fp_fusion=False,
    )
    if next_pos is not None:
        replay.launch(
            finish_groups_kernel, (1,),
            t2r if ordered else perm, t2r, pos, rows[3], next_pos, next_pos if refusals is None else refusals, T,
            RECORD=refusals is not None, BLOCK=min(max(next_pow2(T), 16), 1024), ORDERED=ordered,
        )




def _refuses_at_once(backend: str, device: torch.device) -> bool:
    """Whether refused rows raise at once (a host check): the PyTorch path, and any tensor on the CPU
    (where the check costs no synchronisation). The GPU kernel path records them on the device."""
    return backend == "torch" or device.type != "cuda"


def refusal_message(req: int, pos: int, count: int, expected: int | None = None) -> str:
    """The ValueError text of a refused compressed-key row."""
    held = "" if expected is None else f" (its open group: next expected position {expected})"
    more = f"; {count - 1} more row(s) refused" if count > 1 else ""
    return (f"update_compressed_keys refused position {pos} of request {req}: the earlier members "
            f"{4 * (pos // 4)}..{pos - 1} of its 4-token group were neither in the step nor held{held}, so "
            f"its compressed key would be built from stale data{more}. Feed each request's positions with no "
            f"gap from a multiple of 4, and reset a request slot given to a new request")


def _raise_first_refusal(flags, perm, token_to_req, positions, next_pos) -> None:
    """Raise the ValueError of the first refused row in (request, position) order, if any (host sync).
    ``perm``: sorted row -> batch row, or None where the rows come sorted."""
    refused = ((flags & 1) != 0).nonzero()
    if refused.numel():
        first = int(refused[0, 0])
        row = first if perm is None else int(perm[first])
        req, pos = int(token_to_req[row]), int(positions[row])
        raise ValueError(refusal_message(req, pos, refused.shape[0], int(next_pos[req])))


def _assemble_torch(raw_k, token_to_req, positions, partial, next_pos, perm):
    """What ``assemble_groups_kernel`` computes, in PyTorch (with host synchronisation): the sorted rows'
    groups ``[T, 4, D]``, their means ``[T, D]`` and ``[4, T]`` int64 rows of block index, store request,
    store position (-1: nothing to store) and flags (1: refused, 2: the request's last row)."""
    T, D = raw_k.shape
    num_reqs = partial.shape[0]
    dev = raw_k.device
    req = token_to_req.to(torch.int64)[perm]
    pos = positions.to(torch.int64)[perm]
    ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req_n = torch.cat([req[1:], req.new_full((1,), -1)])
    pos_n = torch.cat([pos[1:], pos.new_full((1,), -1)])
    same_next = (req_n == req) & (pos_n >= 0)
    same_next[-1] = False
    active = ok & ~(same_next & (pos_n == pos))          # a later duplicate shadows this row
    final = active & ~same_next
    j = torch.where(active, pos, 0) % GROUP
    req_c = torch.where(active, req, 0)
    x = raw_k.float()[perm]
    if next_pos is None:
        held = torch.full_like(pos, GROUP - 1)
    else:
        e = torch.where(active, next_pos[req_c], -1)
        held = torch.where((e >= 0) & (e - e % GROUP == pos - j), e - (pos - j), 0)
    # The active rows are unique and ascend within a request: an earlier member of the same group that
    # is in the step is one of the 3 active rows before.
    act = active.nonzero().squeeze(1)
    ra, pa, rowa = req[act], pos[act], perm[act]
    c = torch.arange(act.shape[0], device=dev)
    grp = torch.zeros(T, GROUP, D, dtype=torch.float32, device=dev)
    missing = torch.zeros(T, dtype=torch.bool, device=dev)
    for m in range(GROUP - 1):
        src_a = torch.full_like(c, -1)
        for d in (1, 2, 3):
            cand = (c - d).clamp(min=0)
            hit = (c >= d) & (ra[cand] == ra) & (pa[cand] == pa - pa % GROUP + m)
            src_a = torch.where(hit, rowa[cand], src_a)
        src = torch.full((T,), -1, dtype=torch.int64, device=dev)
        src[act] = src_a
        need = active & (m < j)
        in_step = need & (src >= 0)
        in_part = need & ~in_step & (m < held)
        missing |= need & ~(in_step | in_part)
        v = torch.where(in_step[:, None], raw_k.float()[src.clamp(min=0)],
                        torch.where(in_part[:, None], partial[req_c, m], 0.0))
        grp[:, m] = torch.where((active & (j == m))[:, None], x, v)
    grp[:, GROUP - 1] = torch.where((active & (j == GROUP - 1))[:, None], x, 0.0)
    mean = (((grp[:, 0] + grp[:, 1]) + grp[:, 2]) + grp[:, 3]) * 0.25
    store = active & ~missing & ((j == GROUP - 1) | final)
    rows = torch.stack([torch.where(active, pos // GROUP, 0), torch.where(store, req, -1),
                        torch.where(store, pos, -1), missing.long() + 2 * final.long()])
    return grp, mean, rows


def _store_compressed_torch(kc_new, grp, rows, perm, token_to_req, positions, kc_cache, block_table, partial,
                            next_pos) -> None:
    """What ``store_compressed_kernel`` and ``finish_groups_kernel`` do, in PyTorch: the closing rows'
    compressed keys into the cache, the open group of each request's last row into ``partial``, the
    requests' next expected positions into ``next_pos``."""
    num_blocks, rows_per_page = kc_cache.shape[:2]
    max_blocks = block_table.shape[1]
    ok = rows[2] >= 0
    req = torch.where(ok, rows[1], 0)
    pos = torch.where(ok, rows[2], 0)
    j = pos % GROUP
    b = pos // GROUP
    i_page = b // rows_per_page
    if max_blocks == 0:  # no table column: every page lookup is invalid
        page = torch.full_like(i_page, -1)
    else:
        page = block_table.to(torch.int64)[req, i_page.clamp(0, max_blocks - 1)]
    close = ok & (j == GROUP - 1) & (i_page < max_blocks) & (page >= 0) & (page < num_blocks)
    kc_cache[page[close], (b % rows_per_page)[close]] = kc_new[close].to(kc_cache.dtype)  # one rounding
    keep_open = ok & (j != GROUP - 1)
    for m in range(GROUP - 1):
        sel = keep_open & (j >= m)
        partial[req[sel], m] = grp[sel, m]
    if next_pos is not None:
        final = (rows[3] & 2) != 0
        req_s = token_to_req.to(torch.int64)[perm]
        pos_s = positions.to(torch.int64)[perm]
        nxt = torch.where(((rows[3] & 1) != 0) & (pos_s % GROUP != GROUP - 1), -1, pos_s + 1)
        next_pos[req_s[final]] = nxt[final]


class CompressedKeyCache:
    """A compressed-key cache with its per-request open groups and their positions.

    Args:
        num_blocks, block_size: the main KV cache's physical blocks and tokens per block
            (``block_size % 4 == 0``); the compressed cache has ``block_size // 4`` rows per block.
        num_reqs: request slots (rows of the block table).
        dim: key width D, a power of two >= 16 (128 in QSA). dtype: of ``kc_cache``.
        device: where the tensors live; None (the default) means torch's current default device
            (``torch.get_default_device()``), as for torch's own factory functions.
        transform: see :func:`update_compressed_keys`.

    Attributes:
        kc_cache: ``[num_blocks, block_size // 4, dim]``, pass to :func:`select_tokens` (or use
            :meth:`select`).
        block_size: the main KV cache's tokens per block.
        partial: ``[num_reqs, 3, dim]`` fp32 open groups.
        next_pos: ``[num_reqs]`` int64 next expected position of each request (0 at first).
        refusals: ``[3]`` int64 refused rows recorded on the GPU path (count, request, position).
    """

    def __init__(self, num_blocks: int, block_size: int, num_reqs: int, *, dim: int = 128,
                 dtype=torch.bfloat16, device=None, transform=None):
        num_blocks = check_int("num_blocks", num_blocks, 0)
        block_size = check_int("block_size", block_size)
        num_reqs = check_int("num_reqs", num_reqs, 0)
        dim = check_int("dim", dim)
        if block_size <= 0 or block_size % GROUP:
            raise ValueError(f"block_size must be a positive multiple of 4, got {block_size}")
        check_index_dim("dim", dim)
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        _check_transform(transform)
        self.block_size = block_size
        self.kc_cache = torch.zeros(num_blocks, block_size // GROUP, dim, dtype=dtype, device=device)
        self.partial = torch.zeros(num_reqs, GROUP - 1, dim, dtype=torch.float32, device=device)
        self.next_pos = torch.zeros(num_reqs, dtype=torch.int64, device=device)
        self.refusals = torch.zeros(3, dtype=torch.int64, device=device)
        self.transform = transform

    def update(self, raw_k, token_to_req, positions, block_table, *, backend: str | None = None) -> None:
        """Feed one step's raw keys, rows in any order (see :func:`update_compressed_keys`, which this
        calls with the cache's ``next_pos`` and ``refusals``): a row whose group's earlier members were never
        fed raises a ValueError at once on the CPU and with ``backend="torch"``, and is recorded for
        :meth:`check` by the GPU kernels."""
        update_compressed_keys(raw_k, token_to_req, positions, self.kc_cache, block_table, self.partial,
                               block_size=self.block_size, next_pos=self.next_pos, refusals=self.refusals,
                               transform=self.transform, backend=backend)

    def select(self, index_q, block_table, token_to_req, positions, seq_lens, *, k: int = 512, out=None,
               backend: str | None = None):
        """:func:`select_tokens` over this cache (its block size included)."""
        return select_tokens(index_q, self.kc_cache, block_table, token_to_req, positions, seq_lens,
                             block_size=self.block_size, k=k, out=out, backend=backend)

    def reset(self, reqs=None) -> None:
        """Forget the open groups of request slots ``reqs`` (an index or index tensor; None: all), as when a
        slot is given to a new request: their next expected position becomes 0."""
        if reqs is None:
            self.next_pos.zero_()
        else:
            self.next_pos[reqs] = 0

    def check(self) -> None:
        """Raise the ValueError of the rows refused on the GPU path since the last check, and clear the
        record. Reads the device counter: a host synchronisation, for tests and debugging."""
        count, req, pos = self.refusals.tolist()
        if count:
            self.refusals.zero_()
            raise ValueError(refusal_message(req, pos, count))
