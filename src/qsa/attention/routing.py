"""Route admission: the one place that decides which kernel takes which rows.

Routes:

* ``grouped`` -- page4 grouped plan, K/V tiles shared by ``GROUP_ROWS`` adjacent rows x all heads.
* ``xqa`` -- page4 single-row plan, all G heads of a KV head per program, split + ordered merge.
* ``splitk`` -- token lists through the block table; any G; the baseline and fallback.
* ``invariant`` -- batch-invariant: every row on its own, cut into splits of a fixed size at fixed
  positions of its list and folded in list order, with settings fixed by the shape alone, so a row's
  output bits depend only on its own inputs, never on the batch (:func:`~qsa.attention.invariant.launch.invariant_config`).
  Only on request.
* ``reference`` -- the pure PyTorch reference (CPU without the Triton interpreter, or on request).

``auto`` sends ``rows // GROUP_ROWS * GROUP_ROWS`` rows to ``grouped`` when there are at least
``settings.GROUPED_MIN_ROWS`` rows (``settings.GROUPED_MIN_ROWS_LONG`` where the block table spans at least
``settings.GROUPED_LONG_CONTEXT`` tokens), the shape is supported and the batch is not known to be pure decode (one row
per request), the remaining rows to ``xqa``; all rows to ``grouped`` when they are known to be one request's
(``max_query_len >= rows``: the last, partial group shares that request's tokens too, and costs no launch of
its own, where the leftover rows of a mixed batch may be decode rows of other requests, which xqa splits
better). It falls back to ``splitk`` for shapes the page4 routes
do not take (to ``reference`` for head dims no Triton kernel takes, and where no Triton kernel can run:
a CPU without the interpreter, or an interpreter that cannot run them, :func:`qsa.backend.interpreter_problem`).
Each such fallback is logged once per process, with its reason, as a WARNING on the ``qsa`` logger
(printed to stderr when logging is not configured); a forced route that cannot run raises ValueError.

xqa rows run one of two kernels: with a single-row plan built by its own launch, or, when the caller
says the rows are sorted (``rows_sorted``: ascending kept tokens, dropped entries last, as
``select_tokens`` emits them) and there are at most ``settings.DIRECT_MAX_ROWS`` of them, "direct": each
program reads its row's list straight from ``indices`` (one launch fewer). A row that is not sorted after
all is sorted inside the direct kernel, correctly but slowly. A row of whole 4-token blocks and a tail (the
indexer's selections), all of whose tokens are kept, gets the same bits with or without the hint: the
planned kernel cuts the rows the direct kernel could take as it would (:func:`~qsa.attention.xqa.launch.xqa_cut`).
Other rows agree
within rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import backend, settings, utils
from ..utils import check_bool, check_int, next_pow2

ROUTES = ("auto", "grouped", "xqa", "splitk", "invariant", "reference")
HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head dims the Triton kernels take."""
MAX_TILE_ROWS = 128
"""Largest matrix-row tile (rows x heads, or heads) a page4 program holds."""


@dataclass(frozen=True)
class RoutePlan:
    """Which rows go where. ``grouped_rows`` rows from row 0 take the grouped route, the rest xqa,
    unless ``route`` is ``splitk``, ``invariant`` or ``reference`` (then all rows take it)."""

    route: str
    grouped_rows: int
    group_rows: int = settings.GROUP_ROWS
    direct: bool = False  # xqa rows read their lists straight from ``indices`` (no single-row plan)


def page4_refusal(G: int, head_dim: int) -> str | None:
    """Why the page4 routes (grouped, xqa) cannot take this shape, or None."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
    if next_pow2(max(G, 16)) > MAX_TILE_ROWS:
        return f"G = Hq / Hkv = {G} exceeds {MAX_TILE_ROWS} heads per tile"
    return None



def max_query_len_of(token_to_req) -> int | None:
    """The most rows any one request has among ``token_to_req`` (padding rows, request < 0, not
    counted; None when there are none). A device tensor is read back once (a host synchronisation), so
    compute it where the batch is built, not inside a captured region."""
    t = token_to_req.cpu() if isinstance(token_to_req, torch.Tensor) else torch.tensor(token_to_req)
    t = t[t >= 0].long()
    return int(torch.bincount(t).max()) if t.numel() else None


def choose(route: str, *, rows: int, G: int, head_dim: int, device: torch.device,
           max_query_len: int | None = None, rows_sorted: bool = False,
           index_width: int | None = None, context_tokens: int | None = None) -> RoutePlan:
    """Admission: map a requested route to the rows each kernel takes.

    ``max_query_len`` is the most rows any one request has in the batch, when the caller knows it (a
    host integer; serving engines track it). At 1, a pure decode batch, no two rows of a group share a
    request, so grouping shares no K/V load and ``auto`` takes xqa.

    ``rows_sorted`` (with ``index_width``, the columns of ``indices``) lets xqa rows take the direct
    kernel (see the module docstring); it changes which kernel runs, and no bit of a row of whole blocks.

    ``context_tokens`` is the span of the block table (``max_blocks * block_size``, None: not known): from
    ``settings.GROUPED_LONG_CONTEXT`` tokens ``auto`` groups only from ``settings.GROUPED_MIN_ROWS_LONG``
    rows.

    A forced route that cannot run raises ValueError; ``auto`` falls back and logs why once.
    """
    if max_query_len is not None:
        max_query_len = check_int("max_query_len", max_query_len, 1)
    rows_sorted = check_bool("rows_sorted", rows_sorted)
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    if route == "reference":
        return RoutePlan("reference", 0)
    no_triton = backend.triton_available(device)
    if no_triton is not None:
        if route != "auto":
            raise ValueError(f"route={route!r} cannot run: {no_triton}")
        backend.log_once(f"qsa: route 'auto' falls back to the PyTorch reference attention: {no_triton}")
        return RoutePlan("reference", 0)
    if head_dim not in HEAD_DIMS:
        if route != "auto":
            raise ValueError(f"head_dim must be one of {HEAD_DIMS} for the Triton routes, got {head_dim}")
        backend.log_once(f"qsa: route 'auto' falls back to the PyTorch reference attention: no Triton kernel takes "
                 f"head_dim {head_dim} (they take {HEAD_DIMS})")
        return RoutePlan("reference", 0)
    refusal = page4_refusal(G, head_dim)
    if route == "splitk":
        return RoutePlan("splitk", 0)
    if route == "invariant":
        if refusal is not None:
            raise ValueError(f"route='invariant' cannot run: {refusal}")
        if index_width is not None and next_pow2(max(index_width, 1)) > settings.DIRECT_MAX_WIDTH:
            raise ValueError(f"route='invariant' takes indices at most {settings.DIRECT_MAX_WIDTH} wide, got {index_width}")
        return RoutePlan("invariant", 0)
    if route in ("grouped", "xqa"):
        if refusal is not None:
            raise ValueError(f"route={route!r} cannot run: {refusal}")
        grouped_rows = rows if route == "grouped" else 0
    elif refusal is not None:
        backend.log_once(f"qsa: route 'auto' takes splitk, not the page4 routes (grouped, xqa): {refusal}")
        return RoutePlan("splitk", 0)
    elif rows < settings.GROUPED_MIN_ROWS or max_query_len == 1 or (
            context_tokens is not None and context_tokens >= settings.GROUPED_LONG_CONTEXT
            and rows < settings.GROUPED_MIN_ROWS_LONG):
        route, grouped_rows = "xqa", 0
    elif max_query_len is not None and max_query_len >= rows:  # one request: its last group may be partial
        route, grouped_rows = "grouped", rows
    else:
        route, grouped_rows = "grouped", rows // settings.GROUP_ROWS * settings.GROUP_ROWS
    direct = rows_sorted and index_width is not None and direct_admits(rows - grouped_rows, index_width)
    return RoutePlan(route, grouped_rows, group_rows=settings.GROUP_ROWS, direct=direct)


def direct_admits(rows: int, index_width: int) -> bool:
    """Whether the direct xqa kernel can take ``rows`` xqa rows of ``indices`` ``index_width`` wide (with
    the ``rows_sorted`` hint it then does; without it the planned kernel cuts them as it would:
    :func:`qsa.attention.xqa.launch.xqa_cut`)."""
    return 0 < rows <= settings.DIRECT_MAX_ROWS and next_pow2(max(index_width, 1)) <= settings.DIRECT_MAX_WIDTH


def split_count(programs: int, max_tiles: int, programs_per_sm: int, device: torch.device,
                cap: int | None = None) -> int:
    """Splits per work list (row or group) so that a launch of ``programs`` lists has about
    ``programs_per_sm`` programs per SM (at most ``cap``, default ``settings.MAX_SPLITS``); one when the lists
    alone fill the device.

    The count depends on the batch shape only, never on the data, so a fixed shape always cuts a
    list at the same positions (bitwise determinism for a fixed batch shape, docs/spec.md section 7).
    """
    cap = settings.MAX_SPLITS if cap is None else cap
    facts = utils.device_facts(str(device))
    target = programs_per_sm * facts["sm_count"]
    if facts["kind"] != "cuda" or programs >= target:  # the interpreter runs programs one by one
        return 1
    return max(1, min(cap, max_tiles, -(-target // max(programs, 1))))
