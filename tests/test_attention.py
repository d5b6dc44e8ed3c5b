"""The attention routes against the fp64 reference, their determinism, and their guards."""

import dataclasses

import numpy as np
import pytest
import torch

import qsa
import qsa.attention.grouped.launch
import qsa.attention.kernels
import qsa.attention.launch
import qsa.attention.routing
import qsa.attention.splitk.launch
import qsa.attention.xqa.launch
import qsa.settings
import qsa.utils
from qsa.cache.paged import PagedKVCache, random_mapping
from helpers import assert_bitwise, check_against_reference, make_attention_case, slow
from qsa.attention.reference import assert_close_like_torch, reference_attention

ROUTES = ("grouped", "xqa", "splitk", "invariant")


def check_route(case, route, *, rows_sorted=False, **kwargs):
    """Run ``route`` into NaN-poisoned buffers and compare out and lse with the references."""
    out = torch.full_like(case.q, float("nan"))
    got, lse = case.run(qsa.sparse_paged_attention, route=route, out=out, return_lse=True,
                        rows_sorted=rows_sorted, **kwargs)
    assert got.data_ptr() == out.data_ptr()
    ref, ref_lse = case.run(reference_attention, compute_dtype=torch.float64, **kwargs)
    low, low_lse = case.run(reference_attention, compute_dtype=case.q.dtype, **kwargs)
    return assert_close_like_torch(got, ref, low, lse=lse, ref_lse=ref_lse, torch_lse=low_lse, name=route)


@pytest.mark.parametrize("route", ROUTES + ("reference",))
@pytest.mark.parametrize("dtype,kv_cache_dtype", [(torch.float16, "auto"), (torch.bfloat16, "auto"),
                                                  (torch.float16, "fp8_e4m3"), slow(torch.bfloat16, "fp8_e4m3")])
def test_routes_match_reference(route, dtype, kv_cache_dtype):
    case = make_attention_case(rows=11, num_reqs=3, num_q_heads=6, num_kv_heads=2, head_dim=32,
                               block_size=16, width=24, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                               with_gate=True, seed=1)
    check_route(case, route)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("shape", [
    dict(num_q_heads=12, num_kv_heads=1, head_dim=64, block_size=4, layout="separate"),
    dict(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=32, layout="interleaved"),
    dict(num_q_heads=2, num_kv_heads=2, head_dim=16, block_size=784, layout="interleaved"),
    dict(num_q_heads=6, num_kv_heads=1, head_dim=128, block_size=64, layout="interleaved"),
])
def test_shapes_layouts_and_block_sizes(route, shape):
    case = make_attention_case(rows=7, num_reqs=2, width=20, max_seq_len=120, seed=2, **shape)
    check_route(case, route)


def test_splitk_takes_any_group_size():
    case = make_attention_case(rows=7, num_reqs=2, num_q_heads=3, num_kv_heads=1, head_dim=16, width=16,
                               seed=3)
    check_route(case, "splitk")


@pytest.mark.parametrize("route", ["grouped", "grouped-prefetch", slow("xqa"),
                                   slow("xqa-prefetch"), slow("splitk")])
def test_split_lists_merge_in_order(route, monkeypatch):
    """Long lists cut into splits at fixed positions and merged in order: still exact, and bitwise
    stable under relocation (the page4 routes also with the plan entries loaded a tile ahead, which must
    give the same bits as loading them in their own iteration)."""
    prefetch = route.endswith("-prefetch")
    route = route.replace("-prefetch", "")
    case = make_attention_case(rows=11, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16,
                               block_size=16, width=200, max_seq_len=400, messy=False, seed=4)
    monkeypatch.setattr(qsa.attention.routing, "split_count", lambda programs, max_tiles, per_sm, device, cap=None: 3)

    def use(prefetch):
        small = qsa.settings.SplitConfig(tile_tokens=16, num_warps=4, num_stages=2, prefetch=prefetch)
        monkeypatch.setattr(qsa.attention.xqa.launch, "xqa_config", lambda G, D: small)
        monkeypatch.setattr(qsa.attention.splitk.launch, "splitk_config", lambda G, D, lists=None, kv_fp8=False, sm_count=None: small)
        monkeypatch.setattr(qsa.attention.grouped.launch, "grouped_config", lambda G, D, kv_fp8=False: qsa.settings.GroupedConfig(
            rows_per_prog=8, block_m=16, mb=4, num_warps=4, num_stages=2, prefetch=prefetch))
    use(prefetch)
    check_route(case, route)
    base = _run(case, route)
    mapping = random_mapping(case.cache.num_blocks, generator=torch.Generator().manual_seed(5))
    assert_bitwise(base, _run(case.relocated(mapping), route), "relocation with splits")
    if prefetch:
        use(False)
        assert_bitwise(base, _run(case, route), "prefetch vs no prefetch")


@pytest.mark.parametrize("cols,warps", [slow(8, 2), (16, 4)])
@pytest.mark.parametrize("route", ["xqa", slow("splitk")])
def test_merge_in_column_chunks(route, cols, warps, monkeypatch):
    """The split merge with each head's columns cut over several programs (``qsa.attention.launch.merge_config``):
    exact, out and LSE (every column program stores the same LSE), and bitwise stable under relocation."""
    case = make_attention_case(rows=6, num_reqs=2, num_q_heads=4, num_kv_heads=2, head_dim=32, width=120,
                               max_seq_len=300, with_gate=True, seed=9)
    monkeypatch.setattr(qsa.attention.routing, "split_count", lambda programs, max_tiles, per_sm, device, cap=None: 3)
    monkeypatch.setattr(qsa.attention.launch, "merge_config", lambda splits, d, xqa_lists=None: (cols, warps))
    check_route(case, route)
    mapping = random_mapping(case.cache.num_blocks, generator=torch.Generator().manual_seed(10))
    assert_bitwise(_run(case, route), _run(case.relocated(mapping), route), "relocation with column chunks")


@pytest.mark.parametrize("lazy", [False, True])
def test_grouped_lazy_rescale(lazy, monkeypatch):
    """Scores spread over tens of log2 units, so a lazily rescaled row's reference max moves in some
    tiles and not in others, and differently for each row: still exact, and bitwise stable under
    relocation. (The GPU's warp-skipped multiplies are checked in test_gpu.py.)"""
    case = make_attention_case(rows=16, num_reqs=2, num_q_heads=4, num_kv_heads=1, head_dim=16, width=64,
                               max_seq_len=200, messy=False, seed=7)
    case.q.mul_(8)
    monkeypatch.setattr(qsa.attention.grouped.launch, "grouped_config", lambda G, D, kv_fp8=False: qsa.settings.GroupedConfig(
        rows_per_prog=8, block_m=32, mb=2, num_warps=4, num_stages=2, lazy_rescale=lazy))
    check_route(case, "grouped")
    mapping = random_mapping(case.cache.num_blocks, generator=torch.Generator().manual_seed(8))
    assert_bitwise(_run(case, "grouped"), _run(case.relocated(mapping), "grouped"), "relocation")


def test_scales_and_softmax_scale():
    case = make_attention_case(rows=6, num_reqs=2, num_q_heads=4, num_kv_heads=1, head_dim=16, width=16,
                               kv_cache_dtype="fp8_e4m3", seed=5)
    for route in ROUTES:
        check_route(case, route, softmax_scale=0.3, k_scale=0.7, v_scale=1.9)
        # The kernels scale each row's max, not every score: a negative or zero scale reaches them
        # as a positive one on negated or zeroed queries.
        check_route(case, route, softmax_scale=-0.3, k_scale=0.7, v_scale=1.9)
        check_route(case, route, softmax_scale=0.0)


def test_auto_mixed_batch_is_grouped_plus_xqa():
    case = make_attention_case(rows=69, num_reqs=4, num_q_heads=2, num_kv_heads=1, head_dim=16, width=12,
                               seed=6)
    plan = qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions,
                              case.seq_lens, block_size=16, num_blocks=case.cache.num_blocks,
                              num_q_heads=2, num_kv_heads=1, head_dim=16)
    assert (plan.routes.route, plan.routes.grouped_rows, plan.grouped.num_groups) == ("grouped", 64, 8)
    check_route(case, "auto")


def _run(case, route, **kw):
    return case.run(qsa.sparse_paged_attention, route=route, return_lse=True, **kw)



@pytest.mark.parametrize("route", ["grouped", slow("xqa"), slow("invariant"), "auto"])
def test_bitwise_determinism(route, monkeypatch):
    """Repeats, permuted index entries and page moves (also into a larger cache with collision-prone ids):
    the same bits. On auto a mixed batch: two groups of 8 rows and 5 rows left over to xqa (the grouping
    threshold lowered to 16 rows)."""
    rows = 24
    if route == "auto":
        monkeypatch.setattr(qsa.settings, "GROUPED_MIN_ROWS", 16)
        rows = 21
        mixed = qsa.attention.routing.choose("auto", rows=rows, G=6, head_dim=32, device=torch.device("cpu"))
        assert (mixed.route, mixed.grouped_rows) == ("grouped", 16)
    case = make_attention_case(rows=rows, num_reqs=4, num_q_heads=6, num_kv_heads=1, head_dim=32,
                               block_size=16, width=40, max_seq_len=160, with_gate=True, seed=7)
    base = _run(case, route)
    assert_bitwise(base, _run(case, route), "repeat")
    g = torch.Generator().manual_seed(11)
    assert_bitwise(base, _run(case.with_permuted_indices(g), route), "permuted indices")
    n = case.cache.num_blocks
    mapping = random_mapping(n, generator=g)
    assert_bitwise(base, _run(case.relocated(mapping), route), "relocation")
    mapping = random_mapping(n, generator=g, collision_prone=True)
    moved = case.relocated(mapping, num_blocks_out=int(mapping.max()) + 1)
    assert_bitwise(base, _run(moved, route), "relocation into a larger cache, collision-prone ids")


@pytest.mark.parametrize("dtype,kv_cache_dtype", [slow(torch.float16, "auto"),
                                                  slow(torch.bfloat16, "auto"),
                                                  (torch.float16, "fp8_e4m3")])
def test_splitk_score_halves(dtype, kv_cache_dtype, monkeypatch):
    """splitk with its scores over the head's column halves (``qk_halves``, as shipped at head_dim 256):
    exact on messy rows with splits merged, and bitwise stable under repeats, permuted indices and
    relocation. A known-wrong step that takes one column half of the query twice fails the check."""
    import qsa
    from test_xqa_direct import _one_half_twice

    case = make_attention_case(rows=5, num_reqs=3, num_q_heads=6, num_kv_heads=2, head_dim=32, width=48,
                               max_seq_len=200, dtype=dtype, kv_cache_dtype=kv_cache_dtype, with_gate=True,
                               seed=31)
    assert int((case.indices >= 0).sum(1).max()) > 2 * 16, "a row's list must span the three splits' tiles"
    halves = qsa.settings.SplitConfig(tile_tokens=16, num_warps=4, num_stages=2, qk_halves=True)
    monkeypatch.setattr(qsa.attention.splitk.launch, "splitk_config", lambda G, D, lists=None, kv_fp8=False, sm_count=None: halves)
    monkeypatch.setattr(qsa.attention.routing, "split_count", lambda programs, max_tiles, per_sm, device, cap=None: 3)
    base = _run(case, "splitk", out=torch.full_like(case.q, float("nan")))
    check_against_reference(case, base, "splitk")
    assert_bitwise(base, _run(case, "splitk"), "repeat")
    g = torch.Generator().manual_seed(32)
    assert_bitwise(base, _run(case.with_permuted_indices(g), "splitk"), "permuted indices")
    mapping = random_mapping(case.cache.num_blocks, generator=g)
    assert_bitwise(base, _run(case.relocated(mapping), "splitk"), "relocation")
    monkeypatch.setattr(qsa.attention.kernels, "attend_tile_halves", _one_half_twice)
    with pytest.raises(AssertionError):
        check_route(case, "splitk")


def test_splitk_settings_by_head_dim_and_lists(monkeypatch):
    """The shipped splitk settings: column halves at head_dim 256, the whole head below it; short tiles on
    more stages up to SPLITK_FEW_LISTS lists, and again where the lists take one split each and fit one wave
    of the short kernel on a GPU of known SM count; over an FP8 cache short tiles up to SPLITK_FP8_FEW_LISTS,
    then long tiles on three stages."""
    assert qsa.attention.splitk.launch.splitk_config(6, 256).qk_halves and not qsa.attention.splitk.launch.splitk_config(6, 128).qk_halves
    few, many = qsa.attention.splitk.launch.splitk_config(6, 256, qsa.settings.SPLITK_FEW_LISTS), qsa.attention.splitk.launch.splitk_config(6, 256, qsa.settings.SPLITK_FEW_LISTS + 1)
    assert (few.tile_tokens, few.num_stages) == (32, 4) and (many.tile_tokens, many.num_stages) == (64, 2)
    assert qsa.attention.splitk.launch.splitk_config(6, 256) == many
    # Sized by waves on 132 SMs: the short tiles where the splits (3 programs per SM) fit one wave of
    # SPLITK_SHORT_PER_SM short programs; below the split target otherwise the long tiles in one split each.
    assert few.programs_per_sm == many.programs_per_sm == 3 and qsa.settings.SPLITK_SHORT_PER_SM == 4
    by_lists = {lists: qsa.attention.splitk.launch.splitk_config(6, 256, lists, sm_count=132) for lists in range(qsa.settings.SPLITK_FEW_LISTS + 1, 1200)}
    assert [n for n, c in by_lists.items() if c == few] == [*range(257, 265), *range(396, 529)]
    one = dataclasses.replace(many, programs_per_sm=1)
    assert [n for n, c in by_lists.items() if c == one] == list(range(265, 396))
    assert all(c == many for n, c in by_lists.items() if n >= 529)
    h200 = {"kind": "cuda", "sm_count": 132}
    monkeypatch.setattr(qsa.utils, "device_facts", lambda device: h200)
    cpu = torch.device("cpu")  # with the facts of a 132-SM GPU: the splits the launch gets
    assert [qsa.attention.routing.split_count(n, 33, 3, cpu) for n in (264, 300, 395, 396)] == [2, 2, 2, 1]
    assert all(qsa.attention.routing.split_count(n, 33, one.programs_per_sm, cpu) == 1 for n in (265, 300, 395))
    assert qsa.attention.splitk.launch.splitk_config(6, 256, 512) == many and qsa.attention.splitk.launch.splitk_config(6, 256, 300) == many  # no SM count
    assert qsa.attention.splitk.launch.splitk_config(6, 256, 100, sm_count=132) == few and qsa.attention.splitk.launch.splitk_config(6, 256, 8192, sm_count=132) == many
    few8 = qsa.attention.splitk.launch.splitk_config(6, 256, qsa.settings.SPLITK_FP8_FEW_LISTS, kv_fp8=True)
    many8 = qsa.attention.splitk.launch.splitk_config(6, 256, qsa.settings.SPLITK_FP8_FEW_LISTS + 1, kv_fp8=True)
    assert few8 == few and (many8.tile_tokens, many8.num_stages, many8.qk_halves) == (64, 3, True)
    assert qsa.attention.splitk.launch.splitk_config(6, 256, kv_fp8=True) == many8
    assert all(qsa.attention.splitk.launch.splitk_config(6, 256, n, kv_fp8=True, sm_count=132) == many8 for n in (300, 512))  # no waves


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_splitk_launch_takes_the_settings_of_its_lists(kv_cache_dtype, monkeypatch):
    """splitk_attention asks for the settings of its rows x KV heads, cache dtype and SM count (none on the
    CPU), and every setting it can get is exact: over an FP8 cache the long tiles on three stages and the
    short ones; else the short tiles, and the long ones past the short tiles' bound."""
    seen = []
    shipped = qsa.attention.splitk.launch.splitk_config

    def spy(G, D, lists=None, kv_fp8=False, sm_count=None):
        seen.append((lists, kv_fp8, sm_count))
        cfg = shipped(G, D, lists, kv_fp8, sm_count)
        seen.append((cfg.tile_tokens, cfg.num_stages, cfg.programs_per_sm))
        return cfg
    monkeypatch.setattr(qsa.attention.splitk.launch, "splitk_config", spy)
    fp8 = kv_cache_dtype == "fp8_e4m3"
    case = make_attention_case(rows=9, num_reqs=3, num_q_heads=6, num_kv_heads=2, head_dim=32, width=70,
                               max_seq_len=200, kv_cache_dtype=kv_cache_dtype, with_gate=True, seed=33)
    check_route(case, "splitk")
    assert seen == [(18, fp8, None), (64, 3, 3) if fp8 else (32, 4, 3)]
    seen.clear()
    if fp8:
        monkeypatch.setattr(qsa.settings, "SPLITK_FP8_FEW_LISTS", 18)  # 18 lists take the short tiles
        check_route(case, "splitk")
        assert seen == [(18, True, None), (32, 4, 3)]
    else:
        monkeypatch.setattr(qsa.settings, "SPLITK_FEW_LISTS", 8)  # 18 lists take the long tiles ...
        check_route(case, "splitk")
        assert seen == [(18, False, None), (64, 2, 3)]
        # ... unless the GPU's SM count sizes the launch by waves: on 5 SMs 18 lists fit one wave of short
        # programs in one split each (15 to 20 lists); on 7 SMs two splits would not (21 split target), and
        # the long tiles take one split each.
        for sms, setting in ((5, (32, 4, 3)), (7, (64, 2, 1))):
            seen.clear()
            facts = {"kind": "cuda", "sm_count": sms}
            monkeypatch.setattr(qsa.utils, "device_facts", lambda device, facts=facts: facts)
            check_route(case, "splitk")
            assert seen == [(18, False, sms), setting]


@pytest.mark.parametrize("route", ROUTES)
def test_v_cache_with_its_own_strides(route):
    """K and V caches of different strides (V a view into a wider NaN buffer) give the bits of the
    common layout: the kernels then compute V's offsets apart from K's."""
    case = make_attention_case(rows=9, num_reqs=2, num_q_heads=4, num_kv_heads=2, head_dim=16, width=24,
                               layout="separate", seed=15)
    c = case.cache
    wide = torch.full((c.num_blocks, c.block_size + 4, *c.v.shape[2:]), float("nan"), dtype=c.v.dtype)
    v = wide[:, 2:2 + c.block_size]
    v.copy_(c.v)
    assert v.stride() != c.k.stride()
    args = (case.q, c.k, c.v, case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens)
    base = qsa.sparse_paged_attention(*args, route=route, return_lse=True)
    got = qsa.sparse_paged_attention(*args[:2], v, *args[3:], route=route, return_lse=True)
    assert_bitwise(base, got, "V with its own strides")


def test_padding_and_empty_rows_are_zero():
    case = make_attention_case(rows=10, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=8,
                               padding_rows=4, seed=8)
    case.indices[5] = -1  # an empty set
    for route in ROUTES:
        out, lse = _run(case, route)
        for r in (0, 1, 2, 3, 5):
            assert torch.equal(out[r], torch.zeros_like(out[r])), (route, r)
            assert torch.isneginf(lse[r]).all(), (route, r)


def _sandwiched(cache: PagedKVCache, guard_blocks: int = 3) -> PagedKVCache:
    """The same cache as a view into a larger NaN-filled buffer: reading outside it shows as NaN."""
    nb = cache.num_blocks
    nan = 0x7F if cache.kv_cache_dtype == "fp8_e4m3" else float("nan")
    big = torch.full((nb + 2 * guard_blocks, *cache.storage.shape[1:]), nan, dtype=cache.storage.dtype)
    big[guard_blocks:guard_blocks + nb] = cache.storage
    return PagedKVCache.from_storage(big[guard_blocks:guard_blocks + nb], kv_cache_dtype=cache.kv_cache_dtype,
                                     k_scale=cache.k_scale, v_scale=cache.v_scale)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_adversarial_indices_and_tables_are_never_read(kv_cache_dtype):
    case = make_attention_case(rows=10, num_reqs=3, num_q_heads=2, num_kv_heads=1, head_dim=16, width=24,
                               kv_cache_dtype=kv_cache_dtype, seed=9)
    g = torch.Generator().manual_seed(12)
    wild = torch.tensor([-2**31, -5, 2**31 - 1, 2**30, 10**6], dtype=torch.int32)
    pick = torch.randint(0, 5, case.indices.shape, generator=g)
    swap = torch.rand(case.indices.shape, generator=g) < 0.3
    case.indices[swap] = wild[pick[swap]]
    case.block_table[:, -1] = torch.tensor([2**31 - 1, -2**31, case.cache.num_blocks], dtype=torch.int32)[
        :case.block_table.shape[0]]
    case.cache = _sandwiched(case.cache)
    for route in ROUTES:
        check_route(case, route)


def _two_requests_of_9_rows():
    """Lengths 90 and 146, rows of both requests (two groups of the grouped route), no padding rows: the
    bound tests rewrite its rows."""
    return make_attention_case(rows=9, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16,
                               width=40, max_seq_len=150, padding_rows=0, messy=False, seed=1)


def _check_on_every_path(case, route, order, seed):
    """``route`` ("xqa-direct": xqa with ``rows_sorted``) on the rows as built (ascending: the scan-free
    planner steps and the direct kernel's fast path) or shuffled (the sorts)."""
    if order == "shuffled":
        case = case.with_permuted_indices(torch.Generator().manual_seed(seed))
    if route == "xqa-direct":
        check_route(case, "xqa", rows_sorted=True)
    else:
        check_route(case, route)


@pytest.mark.parametrize("route", ["grouped", "xqa", "xqa-direct", "splitk", "invariant"])
@pytest.mark.parametrize("order", ["ascending", "shuffled"])
def test_a_table_narrower_than_the_lengths(route, order):
    """Lengths and positions past the table's end: tokens whose block lies past it are dropped, whatever
    the route and the planner path (ascending rows take the scan-free and direct paths, shuffled ones the
    sorts). The table is a column slice of the case's own, whose further columns map those tokens to
    real, finite pages: a kernel that reads past the end of a row of the table attends them."""
    case = _two_requests_of_9_rows()
    lens = case.seq_lens.long()[case.token_to_req.long()]
    case.positions = lens - 1 - torch.arange(9) % 3
    g = torch.Generator().manual_seed(16)
    rows = [torch.randperm(int(n), generator=g)[:40].sort().values for n in lens]
    case.indices = torch.stack([torch.cat([r, torch.full((40 - len(r),), -1)]) for r in rows]).to(torch.int32)
    assert bool(((case.indices >= 48) & (case.indices.long() <= case.positions[:, None])).any(1).all())
    case.block_table = case.block_table[:, :3]  # 48 tokens; lengths 90 and 146
    assert case.block_table.stride(0) > 3
    _check_on_every_path(case, route, order, seed=17)


@pytest.mark.parametrize("route", ["grouped", "xqa", "xqa-direct", "splitk", "invariant"])
@pytest.mark.parametrize("order", ["ascending", "shuffled"])
def test_positions_past_the_lengths(route, order):
    """Rows whose position is past their request's length, selecting tokens in between: only
    ``t < seq_len`` drops those, on every route and planner path. Their table entries are valid pages
    whose slots were never written (NaN), so a kernel that keeps them gives NaN."""
    case = _two_requests_of_9_rows()
    lens = case.seq_lens.long()[case.token_to_req.long()]
    case.positions = lens + 8 + torch.arange(9) % 5
    spare = max(set(range(case.cache.num_blocks)) - set(case.block_table.flatten().tolist()))  # never written
    case.block_table[case.block_table < 0] = spare
    g = torch.Generator().manual_seed(18)
    rows = [torch.randperm(int(p) + 1, generator=g)[:40].sort().values for p in case.positions]
    case.indices = torch.stack(rows).to(torch.int32)
    past = (case.indices.long() >= lens[:, None]) & (case.indices.long() <= case.positions[:, None])
    assert bool(past.any(1).all()) and bool((~past).any(1).all())
    _check_on_every_path(case, route, order, seed=19)


@pytest.mark.parametrize("route", ["grouped", "xqa", "xqa-direct", "splitk", "invariant"])
@pytest.mark.parametrize("order", ["ascending", "shuffled"])
def test_positions_at_the_int64_limit(route, order):
    """Positions past INT32_MAX, up to the int64 limit, keep every token below the length (no overflow
    of ``pos + 1`` in any bound), on every route and planner path."""
    case = _two_requests_of_9_rows()
    case.positions[::3] = 2**63 - 1
    case.positions[1::3] = 2**31 - 1
    case.positions[2::3] = 2**31 + 7
    g = torch.Generator().manual_seed(20)
    lens = case.seq_lens.long()[case.token_to_req.long()]
    rows = [torch.randperm(int(n) + 20, generator=g)[:40].sort().values for n in lens]
    case.indices = torch.stack(rows).to(torch.int32)
    _check_on_every_path(case, route, order, seed=21)


def test_cache_scales_apply_to_fp8_only():
    """k_scale and v_scale dequantise an FP8 cache; a cache in q's dtype is read as it is, on every route
    (as the reference reads it)."""
    case = make_attention_case(rows=9, num_reqs=2, num_q_heads=4, num_kv_heads=1, head_dim=16, width=16, seed=5)
    for route in ROUTES:
        check_route(case, route, k_scale=2.0, v_scale=3.0)
        a = case.run(qsa.sparse_paged_attention, route=route, k_scale=2.0, v_scale=3.0)
        assert torch.equal(a, case.run(qsa.sparse_paged_attention, route=route)), route


def test_splitk_plan_refills_its_buffers():
    """``plan_attention(out=plan)`` on the splitk route refills the plan's token lists in place (CUDA-graph
    capture reuses them), with the lists a fresh plan has."""
    case = make_attention_case(rows=6, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=8, seed=13)
    args = (case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens)
    shape = dict(block_size=case.cache.block_size, num_blocks=case.cache.num_blocks, num_q_heads=2,
                 num_kv_heads=1, head_dim=16, route="splitk")
    first = qsa.plan_attention(*args, **shape)
    first.tokens.fill_(-7)
    first.token_counts.fill_(-7)
    again = qsa.plan_attention(*args, **shape, out=first)
    assert again.tokens.data_ptr() == first.tokens.data_ptr()
    assert again.token_counts.data_ptr() == first.token_counts.data_ptr()
    fresh = qsa.plan_attention(*args, **shape)
    assert torch.equal(again.token_counts, fresh.token_counts)
    for r, n in enumerate(fresh.token_counts.tolist()):
        assert torch.equal(again.tokens[r, :n], fresh.tokens[r, :n])
    with pytest.raises(ValueError, match="out tokens"):
        qsa.plan_attention(case.indices[:, :4].contiguous(), *args[1:], **shape, out=first)


def test_out_and_gate_views():
    """gate as the second half of a packed [rows, Hq, 2D] projection; out= written in place."""
    case = make_attention_case(rows=9, num_reqs=2, num_q_heads=4, num_kv_heads=2, head_dim=16, width=12,
                               seed=10)
    packed = torch.randn(9, 4, 32).to(torch.float16)
    case.q, case.gate = packed[..., :16], packed[..., 16:]
    for route in ROUTES:
        check_route(case, route)


def test_bad_inputs_name_the_argument():
    case = make_attention_case(rows=4, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=8,
                               seed=11)
    c = case.cache
    args = [case.q, c.k, c.v, case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens]

    def call(i=None, value=None, **kw):
        a = list(args)
        if i is not None:
            a[i] = value
        return qsa.sparse_paged_attention(*a, route="xqa", **kw)

    with pytest.raises(TypeError, match="q must have dtype"):
        call(0, case.q.float())
    with pytest.raises(ValueError, match=r"q must be 3-D"):
        call(0, case.q[0])
    with pytest.raises(TypeError, match="k_cache"):
        call(1, c.k.float())
    with pytest.raises(ValueError, match="Hq % Hkv"):
        kv2 = torch.zeros(c.num_blocks, c.block_size, 2, 16, dtype=torch.float16)
        qsa.sparse_paged_attention(torch.randn(4, 3, 16).half(), kv2, kv2, *args[3:])
    with pytest.raises(ValueError, match="v_cache"):
        call(2, c.v[:-1])
    with pytest.raises(TypeError, match="indices"):
        call(3, case.indices.long())
    with pytest.raises(ValueError, match="indices must have 4 rows"):
        call(3, case.indices[:2])
    with pytest.raises(ValueError, match="positions"):
        call(6, case.positions[:3])
    with pytest.raises(TypeError, match="seq_lens"):
        call(7, case.seq_lens.long())
    with pytest.raises(ValueError, match="gate"):
        call(gate=case.q[:, :1])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        call(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="route"):
        qsa.sparse_paged_attention(*args, route="fast")
    # 1-D row and request tensors are read at offset i: strided or broadcast ones are refused.
    for i, name in ((5, "token_to_req"), (6, "positions"), (7, "seq_lens")):
        wide = torch.zeros(2 * args[i].shape[0], dtype=args[i].dtype)
        wide[::2] = args[i]
        with pytest.raises(ValueError, match=f"{name} must be contiguous"):
            call(i, wide[::2])
    with pytest.raises(ValueError, match="token_to_req must be contiguous"):
        call(5, case.token_to_req[:1].expand(4))
    for name in ("softmax_scale", "k_scale", "v_scale"):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=f"{name} must be finite"):
                call(**{name: bad})
        with pytest.raises(TypeError, match=f"{name} must be a float"):
            call(**{name: True})
    with pytest.raises(ValueError, match="share memory"):
        call(out=torch.zeros(1, 2, 16, dtype=torch.float16).expand(4, 2, 16))
    for bad_q in (case.q[..., :0], case.q[:, :0]):
        with pytest.raises(ValueError, match="at least one head and a head dim"):
            qsa.sparse_paged_attention(bad_q, *args[1:], route="reference")

    plan_args = args[3:]
    shape = dict(block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=2, num_kv_heads=1, head_dim=16)
    plan = qsa.plan_attention(*plan_args, **shape, route="xqa")
    with pytest.raises(TypeError, match="plan must be an AttentionPlan"):
        qsa.run_attention(None, *args[:3])
    with pytest.raises(TypeError, match="out must be an AttentionPlan"):
        qsa.plan_attention(*plan_args, **shape, out=object())
    with pytest.raises(ValueError, match="the plan was made on meta"):
        moved = tuple(t.to("meta") for t in plan.inputs)
        qsa.run_attention(dataclasses.replace(plan, inputs=moved), *args[:3])
    for name, bad, err in (("num_q_heads", 0, ValueError), ("num_q_heads", -2, ValueError),
                           ("num_kv_heads", None, TypeError), ("head_dim", 16.0, TypeError),
                           ("num_q_heads", True, TypeError)):
        with pytest.raises(err, match=name):
            qsa.plan_attention(*plan_args, **{**shape, name: bad})
    for name in ("num_blocks", "block_size"):
        with pytest.raises(TypeError, match=name):
            qsa.plan_attention(*plan_args, **{**shape, name: True})
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        call(return_lse="yes")
    with pytest.raises(TypeError, match="rows_sorted must be a bool, got numpy.int64"):
        call(rows_sorted=np.int64(1))
    # numpy bools (flags read from arrays) are bools: the same bits as the python bools
    ref_out, ref_lse = call(return_lse=True, rows_sorted=True)
    np_out, np_lse = call(return_lse=np.bool_(True), rows_sorted=np.bool_(True))
    assert torch.equal(np_out, ref_out) and torch.equal(np_lse, ref_lse)
    with pytest.raises(ValueError, match=r"k_cache block_size \(dim 1\) must be a positive multiple of 4"):
        empty = torch.zeros(c.num_blocks, 0, 1, 16, dtype=torch.float16)
        qsa.sparse_paged_attention(case.q, empty, empty, *args[3:], route="xqa")
    # FP8 caches are written as x / scale: every route refuses a scale <= 0, naming it.
    fp8 = make_attention_case(rows=4, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=8,
                              kv_cache_dtype="fp8_e4m3", seed=11)
    for route in ("xqa", "splitk", "invariant", "reference"):
        for name in ("k_scale", "v_scale"):
            for bad in (0.0, -0.5):
                with pytest.raises(ValueError, match=f"{name} must be > 0 for an FP8 cache"):
                    fp8.run(qsa.sparse_paged_attention, route=route, **{name: bad})


def test_plan_out_is_refilled_in_place():
    """``plan_attention(..., out=p)`` returns ``p`` itself, holding the new routes, inputs and work lists:
    running the plan held before the call computes the new batch, on every route (the old batch reads
    other pages through another table); a reused plan must have the same shapes (its launches size their
    splits by its buffers)."""
    new = make_attention_case(rows=4, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=8, seed=11)
    old = new.relocated(random_mapping(new.cache.num_blocks, generator=torch.Generator().manual_seed(3)))
    shape = dict(block_size=new.cache.block_size, num_blocks=new.cache.num_blocks, num_q_heads=2,
                 num_kv_heads=1, head_dim=16)

    def plan(case, **kw):
        return qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions,
                                  case.seq_lens, **shape, **kw)

    for route, rows_sorted in (("grouped", False), ("xqa", False), ("xqa", True), ("splitk", False), ("invariant", False)):
        held = plan(old, route=route, rows_sorted=rows_sorted)
        assert plan(new, route=route, rows_sorted=rows_sorted, out=held) is held
        assert held.inputs[1] is new.block_table
        a = qsa.run_attention(held, new.q, new.cache.k, new.cache.v, return_lse=True)
        b = qsa.run_attention(plan(new, route=route, rows_sorted=rows_sorted), new.q, new.cache.k, new.cache.v,
                              return_lse=True)
        assert_bitwise(a, b, f"{route} (rows_sorted={rows_sorted}): the refilled plan vs a fresh one")
    wider = dataclasses.replace(new, indices=torch.cat([new.indices] * 5, dim=1))
    for route in ("grouped", "xqa"):
        big = plan(wider, route=route)
        with pytest.raises(ValueError, match="a plan of the same shapes"):
            plan(new, route=route, out=big)


# Known-wrong kernels: the comparison used above must reject each of them.

def test_checker_rejects_known_wrong_outputs():
    case = make_attention_case(rows=12, num_reqs=3, num_q_heads=4, num_kv_heads=2, head_dim=16, width=16,
                               seed=12)
    ref, ref_lse = case.run(reference_attention, compute_dtype=torch.float64)
    low, low_lse = case.run(reference_attention, compute_dtype=torch.float16)
    good, lse = _run(case, "grouped")
    assert_close_like_torch(good, ref, low, lse=lse, ref_lse=ref_lse, torch_lse=low_lse)

    wrong = {}
    wrong["zeros"] = (torch.zeros_like(good), lse)
    # Mask ignored: every slot of every selected microblock attended.
    plan = qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions,
                              case.seq_lens, block_size=16, num_blocks=case.cache.num_blocks,
                              num_q_heads=4, num_kv_heads=2, head_dim=16, route="grouped")
    plan.grouped.masks.copy_(torch.where(plan.grouped.masks != 0, -1, 0))
    wrong["mask ignored"] = qsa.run_attention(plan, case.q, case.cache.k, case.cache.v, return_lse=True)
    # KV head j serving the wrong query heads.
    swapped = case.cache.k.flip(2), case.cache.v.flip(2)
    wrong["GQA head mapping"] = qsa.sparse_paged_attention(case.q, *swapped, *case.run(lambda *a, **k: a[3:]),
                                                           route="grouped", return_lse=True)
    wrong["log2 lse"] = (good, lse / 0.6931471805599453)
    wrong["scale ignored"] = _run(case, "grouped", softmax_scale=1.0)
    for name, (out, out_lse) in wrong.items():
        with pytest.raises(AssertionError):
            assert_close_like_torch(out, ref, low, lse=out_lse, ref_lse=ref_lse, torch_lse=low_lse, name=name)
    # A NaN in the PyTorch yardstick (or the reference) makes a NaN bound: that fails, it does not pass.
    nan_low, nan_low_lse = low.clone(), low_lse.clone()
    nan_low[0, 0, 0] = float("nan")
    nan_low_lse[0, 0] = float("nan")
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close_like_torch(torch.zeros_like(good), ref, nan_low)
    with pytest.raises(AssertionError, match="lse: max abs error"):
        assert_close_like_torch(good, ref, low, lse=lse + 1, ref_lse=ref_lse, torch_lse=nan_low_lse)


@pytest.mark.parametrize("route", ROUTES)
def test_self_aliasing_request_counts_both_copies(route):
    """A table mapping two logical blocks of one request to one page: the row's token set holds both
    copies (docs/spec.md section 4), and every route, grouped included, attends both."""
    case = make_attention_case(rows=16, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=8,
                               width=24, max_seq_len=40, messy=False, share_prefix=False, seed=21)
    case.block_table[0, 1] = case.block_table[0, 0]
    rows0 = (case.token_to_req == 0).nonzero().flatten()
    both = [(case.indices[r] // 8 == 0).any() & (case.indices[r] // 8 == 1).any() for r in rows0.tolist()]
    assert any(both), "some row of request 0 must select tokens of both aliased blocks"
    check_route(case, route)


def test_auto_groups_fewer_rows_over_short_contexts_than_over_long_ones(monkeypatch):
    """Over a block table spanning ``GROUPED_LONG_CONTEXT`` tokens or more, auto groups only from
    ``GROUPED_MIN_ROWS_LONG`` rows (xqa below, one request or not); shorter tables, and calls that do not
    say the span, group from ``GROUPED_MIN_ROWS``; plan_attention passes the table's span (at lowered
    thresholds, 16 rows are grouped over a table one token short of a long context, not over a long one)."""
    choose, s = qsa.attention.routing.choose, qsa.settings
    shape = dict(G=6, head_dim=256, device=torch.device("cpu"))
    rows = s.GROUPED_MIN_ROWS_LONG - 71  # 185 rows at the shipped settings
    assert s.GROUPED_MIN_ROWS <= rows < s.GROUPED_MIN_ROWS_LONG
    for mql in (None, rows):
        long = choose("auto", rows=rows, max_query_len=mql, context_tokens=s.GROUPED_LONG_CONTEXT, **shape)
        assert (long.route, long.grouped_rows) == ("xqa", 0)
        short = choose("auto", rows=rows, max_query_len=mql, context_tokens=s.GROUPED_LONG_CONTEXT - 1, **shape)
        assert short.route == "grouped" and short.grouped_rows == (rows if mql else rows // 8 * 8)
        assert choose("auto", rows=rows, max_query_len=mql, **shape).route == "grouped"
    many = choose("auto", rows=s.GROUPED_MIN_ROWS_LONG, context_tokens=4 * s.GROUPED_LONG_CONTEXT, **shape)
    assert many.route == "grouped" and many.grouped_rows == s.GROUPED_MIN_ROWS_LONG
    assert choose("grouped", rows=rows, context_tokens=s.GROUPED_LONG_CONTEXT, **shape).grouped_rows == rows
    monkeypatch.setattr(s, "GROUPED_MIN_ROWS", 8)
    monkeypatch.setattr(s, "GROUPED_MIN_ROWS_LONG", 32)
    case = make_attention_case(rows=16, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=12, seed=7)
    span = case.block_table.shape[1] * 16
    for long_context, grouped in ((span + 1, 16), (span, 0)):
        monkeypatch.setattr(s, "GROUPED_LONG_CONTEXT", long_context)
        plan = qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                                  block_size=16, num_blocks=case.cache.num_blocks, num_q_heads=2, num_kv_heads=1,
                                  head_dim=16)
        assert plan.routes.grouped_rows == grouped, (long_context, plan.routes)


def test_auto_sends_a_decode_batch_to_xqa(monkeypatch):
    """One row per request (max_query_len=1): auto plans no groups, even at ``GROUPED_MIN_ROWS`` rows or
    more (the shipped 64 in the route choice; the plans and runs at the threshold lowered to 16 rows, two
    groups), and computes the same output as without the hint; the layer's step metadata derives the hint
    from its rows."""
    choose, shipped = qsa.attention.routing.choose, qsa.settings.GROUPED_MIN_ROWS
    shape = dict(G=2, head_dim=16, device=torch.device("cpu"))
    assert choose("auto", rows=shipped, **shape).grouped_rows == shipped
    assert choose("auto", rows=shipped, max_query_len=2, **shape).grouped_rows == shipped
    assert (choose("auto", rows=shipped, max_query_len=1, **shape).route,
            choose("auto", rows=shipped, max_query_len=1, **shape).grouped_rows) == ("xqa", 0)
    monkeypatch.setattr(qsa.settings, "GROUPED_MIN_ROWS", 16)
    case = make_attention_case(rows=16, num_reqs=16, num_q_heads=2, num_kv_heads=1, head_dim=16, width=12,
                               seed=6)
    kw = dict(block_size=16, num_blocks=case.cache.num_blocks, num_q_heads=2, num_kv_heads=1, head_dim=16)
    args = (case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens)
    plain = qsa.plan_attention(*args, **kw)
    decode = qsa.plan_attention(*args, **kw, max_query_len=1)
    assert plain.routes.grouped_rows == 16 and plain.grouped is not None
    assert (decode.routes.route, decode.routes.grouped_rows, decode.grouped) == ("xqa", 0, None)
    assert qsa.plan_attention(*args, **kw, max_query_len=2).routes.grouped_rows == 16
    nan = torch.full_like(case.q, float("nan"))
    auto = case.run(qsa.sparse_paged_attention, route="auto", max_query_len=1, out=nan, return_lse=True)
    assert_bitwise(auto, _run(case, "xqa"), "auto with max_query_len=1 vs xqa")
    for bad, error in ((0, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_query_len"):
            qsa.plan_attention(*args, **kw, max_query_len=bad)
    assert qsa.plan_attention(*args, **kw, max_query_len=np.int64(1)).routes.route == "xqa"
    mql = qsa.attention.routing.max_query_len_of
    assert (mql([3, 1, -1, 2]), mql(torch.tensor([0, 0, 5, -1, 0])), mql([-1, -1]), mql([])) == (1, 3, None, None)
    from qsa.model.layer import StepMetadata
    meta = StepMetadata.build([0, 1, 2, -1], [5, 6, 7, -1], [8, 8, 8], [[0], [1], [2]], [-1] * 4,
                              block_size=16, device="cpu")
    assert meta.max_query_len == 1
    meta = StepMetadata.build(torch.tensor([0, 0, 1]), [4, 5, 7], [8, 8], [[0], [1]], [-1] * 3,
                              block_size=16, device="cpu")
    assert meta.max_query_len == 2


def test_route_admission():
    """A forced route that cannot take a shape raises, naming why; ``auto`` falls back: to splitk past the
    page4 routes' heads per tile, to the reference for a head dim no Triton kernel takes."""
    kw = dict(rows=4, device=torch.device("cpu"))
    assert qsa.attention.routing.choose("auto", G=2, head_dim=24, **kw).route == "reference"
    for route in ("grouped", "xqa", "splitk"):
        with pytest.raises(ValueError, match="head_dim must be one of"):
            qsa.attention.routing.choose(route, G=2, head_dim=24, **kw)
    wide_g = 2 * qsa.attention.routing.MAX_TILE_ROWS
    assert qsa.attention.routing.choose("auto", G=wide_g, head_dim=16, **kw).route == "splitk"
    assert qsa.attention.routing.choose("splitk", G=wide_g, head_dim=16, **kw).route == "splitk"
    for route in ("grouped", "xqa"):
        with pytest.raises(ValueError, match="heads per tile"):
            qsa.attention.routing.choose(route, G=wide_g, head_dim=16, **kw)
    # The fallback runs: q of head dim 24 through auto equals the reference route.
    case = make_attention_case(rows=4, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=8, seed=3)
    q = torch.randn(4, 2, 24, generator=torch.Generator().manual_seed(1)).half()
    k = torch.randn(case.cache.num_blocks, case.cache.block_size, 1, 24).half()
    args = (q, k, k.clone(), case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens)
    assert_bitwise(qsa.sparse_paged_attention(*args, route="auto", return_lse=True),
                    qsa.sparse_paged_attention(*args, route="reference", return_lse=True), "auto at head_dim 24")


def test_dependent_launch_only_where_supported(monkeypatch):
    """Programmatic dependent launch is asked for on sm_90 and newer GPUs only, never under the
    interpreter, and ``QSA_PDL=0`` turns it off; a launch passes the same switch to the kernel."""
    import qsa

    assert not qsa.utils.dependent_launch("cpu")
    facts = {"cuda:0": {"kind": "cuda", "capability": (9, 0)}, "cuda:1": {"kind": "cuda", "capability": (8, 9)}}
    monkeypatch.setattr(qsa.utils, "device_facts", lambda d: facts[d])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not qsa.utils.dependent_launch("cuda:0")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("QSA_PDL", raising=False)
    assert qsa.utils.dependent_launch("cuda:0") and not qsa.utils.dependent_launch("cuda:1")
    assert qsa.utils.launch_options("cuda:0") == {"PDL": 1, "launch_pdl": True}
    assert qsa.utils.launch_options("cuda:0", early_trigger=False) == {"PDL": 2, "launch_pdl": True}
    monkeypatch.setenv("QSA_PDL", "0")
    assert not qsa.utils.dependent_launch("cuda:0")
    assert qsa.utils.launch_options("cuda:0") == {"PDL": 0, "launch_pdl": False}


def test_grouped_config_defaults():
    """The shipped grouped settings (qsa.attention.grouped.launch.grouped_config (docs/tuning.md)): 64-row tiles on 4 warps with three
    stages for 6/1 at D=256, the plan-entry prefetch and the lazy rescale with an FP8 cache; 128-row
    tiles for 12/1 and 24/2."""
    cfg = qsa.attention.grouped.launch.grouped_config(6, 256)
    assert (cfg.block_m, cfg.num_warps, cfg.num_stages, cfg.prefetch, cfg.lazy_rescale) == (64, 4, 3, False, False)
    fp8 = qsa.attention.grouped.launch.grouped_config(6, 256, kv_fp8=True)
    assert fp8.prefetch and fp8.lazy_rescale
    for G in (12, 24):
        wide = qsa.attention.grouped.launch.grouped_config(G, 256)
        assert (wide.block_m, wide.num_warps, wide.num_stages, wide.prefetch, wide.lazy_rescale) == (128, 8, 3, True, True)


@pytest.mark.parametrize("num_q_heads", [2, 6])
@pytest.mark.parametrize("group_rows", [1, 3, 4, 6, 7])
def test_grouped_kernel_takes_plans_of_any_group_size(group_rows, num_q_heads):
    """``plan_groups`` makes groups of 1..8 rows; the grouped launcher cuts each group into sub-groups
    that divide it (with the tuned 8 rows per program it wrote nothing for groups of 1..7 rows)."""
    from qsa.attention.grouped.launch import grouped_attention
    from qsa.attention.planning.plan import plan_groups

    case = make_attention_case(rows=15, num_reqs=3, num_q_heads=num_q_heads, width=16, seed=4)
    plan = plan_groups(**case.plan_inputs(), group_rows=group_rows)
    out = torch.full_like(case.q, float("nan"))
    c = case.cache
    grouped_attention(case.q, c.k, c.v, plan, out=out, lse=None, gate=None, softmax_scale=16 ** -0.5,
                      k_scale=1.0, v_scale=1.0, kv_fp8=False)
    ref, _ = case.run(reference_attention, compute_dtype=torch.float64)
    torch_out, _ = case.run(reference_attention, compute_dtype=case.q.dtype)
    assert_close_like_torch(out, ref, torch_out)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0 * inf
@pytest.mark.parametrize("route", ["grouped", "xqa", "splitk", "invariant"])
def test_a_non_finite_value_stays_in_its_rows_or_group(route):
    """A V value of inf in one cache slot: xqa, splitk and invariant keep rows apart, so every row that does not
    read that slot keeps its bits; the grouped route loads a slot once for its 8-row group, and 0 * inf
    in P @ V can reach the other rows of a group that reads it (README), never a row of another group."""
    from qsa.attention.reference import kept_tokens as _kept_tokens

    case = make_attention_case(rows=24, num_reqs=3, width=16, seed=5)
    c = case.cache
    clean = case.run(qsa.sparse_paged_attention, route=route)
    table, lens = case.block_table.tolist(), case.seq_lens.tolist()
    reads = []  # (physical block, slot) of each row's kept tokens
    for r in range(24):
        req, pos = int(case.token_to_req[r]), int(case.positions[r])
        kept = _kept_tokens(case.indices[r].tolist(), req, pos, lens, table, c.block_size, c.num_blocks)
        reads.append({(table[req][t // c.block_size], t % c.block_size) for t in kept})
    slot = sorted(reads[9])[0]  # a slot row 9 (group 1) reads
    c.v[slot[0], slot[1]] = float("inf")
    out = case.run(qsa.sparse_paged_attention, route=route)
    readers = {r for r in range(24) if slot in reads[r]}
    spared = {r for r in range(24) if r not in readers and (route != "grouped" or not any(
        q // 8 == r // 8 for q in readers))}
    assert 9 in readers and spared
    if route == "grouped":
        assert not any(r // 8 == 1 for r in spared)
    else:
        assert any(r // 8 == 1 for r in spared)  # rows of row 9's group that read other slots
    for r in spared:
        assert torch.equal(out[r], clean[r]), f"row {r} changed"
    assert not out[9].isfinite().all()  # the row that reads the slot is not finite: the check can fail



def _launch_buffers(plan):
    """Data pointers of every partial and scratch tensor the plan's launches hold."""
    ptrs = []
    for launch in vars(plan.launches).values():
        if launch is not None:
            ptrs += [t.data_ptr() for t in (launch.partials or ())]
            ptrs += [launch.scratch.data_ptr()] if getattr(launch, "scratch", None) is not None else []
    return ptrs


@pytest.mark.parametrize("route", ["grouped", "xqa", slow("splitk"), slow("invariant")])
def test_the_plan_decides_every_launch(route, monkeypatch):
    """Settings, splits and partials are decided by plan_attention: run_attention decides nothing (a
    route choice or split count asked for at run time fails the test), a plan refilled with ``out=`` keeps
    its partials and scratch, and a plan made for one cache dtype refuses another."""
    case = make_attention_case(rows=6, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16,
                               block_size=16, width=200, max_seq_len=400, messy=False, seed=4)
    three = lambda programs, max_tiles, per_sm, device, cap=None: 3  # noqa: E731
    monkeypatch.setattr(qsa.attention.routing, "split_count", three)
    monkeypatch.setattr(qsa.settings, "INVARIANT_FOLD_LISTS", 1 << 30)  # a program per split, then the merge
    shape = dict(num_q_heads=2, num_kv_heads=1, head_dim=16, route=route)
    plan = qsa.plan_attention(**case.plan_inputs(), **shape)
    buffers = _launch_buffers(plan)
    assert buffers, "the plan holds the step's partials"
    choose = qsa.attention.routing.choose

    def decided_at_run(*a, **kw):
        raise AssertionError("run_attention decided a launch")

    monkeypatch.setattr(qsa.attention.routing, "split_count", decided_at_run)
    monkeypatch.setattr(qsa.attention.routing, "choose", decided_at_run)
    got = qsa.run_attention(plan, case.q, case.cache.k, case.cache.v, gate=case.gate, return_lse=True)
    check_against_reference(case, got, route)
    monkeypatch.setattr(qsa.attention.routing, "split_count", three)
    monkeypatch.setattr(qsa.attention.routing, "choose", choose)
    again = qsa.plan_attention(**case.plan_inputs(), **shape, out=plan)
    assert again is plan and _launch_buffers(plan) == buffers, "a refilled plan keeps its buffers"
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
        fp8 = torch.zeros(case.cache.k.shape, dtype=torch.uint8)
        qsa.run_attention(plan, case.q, fp8, fp8.clone(), kv_cache_dtype="fp8_e4m3")
