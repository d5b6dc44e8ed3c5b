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
