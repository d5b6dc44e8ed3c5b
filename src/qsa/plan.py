"""Page4 planning: turn each row's token selection into microblock work lists.

A *microblock* is 4 consecutive token slots of one physical KV block. Its id is
``physical_block * (block_size // 4) + (token % block_size) // 4``; token ``t`` of a request sits in
microblock ``t // 4`` of the request's logical space, at mask bit ``t % 4``.

Row validity (SPEC section 4): row ``r`` with ``req = token_to_req[r]`` is a padding row unless
``0 <= req < num_reqs`` and ``positions[r] >= 0``. Token ``t`` of ``indices[r]`` is kept iff
``0 <= t < seq_lens[req]``, ``t <= positions[r]``, ``t // block_size < max_blocks`` and
``0 <= block_table[req, t // block_size] < num_blocks``. Everything else is dropped and never read.

Two plans (see ``docs/planner.md`` for the derivation):

* :class:`SingleRowPlan` -- per row, the distinct logical microblocks of its kept tokens in ascending
  logical order, each with a 4-bit mask (bit ``t % 4``). Order depends only on logical data, so
  shuffling a row's indices or moving pages leaves everything but the ids unchanged.
* :class:`GroupedPlan` -- per group of ``group_rows`` adjacent rows, the union of the rows' entries by
  *physical* microblock (aliased pages merge, masks OR with row ``q`` in bits ``4q..4q+3``), emitted in
  ascending order of the key ``(q, j)`` of its first occurrence: ``q`` the smallest contributing group
  row, ``j`` the entry's position in that row's single-row plan (so the key is logical data only).

Both pad their lists with entries ``(first id, mask 0)`` up to a multiple of :data:`PAD` so kernels read
whole tiles without bounds checks; entries past the padded count are unspecified. An empty list has no
padding. Both planners run on the tensors' device with no host synchronisation and fixed output shapes,
so they can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .utils import INT32_MAX, check_tensor, next_pow2, round_up

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
        mb_ids: ``[num_groups, cap]`` int32. Physical microblock ids, each at most once per group.
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


@dataclass
class PlanWorkspace:
    """Scratch of the grouped planner: one open-addressing table per program.

    The kernel leaves every table empty when it finishes, so one workspace serves any number of
    calls (and CUDA-graph replays) on one stream.

    Attributes:
        table_ids: ``[programs, table]`` int32, -1 when empty.
        table_keys: ``[programs, table]`` int32, INT32_MAX when empty.
        table_masks: ``[programs, table]`` int32, 0 when empty.
        slots: ``[programs, group_rows * cap_s]`` int32, the slot of each entry of the current group.

    ``table`` is a power of two above the most entries a group can have, so probing ends; a group
    uses the smallest power of two at least twice its entries.
    """

    table_ids: torch.Tensor
    table_keys: torch.Tensor
    table_masks: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def allocate(cls, *, index_width: int, group_rows: int, programs: int, device) -> "PlanWorkspace":
        cap_s = single_row_capacity(index_width)
        table = next_pow2(group_rows * cap_s + 1)
        return cls(
            table_ids=torch.full((programs, table), -1, dtype=torch.int32, device=device),
            table_keys=torch.full((programs, table), INT32_MAX, dtype=torch.int32, device=device),
            table_masks=torch.zeros((programs, table), dtype=torch.int32, device=device),
            slots=torch.zeros((programs, group_rows * cap_s), dtype=torch.int32, device=device),
        )

    @property
    def programs(self) -> int:
        return self.table_ids.shape[0]

    @property
    def table(self) -> int:
        return self.table_ids.shape[1]


def planner_programs(num_groups: int, device) -> int:
    """Persistent grid of the grouped planner: a few programs per SM, never more than groups."""
    from .utils import device_facts

    facts = device_facts(str(torch.device(device)))
    per_device = 4 * facts["sm_count"] if facts["kind"] == "cuda" else 2
    return max(1, min(num_groups, per_device))


def check_plan_inputs(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                      num_blocks: int) -> None:
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
    if not isinstance(block_size, int) or block_size <= 0 or block_size % 4:
        raise ValueError(f"block_size must be a positive multiple of 4, got {block_size!r}")
    if not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
    if num_blocks * (block_size // 4) > INT32_MAX:
        raise ValueError(f"num_blocks * block_size // 4 must fit in int32, got {num_blocks} blocks "
                         f"of {block_size}")
    if width > MAX_INDEX_WIDTH:
        raise ValueError(f"indices must have at most {MAX_INDEX_WIDTH} columns, got {width}")
    if indices.stride(1) != 1:
        raise ValueError("indices must be contiguous in its last dimension")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")


def plan_single_rows(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                     num_blocks: int, out: SingleRowPlan | None = None) -> SingleRowPlan:
    """Build the single-row plan of every row (see the module docstring for the exact contract).

    Args:
        indices: ``[rows, W]`` int32 token indices; -1 and out-of-range values are dropped.
        block_table: ``[num_reqs, max_blocks]`` int32 logical -> physical block.
        token_to_req: ``[rows]`` request of each row.
        positions: ``[rows]`` logical position of each row (-1 for padding rows).
        seq_lens: ``[num_reqs]`` int32.
        block_size: tokens per KV block (multiple of 4).
        num_blocks: physical blocks of the KV cache.
        out: optional plan whose buffers are reused (``[rows, >= single_row_capacity(W)]``).

    Returns:
        SingleRowPlan on ``indices.device``.
    """
    check_plan_inputs(indices, block_table, token_to_req, positions, seq_lens, block_size=block_size,
                      num_blocks=num_blocks)
    rows, width = indices.shape
    cap = single_row_capacity(width)
    if out is None:
        out = SingleRowPlan(
            mb_ids=torch.empty((rows, cap), dtype=torch.int32, device=indices.device),
            masks=torch.empty((rows, cap), dtype=torch.uint8, device=indices.device),
            counts=torch.empty((rows,), dtype=torch.int32, device=indices.device),
            block_size=block_size, num_blocks=num_blocks)
    elif out.num_rows != rows or out.capacity < cap:
        raise ValueError(f"out must hold [{rows}, >= {cap}] entries, got {tuple(out.mb_ids.shape)}")
    out.block_size, out.num_blocks = block_size, num_blocks
    _plan_rows(indices, block_table, token_to_req, positions, seq_lens, block_size, num_blocks,
               out.mb_ids, out.masks, out.counts, emit_tokens=False)
    return out


def plan_groups(single: SingleRowPlan, *, group_rows: int = 8, num_rows: int | None = None,
                out: GroupedPlan | None = None, workspace: PlanWorkspace | None = None) -> GroupedPlan:
    """Build the grouped plan of rows ``[0, num_rows)`` from their single-row plans.

    Args:
        single: the single-row plan of (at least) these rows.
        group_rows: adjacent rows per group, 1..8.
        num_rows: rows to group (default: all rows of ``single``).
        out: optional plan whose buffers are reused.
        workspace: optional planner scratch (see :class:`PlanWorkspace`); allocated when omitted.

    Returns:
        GroupedPlan with ``ceil(num_rows / group_rows)`` groups.
    """
    from .kernels.plan import grouped_plan_kernel

    if not isinstance(group_rows, int) or not 1 <= group_rows <= MAX_GROUP_ROWS:
        raise ValueError(f"group_rows must be an int in [1, {MAX_GROUP_ROWS}], got {group_rows!r}")
    num_rows = single.num_rows if num_rows is None else num_rows
    if not 0 <= num_rows <= single.num_rows:
        raise ValueError(f"num_rows must be in [0, {single.num_rows}], got {num_rows}")
    device = single.mb_ids.device
    cap_s = single.capacity
    num_groups = -(-num_rows // group_rows)
    cap_g = grouped_capacity(cap_s, group_rows)
    if out is None:
        out = GroupedPlan(
            mb_ids=torch.empty((num_groups, cap_g), dtype=torch.int32, device=device),
            masks=torch.empty((num_groups, cap_g), dtype=torch.int32, device=device),
            counts=torch.empty((num_groups,), dtype=torch.int32, device=device),
            group_rows=group_rows, num_rows=num_rows, block_size=single.block_size,
            num_blocks=single.num_blocks)
    elif out.num_groups != num_groups or out.capacity < cap_g:
        raise ValueError(f"out must hold [{num_groups}, >= {cap_g}] entries, got {tuple(out.mb_ids.shape)}")
    out.group_rows, out.num_rows = group_rows, num_rows
    out.block_size, out.num_blocks = single.block_size, single.num_blocks
    if num_groups == 0:
        return out
    if workspace is None:
        workspace = PlanWorkspace.allocate(index_width=cap_s, group_rows=group_rows,
                                           programs=planner_programs(num_groups, device), device=device)
    elif workspace.table <= group_rows * cap_s or workspace.slots.shape[1] < group_rows * cap_s:
        raise ValueError("workspace is too small for this plan: allocate it with the same index width "
                         "and group_rows")
    programs = min(workspace.programs, num_groups)
    grouped_plan_kernel[(programs,)](
        single.mb_ids, single.masks, single.counts,
        out.mb_ids, out.masks, out.counts,
        workspace.table_ids, workspace.table_keys, workspace.table_masks, workspace.slots,
        num_rows, num_groups, programs,
        single.mb_ids.stride(0), single.masks.stride(0), out.mb_ids.stride(0), out.masks.stride(0),
        workspace.slots.shape[1], GROUP_ROWS=group_rows, BLOCK_Q=next_pow2(group_rows), CHUNK=min(1024, next_pow2(group_rows * cap_s)),
        TABLE=workspace.table, PAD=PAD, num_warps=4,
    )
    return out


def token_lists(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept tokens, distinct and ascending (the split-K route's work list).

    Returns:
        tokens: ``[rows, W]`` int32, entries past the row's count unspecified.
        counts: ``[rows]`` int32.
    """
    check_plan_inputs(indices, block_table, token_to_req, positions, seq_lens, block_size=block_size,
                      num_blocks=num_blocks)
    rows, width = indices.shape
    tokens = torch.empty((rows, max(width, 1)), dtype=torch.int32, device=indices.device)
    counts = torch.empty((rows,), dtype=torch.int32, device=indices.device)
    _plan_rows(indices, block_table, token_to_req, positions, seq_lens, block_size, num_blocks,
               tokens, tokens, counts, emit_tokens=True)
    return tokens, counts


def _plan_rows(indices, block_table, token_to_req, positions, seq_lens, block_size, num_blocks,
               ids, masks, counts, *, emit_tokens: bool) -> None:
    """Launch the streaming row planner, then the sorting planner for rows found out of order."""
    from .kernels.plan import single_row_plan_kernel, single_row_sort_plan_kernel
    from .utils import device_facts

    rows, width = indices.shape
    if rows == 0:
        return
    device = indices.device
    unsorted = torch.empty((rows,), dtype=torch.int32, device=device)
    num_unsorted = torch.zeros((1,), dtype=torch.int32, device=device)
    facts = device_facts(str(device))
    # Many rows: short steps keep registers low and the GPU full. Few rows (decode): one long step,
    # since each row's steps run one after another.
    few = facts["kind"] == "cuda" and rows < 2 * facts["sm_count"]
    chunk = min(4096 if few else 512, max(PAD, next_pow2(width)))
    common = dict(W=width, num_reqs=block_table.shape[0], max_blocks=block_table.shape[1],
                  num_blocks=num_blocks, stride_idx_row=indices.stride(0), stride_bt_req=block_table.stride(0),
                  stride_ids_row=ids.stride(0), stride_masks_row=masks.stride(0), BLOCK_SIZE=block_size,
                  CH=chunk, PAD=PAD, EMIT_TOKENS=emit_tokens)
    single_row_plan_kernel[(rows,)](
        indices, block_table, token_to_req, positions, seq_lens, ids, masks, counts, unsorted, num_unsorted,
        **common, num_warps=max(4, min(16, chunk // 128)))
    programs = max(1, min(rows, facts["sm_count"] if facts["kind"] == "cuda" else 2))
    block_w = max(next_pow2(width), PAD)
    keys = torch.empty((programs, block_w), dtype=torch.int32, device=device)
    single_row_sort_plan_kernel[(programs,)](
        indices, block_table, token_to_req, positions, seq_lens, ids, masks, counts, unsorted, num_unsorted,
        keys, programs, **common, BLOCK_W=block_w, num_warps=max(4, min(16, block_w // 256)))


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
