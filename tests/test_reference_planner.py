"""The reference page4 planners: hand-written expected plans, the widest group, agreement with a
vectorised derivation from the attention token sets, relocation and permutation invariance."""

import pytest
import torch

from qsa.cache.paged import BlockAllocator, collision_prone_num_blocks, random_mapping
from qsa.attention.planning.plan import grouped_capacity, GroupedPlan, PAD, single_row_capacity, SingleRowPlan
from helpers import make_attention_case
from qsa.attention.planning.reference import compare_plans, reference_grouped_plan, reference_single_row_plan


def _i32(x: int) -> int:
    """A 32-bit mask pattern as the int32 value a plan stores."""
    return x - (1 << 32) if x >= 1 << 31 else x


def _entries(plan, i):
    """Real entries ``[(id, mask), ...]`` of row/group ``i``."""
    n = int(plan.counts[i])
    return list(zip(plan.mb_ids[i, :n].tolist(), plan.masks[i, :n].tolist()))


def _padding_ok(plan, i):
    n = int(plan.counts[i])
    ids = plan.mb_ids[i, n:-(-n // PAD) * PAD].tolist()
    masks = plan.masks[i, n:-(-n // PAD) * PAD].tolist()
    return all(x == int(plan.mb_ids[i, 0]) for x in ids) and not any(masks)


# Hand-made case, block_size 8 (two microblocks per block), num_blocks 10:
#   req 0: table [5, 2, 7], seq_len 20      req 1: table [5, 9, 12], seq_len 24 (shares block 5; 12 invalid)
#   req 2: table [-1, 3, -1], seq_len 16
HAND_TABLE = [[5, 2, 7], [5, 9, 12], [-1, 3, -1]]
HAND_SEQ = [20, 24, 16]
HAND_ROWS = [  # (req, pos, indices)
    (0, 19, [17, 0, 1, 2, 3, 8, 9, 10, 11, 19, 3, -1, 20]),  # dup 3; 20 >= seq_len; tail {17, 19}
    (1, 10, [6, 4, 10, 12, 5, 2]),                           # 12 > pos; aliases req 0's block 5
    (1, 23, [16, 17, 0]),                                    # 16, 17 sit in invalid block 12
    (0, -1, [0, 1]),                                         # padding row: position -1
    (3, 5, [0, 1]),                                          # padding row: request out of range
    (2, 15, [0, 8, 9, 15, 12, -1]),                          # 0 sits in a -1 block
    (-1, 0, [-1]),                                           # all -1, invalid request
    (0, 9, [9, 8, 1, 0, 9, 3]),                              # group row 7: mask bit 31
    (1, 5, [5, 0]),                                          # row 8: second group
]
# Single-row plan: id = block * 2 + (t % 8) // 4, mask bit t % 4, ascending logical microblock.
HAND_SINGLE = [
    [(10, 0xF), (4, 0xF), (14, 0xA)],
    [(10, 0x4), (11, 0x7), (18, 0x4)],
    [(10, 0x1)],
    [],
    [],
    [(6, 0x3), (7, 0x9)],
    [],
    [(10, 0xB), (4, 0x3)],
    [(10, 0x1), (11, 0x2)],
]
HAND_GROUPED = {  # group_rows -> per group [(id, mask)]: requests by first row, logical order in each
    8: [[(10, _i32(0xB000000F)), (4, 0x3000000F), (14, 0xA), (10, 0x140), (11, 0x70), (18, 0x40),
         (6, 0x300000), (7, 0x900000)],
        [(10, 0x1), (11, 0x2)]],
    4: [[(10, 0xF), (4, 0xF), (14, 0xA), (10, 0x140), (11, 0x70), (18, 0x40)],
        [(6, 0x30), (7, 0x90), (10, _i32(0xB000)), (4, 0x3000)],
        [(10, 0x1), (11, 0x2)]],
    1: [list(row) for row in HAND_SINGLE],
}


def _hand_inputs(permute_seed=None):
    width = max(len(ix) for _, _, ix in HAND_ROWS)
    rows = []
    for _, _, ix in HAND_ROWS:
        ix = ix + [-1] * (width - len(ix))
        if permute_seed is not None:
            perm = torch.randperm(width, generator=torch.Generator().manual_seed(permute_seed + len(rows)))
            ix = [ix[i] for i in perm.tolist()]
        rows.append(ix)
    return dict(indices=torch.tensor(rows, dtype=torch.int32),
                block_table=torch.tensor(HAND_TABLE, dtype=torch.int32),
                token_to_req=torch.tensor([r for r, _, _ in HAND_ROWS], dtype=torch.int32),
                positions=torch.tensor([p for _, p, _ in HAND_ROWS], dtype=torch.int64),
                seq_lens=torch.tensor(HAND_SEQ, dtype=torch.int32), block_size=8, num_blocks=10)


class TestHandCases:
    def test_single_row(self):
        plan = reference_single_row_plan(**_hand_inputs())
        assert isinstance(plan, SingleRowPlan)
        assert plan.mb_ids.dtype == torch.int32 and plan.masks.dtype == torch.uint8
        assert plan.counts.dtype == torch.int32
        assert plan.capacity == single_row_capacity(13) == 16 and plan.num_rows == 9
        assert (plan.block_size, plan.num_blocks) == (8, 10)
        assert plan.counts.tolist() == [len(e) for e in HAND_SINGLE]
        for r, want in enumerate(HAND_SINGLE):
            assert _entries(plan, r) == want, f"row {r}"
            assert _padding_ok(plan, r)
        # Padding written out for row 0: entries 3..15 are (first id, mask 0).
        assert plan.mb_ids[0].tolist() == [10, 4, 14] + [10] * 13
        assert plan.masks[0].tolist() == [0xF, 0xF, 0xA] + [0] * 13

    @pytest.mark.parametrize("group_rows", [8, 4, 1])
    def test_grouped(self, group_rows):
        plan = reference_grouped_plan(**_hand_inputs(), group_rows=group_rows)
        want = HAND_GROUPED[group_rows]
        assert isinstance(plan, GroupedPlan)
        assert plan.mb_ids.dtype == torch.int32 and plan.masks.dtype == torch.int32
        assert (plan.group_rows, plan.num_rows, plan.num_groups) == (group_rows, 9, len(want))
        assert plan.capacity == grouped_capacity(13, group_rows)
        assert plan.counts.tolist() == [len(e) for e in want]
        for g, entries in enumerate(want):
            assert _entries(plan, g) == entries, f"group {g}"
            assert _padding_ok(plan, g)

    def test_grouped_num_rows(self):
        plan = reference_grouped_plan(**_hand_inputs(), num_rows=5)
        assert plan.num_groups == 1 and plan.num_rows == 5
        assert _entries(plan, 0) == [(10, 0xF), (4, 0xF), (14, 0xA), (10, 0x140), (11, 0x70), (18, 0x40)]
        empty = reference_grouped_plan(**_hand_inputs(), num_rows=0)
        assert empty.num_groups == 0

    def test_permuted_entries_give_identical_plans(self):
        base_s = reference_single_row_plan(**_hand_inputs())
        base_g = reference_grouped_plan(**_hand_inputs())
        for seed in range(3):
            inputs = _hand_inputs(permute_seed=seed)
            assert not torch.equal(inputs["indices"], _hand_inputs()["indices"])
            assert compare_plans(base_s, reference_single_row_plan(**inputs)) == []
            assert compare_plans(base_g, reference_grouped_plan(**inputs)) == []

    def test_empty_groups(self):
        inputs = _hand_inputs()
        inputs["token_to_req"] = torch.full_like(inputs["token_to_req"], -1)
        plan = reference_grouped_plan(**inputs, group_rows=4)
        assert plan.counts.tolist() == [0, 0, 0]
        assert reference_single_row_plan(**inputs).counts.tolist() == [0] * 9

    def test_self_aliasing_request(self):
        """A table mapping two logical blocks of one request to one physical block: both plans keep
        two entries with the same id (the union is by logical microblock)."""
        inputs = dict(indices=torch.tensor([[0, 1, 6]], dtype=torch.int32),
                      block_table=torch.tensor([[3, 3]], dtype=torch.int32),
                      token_to_req=torch.zeros(1, dtype=torch.int32),
                      positions=torch.tensor([7]), seq_lens=torch.tensor([8], dtype=torch.int32),
                      block_size=4, num_blocks=4)
        assert _entries(reference_single_row_plan(**inputs), 0) == [(3, 0x3), (3, 0x4)]
        assert _entries(reference_grouped_plan(**inputs), 0) == [(3, 0x3), (3, 0x4)]

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="block_size"):
            reference_single_row_plan(**{**_hand_inputs(), "block_size": 6})
        with pytest.raises(ValueError, match="group_rows"):
            reference_grouped_plan(**_hand_inputs(), group_rows=9)
        with pytest.raises(ValueError, match="num_rows"):
            reference_grouped_plan(**_hand_inputs(), num_rows=10)
        with pytest.raises(TypeError, match="indices must have dtype"):
            reference_single_row_plan(**{**_hand_inputs(), "indices": torch.zeros(9, 2)})
        with pytest.raises(ValueError, match="do not fit int32"):
            reference_grouped_plan(**{**_hand_inputs(), "num_blocks": 2**30 + 1})


class TestWidestGroup:
    """Eight rows, each with 512 complete 4-blocks plus a 3-token tail: the capacity case."""

    NB_LOGICAL = 600  # logical 4-blocks per request before the tail
    WIDTH = 4 * 512 + 3

    def _build(self, same_request: bool, block_size: int = 16):
        g = torch.Generator().manual_seed(11)
        seq_len = 4 * self.NB_LOGICAL + 3
        num_reqs = 1 if same_request else 8
        blocks_per_req = -(-seq_len // block_size)
        alloc = BlockAllocator(num_reqs * blocks_per_req + 1, block_size, generator=g)
        for r in range(num_reqs):
            alloc.allocate(r, seq_len)
        table = alloc.block_table(range(num_reqs))
        rows, chosen = [], []
        for q in range(8):
            if same_request and q > 0:
                picks = chosen[0]
            else:
                picks = torch.randperm(self.NB_LOGICAL, generator=g)[:512].sort().values
            chosen.append(picks)
            toks = (picks[:, None] * 4 + torch.arange(4)).flatten()
            toks = torch.cat([toks, torch.arange(seq_len - 3, seq_len)])
            rows.append(toks[torch.randperm(self.WIDTH, generator=g)])
        inputs = dict(indices=torch.stack(rows).to(torch.int32), block_table=table,
                      token_to_req=torch.tensor([0 if same_request else q for q in range(8)],
                                                dtype=torch.int32),
                      positions=torch.full((8,), seq_len - 1), seq_lens=torch.full((num_reqs,), seq_len,
                                                                                      dtype=torch.int32),
                      block_size=block_size, num_blocks=alloc.num_blocks)
        # Expected single-row entries, straight from the construction.
        per_block = block_size // 4
        expect = []
        for q in range(8):
            lm = torch.cat([chosen[q], torch.tensor([self.NB_LOGICAL])])
            req = 0 if same_request else q
            ids = table[req, lm // per_block].long() * per_block + lm % per_block
            masks = [0xF] * 512 + [0x7]
            expect.append(list(zip(ids.tolist(), masks)))
        return inputs, expect

    def test_distinct_requests(self):
        inputs, expect = self._build(same_request=False)
        single = reference_single_row_plan(**inputs)
        assert single.counts.tolist() == [513] * 8 and single.capacity == single_row_capacity(self.WIDTH)
        for q in range(8):
            assert _entries(single, q) == expect[q]
            assert _padding_ok(single, q)
        grouped = reference_grouped_plan(**inputs)
        assert grouped.counts.tolist() == [8 * 513] and grouped.capacity == grouped_capacity(self.WIDTH, 8)
        want = [(i, _i32(m << (4 * q))) for q in range(8) for i, m in expect[q]]
        assert _entries(grouped, 0) == want
        assert _padding_ok(grouped, 0)

    def test_one_request_all_rows(self):
        inputs, expect = self._build(same_request=True)
        grouped = reference_grouped_plan(**inputs)
        assert grouped.counts.tolist() == [513]
        tail_id = expect[0][512][0]
        assert _entries(grouped, 0) == [(i, -1) for i, _ in expect[0][:512]] + [(tail_id, 0x77777777)]


def _vectorised_single_entries(case):
    """Per row: its request (None for a padding row) and its entries ``[(logical microblock, id, mask)]``,
    derived from a dense token mask (independent of the planners)."""
    bs = case.cache.block_size
    table = case.block_table.long()
    num_reqs, max_blocks = table.shape
    span = max_blocks * bs
    req, pos, idx = case.token_to_req.long(), case.positions.long(), case.indices.long()
    row_ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    rc = req.clamp(0, num_reqs - 1)
    lb = torch.div(idx, bs, rounding_mode="floor")
    phys = table[rc[:, None], lb.clamp(0, max_blocks - 1)]
    keep = row_ok[:, None] & (idx >= 0) & (lb < max_blocks) & (idx < case.seq_lens.long()[rc][:, None]) \
        & (idx <= pos[:, None]) & (phys >= 0) & (phys < case.cache.num_blocks)
    mask = torch.zeros(idx.shape[0], span + 1, dtype=torch.long)
    mask.scatter_(1, torch.where(keep, idx, span), 1)
    bits = (mask[:, :span].view(-1, span // 4, 4) << torch.arange(4)).sum(-1)  # [rows, span // 4]
    out = []
    for r in range(idx.shape[0]):
        lms = torch.nonzero(bits[r]).flatten()
        ids = table[rc[r], lms * 4 // bs] * (bs // 4) + lms % (bs // 4)
        out.append((int(req[r]) if row_ok[r] else None, list(zip(lms.tolist(), ids.tolist(), bits[r, lms].tolist()))))
    return out


def _grouped_from_single(rows, group_rows):
    """Re-derive grouped entries from per-row entries: union by (request, logical microblock), requests
    by first row, ascending microblocks, masks shifted by 4q."""
    groups = []
    for start in range(0, len(rows), group_rows):
        by_req = {}
        for q, (req, entries) in enumerate(rows[start:start + group_rows]):
            if req is None:
                continue
            union = by_req.setdefault(req, {})
            for lm, i, m in entries:
                union[lm] = (i, union.get(lm, (i, 0))[1] | (m << (4 * q)))
        groups.append([(union[lm][0], _i32(union[lm][1])) for union in by_req.values() for lm in sorted(union)])
    return groups


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_planners_match_token_sets(block_size, seed):
    case = make_attention_case(rows=21, num_reqs=4, block_size=block_size, width=40, max_seq_len=150,
                               seed=seed, padding_rows=3)
    want = _vectorised_single_entries(case)
    single = reference_single_row_plan(**case.plan_inputs())
    for r, (_, entries) in enumerate(want):
        assert _entries(single, r) == [(i, m) for _, i, m in entries], f"row {r}"
        assert _padding_ok(single, r)
    for group_rows in (8, 3):
        grouped = reference_grouped_plan(**case.plan_inputs(), group_rows=group_rows)
        for g, entries in enumerate(_grouped_from_single(want, group_rows)):
            assert _entries(grouped, g) == entries, f"group {g}"
            assert _padding_ok(grouped, g)
    assert sum(single.counts.tolist()) > 0


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("collision_prone", [False, True])
def test_relocation_only_changes_ids(block_size, collision_prone):
    case = make_attention_case(rows=19, num_reqs=4, block_size=block_size, width=32, max_seq_len=120,
                               seed=block_size)
    nb = case.cache.num_blocks
    n_out = collision_prone_num_blocks(nb) if collision_prone else nb
    mapping = random_mapping(nb, num_blocks_out=n_out, collision_prone=collision_prone,
                             generator=torch.Generator().manual_seed(5))
    table = case.block_table
    valid = (table >= 0) & (table < nb)
    new_table = torch.where(valid, mapping[table.long().clamp(0, nb - 1)], -1).to(torch.int32)
    moved = {**case.plan_inputs(), "block_table": new_table, "num_blocks": n_out}
    for planner in (reference_single_row_plan, reference_grouped_plan):
        a, b = planner(**case.plan_inputs()), planner(**moved)
        assert compare_plans(a, b, mapping=mapping) == []
        assert compare_plans(a, b, ignore_ids=True) == []
        assert compare_plans(a, b) != []  # the ids did move
    if collision_prone:
        # The moved ids all agree modulo 1024: they pile up in any small power-of-two hash table.
        grouped = reference_grouped_plan(**moved)
        ids = torch.cat([grouped.mb_ids[i, :int(n)] for i, n in enumerate(grouped.counts)])
        assert (ids % 1024).unique().numel() <= block_size // 4 < ids.unique().numel()


class TestComparePlans:
    @pytest.fixture
    def plans(self):
        inputs = _hand_inputs()
        return reference_single_row_plan(**inputs), reference_grouped_plan(**inputs)

    def _clone(self, plan):
        fields = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(plan).items()}
        return type(plan)(**fields)

    def test_equal_plans(self, plans):
        for p in plans:
            assert compare_plans(p, self._clone(p)) == []

    @pytest.mark.parametrize("which", [0, 1])
    @pytest.mark.parametrize("edit", ["count", "mask", "id", "padding_mask", "padding_id"])
    def test_detects_differences(self, plans, which, edit):
        a = plans[which]
        b = self._clone(a)
        n = int(b.counts[0])
        if edit == "count":
            b.counts[0] -= 1
        elif edit == "mask":
            b.masks[0, 1] ^= 1
        elif edit == "id":
            b.mb_ids[0, 2] += 1
        elif edit == "padding_mask":
            b.masks[0, n] = 1
        else:
            b.mb_ids[0, n + 1] += 1
        assert compare_plans(a, b) != []

    def test_ignores_entries_past_padding(self, plans):
        a = plans[0]
        assert int(a.counts[3]) == 0  # an empty row: nothing of it is compared but its count
        c = self._clone(a)
        c.mb_ids[3, :] = 777
        c.masks[3, :] = 9
        assert compare_plans(a, c) == []

    def test_kind_mismatch(self, plans):
        assert compare_plans(*plans) != []
