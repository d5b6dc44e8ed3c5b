"""Page4 planning: turn each row's token selection into microblock work lists.

A *microblock* is 4 consecutive token slots of one physical KV block. Its id is
``physical_block * (block_size // 4) + (token % block_size) // 4``; token ``t`` of a request sits in
microblock ``t // 4`` of the request's logical space, at mask bit ``t % 4``.

Row validity (docs/spec.md section 4): row ``r`` with ``req = token_to_req[r]`` is a padding row unless
``0 <= req < num_reqs`` and ``positions[r] >= 0``. Token ``t`` of ``indices[r]`` is kept iff
``0 <= t < seq_lens[req]``, ``t <= positions[r]``, ``t // block_size < max_blocks`` and
``0 <= block_table[req, t // block_size] < num_blocks``. Everything else is dropped and never read. With
``index_counts``, only the first ``min(max(index_counts[r], 0), W)`` entries of ``indices[r]`` are the row's:
the planners never load the others.

Two plans (see ``docs/planner.md`` for the derivation):

* :class:`SingleRowPlan` -- per row, the distinct logical microblocks of its kept tokens in ascending
  logical order, each with a 4-bit mask (bit ``t % 4``). Order depends only on logical data, so
  shuffling a row's indices or moving pages leaves everything but the ids unchanged.
* :class:`GroupedPlan` -- per group of ``group_rows`` adjacent rows, the union of the rows' kept tokens
  by *(request, logical microblock)*, masks OR-ed with row ``q`` in bits ``4q..4q+3``; the requests
  of a group in the order of their first row, each request's microblocks in ascending logical order.
  The key is logical data only; rows of one request share each microblock's single load.

Both pad their lists with entries ``(first id, mask 0)`` up to a multiple of :data:`PAD` so kernels read
whole tiles without bounds checks; entries past the padded count are unspecified. An empty list has no
padding. Both planners run on the tensors' device with no host synchronisation and fixed output shapes,
so they can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import settings, utils
from ...utils import (INT32_MAX, check_bool, check_int, check_tensor, interpreter_enabled, launch_options, next_pow2,
                    round_up, type_name)
from ..replay import launch as launch_kernel, owned, zeroed

PAD = 16
"""Plans pad their lists to a multiple of this many entries (a multiple of every kernel tile)."""

MAX_GROUP_ROWS = 8
"""Grouped masks hold 4 bits per row in an int32."""

MAX_INDEX_WIDTH = 1 << 15
"""Widest ``indices`` row a planner program sorts in registers."""


@dataclass
class SingleRowPlan:
    """Per-row microblock lists (the "XQA" plan).

    Attributes:
        mb_ids: ``[rows, cap]`` int32. Physical microblock ids, ascending logical order per row.
        masks: ``[rows, cap]`` uint8. Bit ``t % 4`` set for each kept token ``t`` of the microblock.
        counts: ``[rows]`` int32. Number of real entries of each row (padding not counted).
        block_size: tokens per physical KV block.
        num_blocks: physical blocks in the KV cache the ids point into.
    """

    mb_ids: torch.Tensor
    masks: torch.Tensor
    counts: torch.Tensor
    block_size: int
    num_blocks: int

    @property
    def num_rows(self) -> int:
        return self.mb_ids.shape[0]

    @property
    def capacity(self) -> int:
        return self.mb_ids.shape[1]


@dataclass
class GroupedPlan:
    """Per-group unions of microblocks (the grouped page4 plan).

    Group ``g`` covers rows ``[g * group_rows, min((g + 1) * group_rows, num_rows))``.

    Attributes:
        mb_ids: ``[num_groups, cap]`` int32. Physical microblock ids: one entry per (request,
            logical microblock) of the group, ascending logical order within each request.
        masks: ``[num_groups, cap]`` int32. Bit ``4 * q + t % 4`` set when group row ``q`` keeps token ``t``.
        counts: ``[num_groups]`` int32. Union size of each group (padding not counted).
        group_rows: rows per group (1..8).
        num_rows: rows covered, starting at row 0.
        block_size: tokens per physical KV block.
        num_blocks: physical blocks in the KV cache the ids point into.
    """

    mb_ids: torch.Tensor
    masks: torch.Tensor
    counts: torch.Tensor
    group_rows: int
    num_rows: int
    block_size: int
    num_blocks: int

    @property
    def num_groups(self) -> int:
        return self.mb_ids.shape[0]

    @property
    def capacity(self) -> int:
        return self.mb_ids.shape[1]


def single_row_capacity(index_width: int) -> int:
    """Entries per row: every index can open at most one microblock."""
    return max(round_up(index_width, PAD), PAD)


def grouped_capacity(index_width: int, group_rows: int) -> int:
    """Entries per group: the union of ``group_rows`` single-row lists."""
    return max(round_up(group_rows * index_width, PAD), PAD)


def planner_config(num_groups: int, device, microblocks: int | None = None) -> settings.PlannerConfig:
    """The shipped grouped-planner settings for ``num_groups`` groups on ``device``, over a block table of
    ``microblocks`` logical microblocks (``max_blocks * block_size // 4``; None: a long one): fewer groups
    than SMs ``PLANNER_FEW``; else up to ``SHORT_MICROBLOCKS`` ``PLANNER_SHORT``, up to
    ``SHARED_MAP_MICROBLOCKS`` ``PLANNER_MAP``, past it ``PLANNER``. The choice depends on shapes only, so
    it is fixed for a CUDA graph."""
    facts = utils.device_facts(str(torch.device(device)))
    if facts["kind"] == "cuda" and num_groups < facts["sm_count"]:
        return settings.PLANNER_FEW
    if microblocks is None or microblocks > settings.SHARED_MAP_MICROBLOCKS:
        return settings.PLANNER
    return settings.PLANNER_SHORT if microblocks <= settings.SHORT_MICROBLOCKS else settings.PLANNER_MAP


def map_scratch_offset(words: int) -> int:
    """First scratch word of ``grouped_plan_map_kernel``'s map when it lives in the workspace (the CPU): after
    the ``words`` bitmap words, their sector flags and the sector list (:func:`scratch_words`)."""
    return words * 37 // 32


def scratch_words(microblocks: int) -> tuple[int, int]:
    """(bitmap words, scratch words) of one grouped-planner program for ``microblocks`` logical
    microblocks: the bitmap (one int32 per microblock, a multiple of 512, so that every part starts on
    16 bytes), one flag byte per 8-word sector of it and the list of flagged sectors
    (``grouped_plan_kernel``), then a byte per microblock, a flag bit per microblock and a list of 1536 words
    (``grouped_plan_map_kernel`` when its map is not in shared memory)."""
    words = round_up(max(microblocks, 1), 512)
    return words, map_scratch_offset(words) + words // 4 + words // 32 + settings.MAP_LIST_WORDS


@dataclass
class PlanWorkspace:
    """Scratch of the grouped planner: one bitmap per program over a request's logical microblocks.

    Program ``p`` keeps 4 bits per group row and logical microblock in ``bits[p]`` while it plans a
    group (one int32 per logical microblock, row q's bits at 4q), with a flag byte per 8-word sector it set a bit in and
    the list of those sectors after it (:func:`scratch_words`); the kernel zeroes every word and flag
    it touched before it moves on, so one workspace serves any number of calls (and CUDA-graph
    replays) on one stream.

    Attributes:
        bits: ``[programs, scratch_words(microblocks)[1]]`` int32; ``state`` is zero between calls.
    """

    bits: torch.Tensor

    @classmethod
    def allocate(cls, *, microblocks: int, programs: int, device) -> "PlanWorkspace":
        """Scratch for ``programs`` programs and tables of ``microblocks = max_blocks * block_size // 4``."""
        if microblocks < 0 or programs < 1:
            raise ValueError(f"need microblocks >= 0 and programs >= 1, got {microblocks}, {programs}")
        return cls(bits=torch.zeros((programs, scratch_words(microblocks)[1]), dtype=torch.int32, device=device))

    @classmethod
    def for_plan(cls, block_table: torch.Tensor, *, block_size: int, num_groups: int,
                 config: settings.PlannerConfig | None = None) -> "PlanWorkspace":
        """The workspace :func:`plan_groups` allocates for this table and number of groups (``config``:
        default :func:`planner_config`)."""
        microblocks = block_table.shape[1] * (block_size // 4)
        config = config or planner_config(num_groups, block_table.device, microblocks)
        return cls.allocate(microblocks=microblocks, device=block_table.device,
                            programs=planner_programs(num_groups, block_table.device, microblocks=microblocks,
                                                      config=config))

    @property
    def programs(self) -> int:
        return self.bits.shape[0]

    @property
    def microblocks(self) -> int:
        """Logical microblocks the bitmap covers (the inverse of :func:`scratch_words`: 46 W / 32 + 1536 words)."""
        return max(self.bits.shape[1] - settings.MAP_LIST_WORDS, 0) * 32 // 46

    @property
    def state(self) -> torch.Tensor:
        """The bitmaps, the sector flags and the byte map with its flags (a copy): zero between calls (the
        lists are written before they are read)."""
        words = self.microblocks
        at = map_scratch_offset(words)
        return torch.cat([self.bits[:, :words + words // 32], self.bits[:, at:at + words // 4 + words // 32]], 1)


def planner_programs(num_groups: int, device, *, microblocks: int = 0,
                     config: settings.PlannerConfig | None = None) -> int:
    """Persistent grid of the grouped planner: a few programs per SM, never more than groups, and
    no more than keep the scratch (:func:`scratch_words`, about 5.75 bytes per logical microblock per program
    plus 1536 words) under ``settings.PLANNER_SCRATCH_BYTES`` (at least one per SM); ``config`` defaults to
    ``settings.PLANNER``."""
    config = config or settings.PLANNER
    facts = utils.device_facts(str(torch.device(device)))
    sms = facts["sm_count"] if facts["kind"] == "cuda" else 1
    per_device = config.programs_per_sm * sms if facts["kind"] == "cuda" else 2
    by_memory = max(sms, settings.PLANNER_SCRATCH_BYTES // (4 * scratch_words(microblocks)[1]))
    return max(1, min(num_groups, per_device, by_memory))


def check_plan_inputs(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                      num_blocks: int, index_counts=None) -> None:
    """Validate the planner's inputs; raise ValueError/TypeError naming the argument."""
    check_tensor("indices", indices, ndim=2, dtypes=torch.int32, what="[rows, W] int32")
    rows, width = indices.shape
    dev = indices.device
    check_tensor("block_table", block_table, ndim=2, dtypes=torch.int32, device=dev,
                 what="[num_reqs, max_blocks] int32")
    check_tensor("token_to_req", token_to_req, dtypes=(torch.int32, torch.int64), device=dev,
                 shape=(rows,), what="[rows] int32/int64")
    check_tensor("positions", positions, dtypes=(torch.int32, torch.int64), device=dev,
                 shape=(rows,), what="[rows] int64")
    check_tensor("seq_lens", seq_lens, dtypes=torch.int32, device=dev,
                 shape=(block_table.shape[0],), what="[num_reqs] int32")
    if check_int("block_size", block_size, 4) % 4:
        raise ValueError(f"block_size must be a positive multiple of 4, got {block_size!r}")
    check_int("num_blocks", num_blocks, 0)
    if num_blocks * (block_size // 4) > INT32_MAX:
        raise ValueError(f"num_blocks * block_size // 4 must fit in int32, got {num_blocks} blocks "
                         f"of {block_size}")
    if width > MAX_INDEX_WIDTH:
        raise ValueError(f"indices must have at most {MAX_INDEX_WIDTH} columns, got {width}")
    if indices.stride(1) != 1:
        raise ValueError("indices must be contiguous in its last dimension")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    for name, t in (("token_to_req", token_to_req), ("positions", positions), ("seq_lens", seq_lens)):
        if t.shape[0] > 1 and t.stride(0) != 1:  # the kernels read element i at offset i
            raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride(0)}")
    check_index_counts(index_counts, rows, dev)


def check_index_counts(index_counts, rows: int, device) -> None:
    """``index_counts`` is None or a ``[rows]`` int32 tensor on ``device`` (any stride: vLLM's is the last
    column of its ``[rows, W + 1]`` index buffer); raise TypeError/ValueError naming it. Its values are
    not checked (that would need a host synchronisation): each is clamped to ``[0, W]`` where it is read."""
    if index_counts is None:
        return
    check_tensor("index_counts", index_counts, ndim=1, dtypes=torch.int32, device=device, shape=(rows,),
                 what="[rows] int32 (each row's count of valid leading indices)")


def count_args(index_counts) -> tuple[bool, torch.Tensor | None, int | None]:
    """``(HAS_COUNTS, idx_count_ptr, stride_idx_count)`` of a kernel that reads ``indices``: the counts and
    their row stride, or (no counts) None for both. Triton takes a None argument as a constant, so without
    counts neither is a parameter of the compiled kernel, which is the kernel compiled before the argument
    existed (``HAS_COUNTS`` False: no count is loaded, every row is ``W`` wide)."""
    if index_counts is None:
        return False, None, None
    return True, index_counts, index_counts.stride(0)


def _check_plan_buffers(out, cls, n: int, cap: int, mask_dtype: torch.dtype, device, what: str) -> None:
    """``out`` (a plan to refill) must be a ``cls`` whose buffers are what the planner writes: ``[n, cap]``
    contiguous ids and masks, ``[n]`` counts, on ``device``. The kernels write them at these shapes."""
    if not isinstance(out, cls):
        raise TypeError(f"out must be a {cls.__name__} or None, got {type_name(out)}")
    for name, t, dtype, shape in (("mb_ids", out.mb_ids, torch.int32, (n, cap)),
                                  ("masks", out.masks, mask_dtype, (n, cap)),
                                  ("counts", out.counts, torch.int32, (n,))):
        check_tensor(f"out.{name}", t, dtypes=dtype, device=device, shape=shape,
                     what=f"({what}, a plan of the same shapes)")
        if not t.is_contiguous():
            raise ValueError(f"out.{name} must be contiguous")


def plan_single_rows(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                     num_blocks: int, out: SingleRowPlan | None = None, row_start: int = 0,
                     chunk: int | None = None, num_warps: int | None = None,
                     ascending_steps: bool | None = None, rows_sorted: bool = False,
                     index_counts=None) -> SingleRowPlan:
    """Build the single-row plan of rows ``[row_start, rows)`` (see the module docstring).

    Args:
        indices: ``[rows, W]`` int32 token indices; -1 and out-of-range values are dropped.
        block_table: ``[num_reqs, max_blocks]`` int32 logical -> physical block.
        token_to_req: ``[rows]`` request of each row.
        positions: ``[rows]`` logical position of each row (-1 for padding rows).
        seq_lens: ``[num_reqs]`` int32.
        block_size: tokens per KV block (multiple of 4).
        num_blocks: physical blocks of the KV cache.
        out: optional plan whose buffers are reused (``[rows, >= single_row_capacity(W)]``).
        row_start: rows before it are left unplanned (their entries and counts are unspecified); the
            ``auto`` route plans only the rows the grouped route leaves over.
        chunk, num_warps: launch settings of the row planner (indices read per step, a power of two
            >= 16; warps per program), for tuning. None: :func:`row_plan_chunk` and its warps. The plan
            is the same for any settings.
        ascending_steps: rows wider than one step take the scan-free path of ascending rows (neighbour
            reads, as one-step rows do) instead of the streaming scan; None:
            :func:`row_plan_ascending_steps`. Also a tuning setting: the plan is the same.
        rows_sorted: the caller's rows are sorted as ``select_tokens`` emits them. On the scan-free
            steps a row found out of order is then sorted by its own program, with no launch of the
            sorting planner after the row planner (decode-256 plan + xqa 157.3-157.9 -> 155.4-155.9 us
            on the H200), but about 14% slower where every row is out of order (244 -> 279 us). Never
            changes the plan.
        index_counts: optional ``[rows]`` int32 (any stride): row ``r`` is its first
            ``min(max(index_counts[r], 0), W)`` entries of ``indices``, the rest never read (the plan is
            that of the row with -1 in their place). With ``rows_sorted``, those first entries are sorted.

    Returns:
        SingleRowPlan on ``indices.device`` with ``rows`` lists.
    """
    check_plan_inputs(indices, block_table, token_to_req, positions, seq_lens, block_size=block_size,
                      num_blocks=num_blocks, index_counts=index_counts)
    rows, width = indices.shape
    row_start = check_int("row_start", row_start, 0)
    if row_start > rows:
        raise ValueError(f"row_start must be an int in [0, {rows}], got {row_start!r}")
    if chunk is not None:
        chunk = check_int("chunk", chunk)
        if chunk < PAD or chunk & (chunk - 1):
            raise ValueError(f"chunk must be None or a power of two >= {PAD}, got {chunk!r}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be None or a power of two in [1, 32], got {num_warps!r}")
    if ascending_steps is not None:
        ascending_steps = check_bool("ascending_steps", ascending_steps)
    rows_sorted = check_bool("rows_sorted", rows_sorted)
    cap = single_row_capacity(width)
    if out is None:
        out = SingleRowPlan(
            mb_ids=torch.empty((rows, cap), dtype=torch.int32, device=indices.device),
            masks=torch.empty((rows, cap), dtype=torch.uint8, device=indices.device),
            counts=torch.empty((rows,), dtype=torch.int32, device=indices.device),
            block_size=block_size, num_blocks=num_blocks)
    else:
        # Exactly [rows, cap]: the launches size their splits by the capacity, so a wider buffer could
        # change bits.
        _check_plan_buffers(out, SingleRowPlan, rows, cap, torch.uint8, indices.device, "[rows, capacity]")
    out.block_size, out.num_blocks = block_size, num_blocks
    _plan_rows(indices, block_table, token_to_req, positions, seq_lens, block_size, num_blocks,
               out.mb_ids, out.masks, out.counts, emit_tokens=False, row_start=row_start, chunk=chunk,
               num_warps=num_warps, ascending_steps=ascending_steps, sort_in_row=rows_sorted,
               index_counts=index_counts)
    return out


def plan_groups(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int, num_blocks: int,
                group_rows: int = 8, num_rows: int | None = None, out: GroupedPlan | None = None,
                workspace: PlanWorkspace | None = None, config: settings.PlannerConfig | None = None,
                index_counts=None) -> GroupedPlan:
    """Build the grouped plan of rows ``[0, num_rows)`` straight from the planner inputs.

    Args:
        indices, block_table, token_to_req, positions, seq_lens, block_size, num_blocks: as for
            :func:`plan_single_rows`.
        group_rows: adjacent rows per group, 1..8.
        num_rows: rows to group (default: all rows).
        out: optional plan whose buffers are reused.
        workspace: optional planner scratch (:meth:`PlanWorkspace.for_plan`); allocated when omitted.
        config: launch settings (default :func:`planner_config`).
        index_counts: optional ``[rows]`` int32 counts of each row's valid leading entries, as for
            :func:`plan_single_rows`.

    Returns:
        GroupedPlan with ``ceil(num_rows / group_rows)`` groups.
    """
    from .kernels import grouped_plan_kernel, grouped_plan_map_kernel

    check_plan_inputs(indices, block_table, token_to_req, positions, seq_lens, block_size=block_size,
                      num_blocks=num_blocks, index_counts=index_counts)
    group_rows = check_int("group_rows", group_rows)
    if not 1 <= group_rows <= MAX_GROUP_ROWS:
        raise ValueError(f"group_rows must be an int in [1, {MAX_GROUP_ROWS}], got {group_rows!r}")
    rows, width = indices.shape
    num_rows = rows if num_rows is None else check_int("num_rows", num_rows, 0)
    if num_rows > rows:
        raise ValueError(f"num_rows must be an int in [0, {rows}], got {num_rows!r}")
    if config is not None and not isinstance(config, settings.PlannerConfig):
        raise TypeError(f"config must be a PlannerConfig or None, got {type_name(config)}")
    if workspace is not None:
        if not isinstance(workspace, PlanWorkspace):
            raise TypeError(f"workspace must be a PlanWorkspace or None, got {type_name(workspace)}")
        check_tensor("workspace.bits", workspace.bits, dtypes=torch.int32, ndim=2, what="[programs, words]")
        if workspace.bits.stride(1) != 1 or workspace.programs < 1:
            raise ValueError("workspace.bits must have at least one row and unit stride along dim 1")
    device = indices.device
    num_groups = -(-num_rows // group_rows)
    cap_g = grouped_capacity(width, group_rows)
    microblocks = block_table.shape[1] * (block_size // 4)
    if microblocks + 8 > INT32_MAX:
        raise ValueError(f"block_table has too many columns for the grouped planner: {block_table.shape[1]}")
    if out is None:
        out = GroupedPlan(
            mb_ids=torch.empty((num_groups, cap_g), dtype=torch.int32, device=device),
            masks=torch.empty((num_groups, cap_g), dtype=torch.int32, device=device),
            counts=torch.empty((num_groups,), dtype=torch.int32, device=device),
            group_rows=group_rows, num_rows=num_rows, block_size=block_size, num_blocks=num_blocks)
    else:
        # Exactly [groups, cap]: the launches size their splits by the capacity, so a wider buffer could
        # change bits.
        _check_plan_buffers(out, GroupedPlan, num_groups, cap_g, torch.int32, device, "[groups, capacity]")
    out.group_rows, out.num_rows = group_rows, num_rows
    out.block_size, out.num_blocks = block_size, num_blocks
    if num_groups == 0:
        return out
    config = config or planner_config(num_groups, device, microblocks)
    if workspace is None:
        workspace = PlanWorkspace.for_plan(block_table, block_size=block_size, num_groups=num_groups, config=config)
    elif (workspace.microblocks < microblocks or workspace.bits.device != device
          or scratch_words(workspace.microblocks)[1] != workspace.bits.shape[1]):
        raise ValueError(f"workspace must cover {microblocks} microblocks on {device}, got "
                         f"{workspace.microblocks} on {workspace.bits.device}")
    programs = min(workspace.programs, num_groups)
    has_counts, idx_counts, stride_counts = count_args(index_counts)
    ptx = settings.PTX_SCAN and device.type == "cuda" and not interpreter_enabled()
    quads = min(config.quads, max(1, next_pow2(-(-width // 4))))
    if config.max_registers is not None and (not isinstance(config.max_registers, int) or config.max_registers < 24):
        raise ValueError(f"config.max_registers must be None or an int >= 24, got {config.max_registers!r}")
    if config.shared_map and microblocks <= settings.SHARED_MAP_MICROBLOCKS:
        for name, v in (("scan", config.scan), ("emit", config.emit)):
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"config.{name} must be a power of two with shared_map, got {v!r}")
        shared = device.type == "cuda" and not interpreter_enabled()
        # the map: in shared memory, or in the workspace
        map_mb = settings.SHARED_MAP_MICROBLOCKS if shared else workspace.microblocks
        # A listing step appends at most its SCAN // 4 words to the list of MAP_LIST_WORDS (4096 microblocks).
        scan = max(32, min(config.scan, 1 << ((4 * settings.MAP_LIST_WORDS).bit_length() - 1), next_pow2(microblocks)))
        launch_kernel(grouped_plan_map_kernel, (programs,),
            indices, block_table, token_to_req, positions, seq_lens,
            out.mb_ids, out.masks, out.counts, workspace.bits, idx_counts,
            width, num_rows, num_groups, programs, block_table.shape[0], block_table.shape[1], num_blocks,
            workspace.microblocks, map_scratch_offset(workspace.microblocks), map_mb // 4, map_mb // 4 + map_mb // 32,
            workspace.bits.stride(0), indices.stride(0), block_table.stride(0),
            out.mb_ids.stride(0), out.masks.stride(0), stride_counts,
            GROUP_ROWS=group_rows, BLOCK_Q=next_pow2(group_rows), BLOCK_SIZE=block_size, QUADS=quads,
            SCAN=scan, CH=config.emit, LIST=settings.MAP_LIST_WORDS, PAD=PAD, SHARED=shared, PTX=ptx,
            HAS_COUNTS=has_counts,
            num_warps=config.num_warps, **launch_options(device),
            **({"maxnreg": config.max_registers} if config.max_registers and shared else {}),
        )
        return out
    scan = min(config.scan, max(PAD, next_pow2(microblocks)))
    launch_kernel(grouped_plan_kernel, (programs,),
        indices, block_table, token_to_req, positions, seq_lens,
        out.mb_ids, out.masks, out.counts, workspace.bits, idx_counts,
        width, num_rows, num_groups, programs, block_table.shape[0], block_table.shape[1], num_blocks,
        workspace.microblocks, workspace.bits.stride(0), indices.stride(0), block_table.stride(0),
        out.mb_ids.stride(0), out.masks.stride(0), stride_counts,
        GROUP_ROWS=group_rows, BLOCK_Q=next_pow2(group_rows), BLOCK_SIZE=block_size,
        QUADS=quads, SCAN=scan,
        PAD=PAD, SYNC_SCAN=scan < 256 * config.num_warps, SUMMARY=config.summary,
        PTX=ptx,
        LATE_TABLE=config.late_table, HAS_COUNTS=has_counts,
        num_warps=config.num_warps, **launch_options(device),
    )
    return out


def token_lists(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                num_blocks: int, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                index_counts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept tokens, distinct and ascending (the split-K route's work list).

    ``out``: a previous ``(tokens, counts)`` of the same shapes, refilled (CUDA-graph capture).
    ``index_counts``: optional ``[rows]`` int32 counts of each row's valid leading entries, as for
    :func:`plan_single_rows` (entries past a row's count are never read).

    Returns:
        tokens: ``[rows, W]`` int32, entries past the row's count unspecified.
        counts: ``[rows]`` int32.
    """
    check_plan_inputs(indices, block_table, token_to_req, positions, seq_lens, block_size=block_size,
                      num_blocks=num_blocks, index_counts=index_counts)
    rows, width = indices.shape
    if out is None:
        tokens = torch.empty((rows, max(width, 1)), dtype=torch.int32, device=indices.device)
        counts = torch.empty((rows,), dtype=torch.int32, device=indices.device)
    else:
        tokens, counts = out
        check_tensor("out tokens", tokens, dtypes=torch.int32, device=indices.device, shape=(rows, max(width, 1)),
                     what="[rows, max(W, 1)] int32")
        check_tensor("out token_counts", counts, dtypes=torch.int32, device=indices.device, shape=(rows,),
                     what="[rows] int32")
        if not tokens.is_contiguous() or not counts.is_contiguous():
            raise ValueError("out tokens and token_counts must be contiguous")
    _plan_rows(indices, block_table, token_to_req, positions, seq_lens, block_size, num_blocks,
               tokens, tokens, counts, emit_tokens=True, index_counts=index_counts)
    return tokens, counts


def row_plan_chunk(rows: int, width: int, device, *, tokens: bool = False) -> int:
    """Indices the streaming row planner reads per step. Many rows: short steps keep registers low and
    the GPU full. Few rows (decode, MTP): one long step, since each row's steps run one after another;
    a row that fits one step is also sorted there when out of order (no second launch). A one-step
    microblock program (4096 indices on 16 warps) takes 128 registers per thread, so it fits once per
    SM: from one row per SM up, microblock rows take steps of 1024 instead, on the scan-free path
    (:func:`row_plan_ascending_steps`; decode-256 plan + xqa 161.0 -> 159.2 us on the H200). Token
    lists (64 registers) keep the one step."""
    facts = utils.device_facts(str(torch.device(device)))
    cuda = facts["kind"] == "cuda"
    one_step = cuda and (rows <= facts["sm_count"] or (tokens and rows < 2 * facts["sm_count"]))
    steps = cuda and rows < 2 * facts["sm_count"]
    return min(4096 if one_step else 1024 if steps else 512, max(PAD, next_pow2(width)))


def row_plan_ascending_steps(rows: int, device) -> bool:
    """Whether microblock rows read in several steps take the scan-free path of ascending rows: for
    the few-row step width of :func:`row_plan_chunk` only (many rows measured slower on it: 8192 rows
    of 2051 indices 187 -> 213 us on the H200)."""
    facts = utils.device_facts(str(torch.device(device)))
    return facts["kind"] == "cuda" and facts["sm_count"] < rows < 2 * facts["sm_count"]


def _plan_rows(indices, block_table, token_to_req, positions, seq_lens, block_size, num_blocks,
               ids, masks, counts, *, emit_tokens: bool, row_start: int = 0, chunk: int | None = None,
               num_warps: int | None = None, ascending_steps: bool | None = None,
               sort_in_row: bool = False, index_counts=None) -> None:
    """Launch the streaming row planner, then (rows wider than one step) the sorting planner for rows
    found out of order; with ``sort_in_row``, on the scan-free steps, such a row is sorted by its own
    program instead (one launch fewer, for callers whose rows are sorted: see ``plan_single_rows``).
    With ``index_counts`` each row reads only its first count entries (``HAS_COUNTS``)."""
    from .kernels import single_row_plan_kernel, single_row_sort_plan_kernel
    rows, width = indices.shape
    if rows == row_start:
        return
    device = indices.device
    chunk = chunk or row_plan_chunk(rows - row_start, width, device, tokens=emit_tokens)
    if ascending_steps is None:
        ascending_steps = row_plan_ascending_steps(rows - row_start, device)
    one_chunk = chunk >= width
    steps = bool(ascending_steps) and not (emit_tokens or one_chunk)  # one kernel variant where it is unused
    in_row = steps and sort_in_row
    block_w = max(next_pow2(width), PAD)
    if one_chunk or in_row:  # rows out of order are sorted by the row's own program: one launch
        unsorted = num_unsorted = counts
    else:
        unsorted = owned(torch.empty((rows,), dtype=torch.int32, device=device))
        num_unsorted = zeroed(torch.empty((1,), dtype=torch.int32, device=device))
    keys = owned(torch.empty((rows - row_start, block_w), dtype=torch.int32, device=device)) if in_row else counts
    has_counts, idx_counts, stride_counts = count_args(index_counts)
    common = dict(W=width, num_reqs=block_table.shape[0], max_blocks=block_table.shape[1],
                  num_blocks=num_blocks, stride_idx_row=indices.stride(0), stride_bt_req=block_table.stride(0),
                  stride_ids_row=ids.stride(0), stride_masks_row=masks.stride(0), stride_idx_count=stride_counts,
                  BLOCK_SIZE=block_size, CH=chunk, PAD=PAD, EMIT_TOKENS=emit_tokens, HAS_COUNTS=has_counts)
    launch_kernel(single_row_plan_kernel, (rows - row_start,),
        indices, block_table, token_to_req, positions, seq_lens, ids, masks, counts, unsorted, num_unsorted,
        keys, idx_counts, row_start, **common, ONE_CHUNK=one_chunk, ASCENDING_STEPS=steps,
        SORT_W=block_w if in_row else 0,
        num_warps=num_warps or max(4, min(16, chunk // 128)),
        **launch_options(device))
    if one_chunk or in_row:
        return
    facts = utils.device_facts(str(device))
    programs = max(1, min(rows - row_start, facts["sm_count"] if facts["kind"] == "cuda" else 2))
    keys = owned(torch.empty((programs, block_w), dtype=torch.int32, device=device))
    launch_kernel(single_row_sort_plan_kernel, (programs,),
        indices, block_table, token_to_req, positions, seq_lens, ids, masks, counts, unsorted, num_unsorted,
        keys, idx_counts, programs, **common, BLOCK_W=block_w, num_warps=max(4, min(16, block_w // 256)),
        **launch_options(device))


def physical_order(plan: GroupedPlan) -> GroupedPlan:
    """The same grouped plan with each group's entries sorted by physical id.

    A demonstration of the defect the logical order fixes: with this order the kernel's tile
    sequence, and so its rounding, follows where the allocator put the pages. Never used by a route.
    """
    o_e = torch.arange(plan.capacity, device=plan.mb_ids.device)
    live = o_e[None, :] < plan.counts[:, None]
    key = torch.where(live, plan.mb_ids.long(), torch.iinfo(torch.int64).max)
    order = torch.sort(key, dim=1, stable=True).indices
    ids = torch.gather(plan.mb_ids, 1, order)
    masks = torch.gather(plan.masks, 1, order)
    padded = o_e[None, :] < (plan.counts[:, None] + PAD - 1) // PAD * PAD
    pad_entry = ~live & padded
    ids = torch.where(pad_entry, ids[:, :1], ids)
    masks = torch.where(pad_entry, torch.zeros_like(masks), masks)
    return GroupedPlan(ids, masks, plan.counts.clone(), plan.group_rows, plan.num_rows, plan.block_size,
                       plan.num_blocks)
