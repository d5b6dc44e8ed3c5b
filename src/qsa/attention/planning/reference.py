"""Pure-PyTorch references of the page4 planners and a plan comparer.

:func:`reference_single_row_plan` and :func:`reference_grouped_plan` rebuild
:class:`~qsa.attention.planning.plan.SingleRowPlan` / :class:`~qsa.attention.planning.plan.GroupedPlan`
from the raw inputs with loops over rows and tokens, exactly as :mod:`qsa.attention.planning.plan`
documents them (the kept tokens as :func:`qsa.attention.reference.kept_tokens` defines them);
:func:`compare_plans` compares two plans entry by entry.
"""

from __future__ import annotations

import torch

from ...utils import INT32_MAX, check_tensor, round_up
from ..reference import INDEX_DTYPES, kept_tokens
from .plan import MAX_GROUP_ROWS, PAD, GroupedPlan, SingleRowPlan, grouped_capacity, single_row_capacity


def _plan_inputs(indices, block_table, token_to_req, positions, seq_lens, block_size, num_blocks):
    check_tensor("indices", indices, ndim=2, dtypes=INDEX_DTYPES, what="[rows, W]")
    rows = indices.shape[0]
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, what="[num_reqs, max_blocks]")
    check_tensor("token_to_req", token_to_req, dtypes=INDEX_DTYPES, shape=(rows,), what="[rows]")
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(rows,), what="[rows]")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(block_table.shape[0],), what="[num_reqs]")
    if block_size <= 0 or block_size % 4 != 0:
        raise ValueError(f"block_size must be a positive multiple of 4, got {block_size}")
    if num_blocks * (block_size // 4) - 1 > INT32_MAX:
        raise ValueError(f"num_blocks * block_size // 4 = {num_blocks * (block_size // 4)} microblock ids "
                         f"do not fit int32")
    return (indices.tolist(), block_table.tolist(), token_to_req.tolist(), positions.tolist(),
            seq_lens.tolist())


def _pad(ids: list, masks: list) -> None:
    """Append ``(ids[0], 0)`` entries up to a multiple of PAD (nothing for an empty list)."""
    if ids:
        extra = round_up(len(ids), PAD) - len(ids)
        ids.extend([ids[0]] * extra)
        masks.extend([0] * extra)


def reference_single_row_plan(indices, block_table, token_to_req, positions, seq_lens, *,
                              block_size: int, num_blocks: int) -> SingleRowPlan:
    """The single-row page4 plan built with Python loops (see :class:`qsa.attention.planning.plan.SingleRowPlan`).

    Per row: kept tokens (docs/spec.md section 4) grouped by logical microblock ``t // 4``, ascending; id
    ``block_table[req, t // block_size] * (block_size // 4) + (t % block_size) // 4``; mask bit
    ``t % 4``. Padded with ``(first id, mask 0)`` to a multiple of PAD; entries past that are 0.
    """
    idx, table, t2r, pos, lens = _plan_inputs(indices, block_table, token_to_req, positions, seq_lens,
                                              block_size, num_blocks)
    rows = len(idx)
    cap = single_row_capacity(indices.shape[1])
    mb_ids = torch.zeros(rows, cap, dtype=torch.int32)
    masks = torch.zeros(rows, cap, dtype=torch.uint8)
    counts = torch.zeros(rows, dtype=torch.int32)
    per_block = block_size // 4
    for r in range(rows):
        by_lm: dict[int, int] = {}
        for t in kept_tokens(idx[r], t2r[r], pos[r], lens, table, block_size, num_blocks):
            by_lm[t // 4] = by_lm.get(t // 4, 0) | (1 << (t % 4))
        row_ids, row_masks = [], []
        for lm in sorted(by_lm):
            t0 = 4 * lm
            row_ids.append(table[t2r[r]][t0 // block_size] * per_block + (t0 % block_size) // 4)
            row_masks.append(by_lm[lm])
        counts[r] = len(row_ids)
        _pad(row_ids, row_masks)
        mb_ids[r, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.int32)
        masks[r, :len(row_masks)] = torch.tensor(row_masks, dtype=torch.uint8)
    dev = indices.device
    return SingleRowPlan(mb_ids.to(dev), masks.to(dev), counts.to(dev), block_size, num_blocks)


def reference_grouped_plan(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                           num_blocks: int, group_rows: int = 8, num_rows: int | None = None) -> GroupedPlan:
    """The grouped page4 plan built with Python loops (see :class:`qsa.attention.planning.plan.GroupedPlan`).

    Rows ``[0, num_rows)`` (default all) in groups of ``group_rows``; kept tokens re-derived here
    (not via :func:`reference_single_row_plan`). Within a group, the requests in the order of their
    first valid row; for each, the union of its rows' logical microblocks, ascending, mask = OR of
    ``row_mask << 4q`` (stored as int32, bit 31 included), id = the microblock's physical id. Padded
    like the single-row plan.
    """
    idx, table, t2r, pos, lens = _plan_inputs(indices, block_table, token_to_req, positions, seq_lens,
                                              block_size, num_blocks)
    if not 1 <= group_rows <= MAX_GROUP_ROWS:
        raise ValueError(f"group_rows must be in [1, {MAX_GROUP_ROWS}], got {group_rows}")
    num_rows = len(idx) if num_rows is None else int(num_rows)
    if not 0 <= num_rows <= len(idx):
        raise ValueError(f"num_rows must be in [0, {len(idx)}], got {num_rows}")
    num_groups = -(-num_rows // group_rows)
    cap = grouped_capacity(indices.shape[1], group_rows)
    mb_ids = torch.zeros(num_groups, cap, dtype=torch.int32)
    masks = torch.zeros(num_groups, cap, dtype=torch.int32)
    counts = torch.zeros(num_groups, dtype=torch.int32)
    num_reqs = len(lens)

    for g in range(num_groups):
        by_req: dict[int, dict[int, int]] = {}  # request (first-row order) -> logical microblock -> mask
        for q, r in enumerate(range(g * group_rows, min((g + 1) * group_rows, num_rows))):
            req, p = t2r[r], pos[r]
            if req < 0 or req >= num_reqs or p < 0:
                continue
            row = table[req]
            union = by_req.setdefault(req, {})
            for t in set(idx[r]):
                lb = t // block_size
                if 0 <= t < lens[req] and t <= p and lb < len(row) and 0 <= row[lb] < num_blocks:
                    union[t // 4] = union.get(t // 4, 0) | (1 << (t % 4 + 4 * q))
        group_ids, group_masks = [], []
        for req, union in by_req.items():
            for lm in sorted(union):
                group_ids.append(table[req][lm * 4 // block_size] * (block_size // 4) + lm % (block_size // 4))
                group_masks.append(union[lm] - (1 << 32) if union[lm] >= 1 << 31 else union[lm])
        counts[g] = len(group_ids)
        _pad(group_ids, group_masks)
        mb_ids[g, :len(group_ids)] = torch.tensor(group_ids, dtype=torch.int32)
        masks[g, :len(group_masks)] = torch.tensor(group_masks, dtype=torch.int32)
    dev = indices.device
    return GroupedPlan(mb_ids.to(dev), masks.to(dev), counts.to(dev), group_rows, num_rows, block_size,
                       num_blocks)


def compare_plans(a, b, *, ignore_ids: bool = False, mapping: torch.Tensor | None = None,
                  max_messages: int = 20) -> list[str]:
    """Differences between two plans of the same kind; an empty list when they agree.

    Counts must be equal, and ids and masks equal over each list's padded length
    ``round_up(count, PAD)``; entries past it are not compared.

    Args:
        ignore_ids: compare counts and masks only.
        mapping: int64 ``[num_blocks_a]`` relocation (``mapping[old] = new``, see
            :func:`qsa.cache.relocate`): ``b`` must be ``a`` with each id's physical block mapped
            (offset inside the block kept), masks, counts and order unchanged.
        max_messages: stop after this many differences.
    """
    if type(a) is not type(b):
        return [f"plan types differ: {type(a).__name__} vs {type(b).__name__}"]
    msgs = []
    if a.block_size != b.block_size:
        msgs.append(f"block_size differs: {a.block_size} vs {b.block_size}")
    if isinstance(a, GroupedPlan) and (a.group_rows, a.num_rows) != (b.group_rows, b.num_rows):
        msgs.append(f"(group_rows, num_rows) differ: {(a.group_rows, a.num_rows)} vs "
                    f"{(b.group_rows, b.num_rows)}")
    if a.counts.shape != b.counts.shape:
        msgs.append(f"number of lists differs: {a.counts.shape[0]} vs {b.counts.shape[0]}")
    if msgs:
        return msgs
    kind = "group" if isinstance(a, GroupedPlan) else "row"
    per_block = a.block_size // 4
    map_list = mapping.tolist() if mapping is not None else None
    ca, cb = a.counts.tolist(), b.counts.tolist()
    ids_a, ids_b = a.mb_ids.cpu(), b.mb_ids.cpu()
    masks_a, masks_b = a.masks.cpu(), b.masks.cpu()
    for i, (na, nb) in enumerate(zip(ca, cb)):
        if len(msgs) >= max_messages:
            break
        if na != nb:
            msgs.append(f"{kind} {i}: count {na} vs {nb}")
            continue
        n = round_up(na, PAD)
        if n > min(a.capacity, b.capacity):
            msgs.append(f"{kind} {i}: padded count {n} exceeds capacity {min(a.capacity, b.capacity)}")
            continue
        ma, mb = masks_a[i, :n].tolist(), masks_b[i, :n].tolist()
        if ma != mb:
            j = next(j for j in range(n) if ma[j] != mb[j])
            msgs.append(f"{kind} {i}: masks differ first at entry {j}: {ma[j]} vs {mb[j]}")
        if ignore_ids:
            continue
        ia, ib = ids_a[i, :n].tolist(), ids_b[i, :n].tolist()
        if map_list is not None:
            ia = [map_list[x // per_block] * per_block + x % per_block
                  if 0 <= x // per_block < len(map_list) else -1 for x in ia]
        if ia != ib:
            j = next(j for j in range(n) if ia[j] != ib[j])
            what = "mapped ids" if map_list is not None else "ids"
            msgs.append(f"{kind} {i}: {what} differ first at entry {j}: {ia[j]} vs {ib[j]}")
    return msgs[:max_messages]
