"""Replayed eager calls of ``select_tokens``, ``write_kv`` and ``update_compressed_keys`` (qsa.attention.replay): the second call of a
fingerprint launches what the first recorded.

A replay must give the bits the full path gives on the same inputs, with every input a new tensor at a new
address; it must never serve a call of another shape or under other settings, never run with a stale
pointer, and leave every bad-input check in force. On the CPU the replays run under the Triton interpreter
(``replay.ON_INTERPRETER``).
"""

import pytest
import torch

import qsa
from qsa import settings
from qsa.attention import replay
from qsa.cache import paged
from qsa.cache.paged import PagedKVCache, allocate_kv_cache
from qsa.selection import api as sel

BS = 16  # the main KV cache's block size (kc_cache rows per block: BS // 4)
K = 3  # blocks per row


@pytest.fixture(autouse=True)
def replays_on(monkeypatch):
    monkeypatch.setattr(replay, "ON_INTERPRETER", True)
    monkeypatch.setattr(settings, "REPLAY_STEPS", True)
    for cache in (sel._SELECTIONS, paged._WRITES, sel._UPDATES):
        cache.clear()
    yield
    for cache in (sel._SELECTIONS, paged._WRITES, sel._UPDATES):
        cache.clear()


# select_tokens


def selection_case(seed, rows=6, dtype=torch.float32):
    """A selection over 2 requests of 3 table entries each (one invalid), a padding row last: new tensors,
    new values and a new page placement for every seed."""
    g = torch.Generator().manual_seed(seed)
    num_reqs, max_blocks, rpb, D, H = 2, 3, BS // 4, 16, 2
    num_blocks = num_reqs * max_blocks + 2
    kc = torch.randn(num_blocks, rpb, D, generator=g).to(dtype)
    bt = torch.randperm(num_blocks, generator=g)[:num_reqs * max_blocks].reshape(num_reqs, max_blocks).to(torch.int32)
    bt[1, 2] = -1
    seq = torch.randint(30, max_blocks * BS + 1, (num_reqs,), generator=g, dtype=torch.int32)
    req = torch.randint(0, num_reqs, (rows,), generator=g, dtype=torch.int32)
    pos = (torch.rand(rows, generator=g) * seq[req.long()]).to(torch.int64)
    pos[-1] = -1
    q = torch.randn(rows, H, D, generator=g).to(dtype)
    return q, kc, bt, req, pos, seq


def select(case, k=K, **kw):
    return qsa.select_tokens(*case, block_size=BS, k=k, **kw)


def poisoned_out(case):
    return torch.full((case[0].shape[0], 4 * K + 3), -7, dtype=torch.int32)


def selections():
    return list(sel._SELECTIONS.entries.values())


@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_selection_replay_gives_the_full_paths_bits(with_out, dtype):
    first = selection_case(1, dtype=dtype)
    a = select(first, out=poisoned_out(first) if with_out else None)
    assert len(selections()) == 1 and isinstance(selections()[0], replay.Replay), "the first call recorded no replay"
    (scratch,) = selections()[0].keep
    scratch.fill_(0x7FFFFFFF)  # the largest score key: a launch that read a key it did not write would pick it
    second = selection_case(2, dtype=dtype)  # the first case stays alive: every tensor is at a new address
    out = poisoned_out(second) if with_out else None
    got = select(second, out=out)
    assert sel._SELECTIONS.hits == 1, "the second call was not replayed"
    assert out is None or got is out
    sel._SELECTIONS.clear()
    full = select(second, out=poisoned_out(second) if with_out else None)
    assert torch.equal(got, full), "replay vs full path"
    assert torch.equal(full, select(second, backend="torch")), "full path vs the PyTorch path"
    assert not torch.equal(a, got), "the two cases select alike: the test proves nothing"


def test_the_torch_backend_is_never_recorded():
    case = selection_case(1)
    select(case, backend="torch")
    select(case, backend="torch")
    assert selections() == []


def test_a_shape_change_is_not_served_by_an_old_replay():
    select(selection_case(1, rows=6))
    got = select(selection_case(2, rows=7))
    assert sel._SELECTIONS.hits == 0 and len(selections()) == 2, "a replay served another shape"
    assert torch.equal(got, select(selection_case(2, rows=7), backend="torch"))
    q, kc, bt, req, pos, seq = selection_case(3, rows=6)
    select((q, kc, bt[:, :2].contiguous(), req, pos, seq))  # a narrower table: another fingerprint
    select(selection_case(4, rows=6), k=K + 1)  # another k
    assert sel._SELECTIONS.hits == 0 and len(selections()) == 4


def test_a_settings_change_drops_every_selection_replay(monkeypatch):
    case = selection_case(1)
    select(case)
    assert len(selections()) == 1
    monkeypatch.setattr(settings, "SELECT_TOPK_EMIT", settings.SELECT_TOPK_EMIT // 2)
    select(case)
    assert len(selections()) == 1 and sel._SELECTIONS.hits == 0, "a replay served a call under other settings"
    monkeypatch.setattr(settings, "REPLAY_STEPS", False)
    sel._SELECTIONS.clear()
    select(case)
    assert selections() == [], "REPLAY_STEPS off still recorded"


@pytest.mark.parametrize("lost", ["index_q", "kc_cache", "block_table"])
def test_a_selection_replay_that_lost_an_input_is_caught(lost):
    """Known-wrong variant: a replay whose launches lost the slot of one input keep reading the first
    call's tensor; the bitwise comparison with the full path, as the tests above make it, must reject it."""
    select(selection_case(1))
    (step,) = selections()
    step.drop_input(lost)
    second = selection_case(2)
    stale = select(second)
    assert sel._SELECTIONS.hits == 1
    sel._SELECTIONS.clear()
    assert not torch.equal(stale, select(second)), f"a stale {lost} went unnoticed"


def test_a_scratch_over_the_cap_is_not_recorded(monkeypatch):
    monkeypatch.setattr(settings, "REPLAY_MAX_SCRATCH_BYTES", 0)
    for seed in (1, 2):
        case = selection_case(seed)
        assert torch.equal(select(case), select(case, backend="torch"))
    assert not any(isinstance(e, replay.Replay) for e in selections()) and sel._SELECTIONS.hits == 0


def test_inputs_at_one_address_are_served_unrecorded():
    """``positions`` passed as ``token_to_req`` too (a replay refuses two inputs at one address): the full
    path serves it, and the fingerprint is recorded by the next call with distinct tensors."""
    q, kc, bt, req, pos, seq = selection_case(1)
    same = req.long()
    assert torch.equal(select((q, kc, bt, same, same, seq)), select((q, kc, bt, same, same, seq), backend="torch"))
    assert selections() == []
    select((q, kc, bt, same, same.clone(), seq))
    assert isinstance(selections()[0], replay.Replay)


def test_bad_selection_input_is_refused_after_a_replayed_shape():
    case = selection_case(1)
    select(case)
    select(case, out=poisoned_out(case))
    assert sel._SELECTIONS.hits == 0 and len(selections()) == 2
    q, kc, bt, req, pos, seq = case
    with pytest.raises(TypeError, match="index_q"):
        select((q.double(), kc, bt, req, pos, seq))
    with pytest.raises(TypeError, match="index_q"):
        select((q.to(torch.int32), kc, bt, req, pos, seq))
    with pytest.raises(TypeError, match="block_table"):
        select((q, kc, bt.long(), req, pos, seq))
    with pytest.raises(TypeError, match="k must be"):
        qsa.select_tokens(*case, block_size=BS, k=True)
    with pytest.raises(TypeError, match="k must be"):
        qsa.select_tokens(*case, block_size=BS, k=float(K))
    with pytest.raises(TypeError, match="out"):
        select(case, out=poisoned_out(case).long())
    with pytest.raises(ValueError, match="contiguous last dimension"):
        select(case, out=torch.empty(4 * K + 3, q.shape[0], dtype=torch.int32).t())
    with pytest.raises(ValueError, match="share memory"):
        select(case, out=torch.empty(1, 4 * K + 3, dtype=torch.int32).expand(q.shape[0], -1))
    with pytest.raises(ValueError, match="rows per block"):
        qsa.select_tokens(*case, block_size=2 * BS, k=K)
    assert sel._SELECTIONS.hits == 0, "a bad input was served by a replay"


# write_kv


def write_case(seed, kv="auto", dtype=torch.float16, layout="interleaved", T=5):
    """A NaN-filled cache and ``T`` new rows (the last slot skipped): new tensors and values every seed."""
    g = torch.Generator().manual_seed(seed)
    scales = dict(k_scale=0.5, v_scale=2.0) if kv == "fp8_e4m3" else {}
    cache = allocate_kv_cache(6, 8, 2, 16, dtype=dtype, kv_cache_dtype=kv, layout=layout, fill="nan", **scales)
    k = (torch.randn(T, 2, 16, generator=g) * 40).to(dtype)
    v = (torch.randn(T, 2, 16, generator=g) * 40).to(dtype)
    slots = torch.randperm(6 * 8, generator=g)[:T]
    slots[-1] = -1
    return cache, k, v, slots


def write(cache, k, v, slots):
    cache.write(k, v, slots)


def copy_of(cache: PagedKVCache) -> PagedKVCache:
    if cache.storage is not None:
        return PagedKVCache.from_storage(cache.storage.clone(), kv_cache_dtype=cache.kv_cache_dtype,
                                         k_scale=cache.k_scale, v_scale=cache.v_scale)
    return PagedKVCache(cache.k.clone(), cache.v.clone(), None, cache.kv_cache_dtype, cache.k_scale, cache.v_scale)


def same_bytes(a: PagedKVCache, b: PagedKVCache) -> bool:
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
               for x, y in ((a.k, b.k), (a.v, b.v)))


def writes():
    return list(paged._WRITES.entries.values())


@pytest.mark.parametrize("kv,dtype,layout", [("auto", torch.float16, "interleaved"),
                                             ("auto", torch.bfloat16, "separate"),
                                             ("fp8_e4m3", torch.bfloat16, "interleaved")])
def test_a_write_replay_gives_the_full_paths_bits(kv, dtype, layout):
    first = write_case(1, kv, dtype, layout)
    write(*first)
    assert len(writes()) == 1 and isinstance(writes()[0][0], replay.Replay), "the first call recorded no replay"
    cache, k, v, slots = write_case(2, kv, dtype, layout)
    before = copy_of(cache)
    write(cache, k, v, slots)
    assert paged._WRITES.hits == 1, "the second call was not replayed"
    paged._WRITES.clear()
    write(before, k, v, slots)
    assert same_bytes(cache, before), "replay vs full path"
    reference = write_case(2, kv, dtype, layout)[0]
    paged.write_kv(reference.k, reference.v, k, v, slots, kv_cache_dtype=kv, k_scale=reference.k_scale,
                   v_scale=reference.v_scale, backend="torch")
    assert same_bytes(cache, reference), "full path vs the PyTorch path"


def test_a_write_replay_that_lost_an_input_is_caught():
    """Known-wrong variant: a replay whose launch lost the slot of ``k`` writes the first call's rows."""
    write(*write_case(1))
    step = writes()[0][0]
    step.drop_input("k")
    cache, k, v, slots = write_case(2)
    before = copy_of(cache)
    write(cache, k, v, slots)
    assert paged._WRITES.hits == 1
    paged._WRITES.clear()
    write(before, k, v, slots)
    assert not same_bytes(cache, before), "a stale k went unnoticed"


def test_a_write_of_another_shape_or_under_other_settings_is_not_replayed(monkeypatch):
    write(*write_case(1))
    write(*write_case(2, T=6))
    assert paged._WRITES.hits == 0 and len(writes()) == 2, "a replay served another shape"
    cache, k, v, slots = write_case(3)
    paged.write_kv(cache.k, cache.v, k, v, slots, k_scale=2.0)  # another scale: another fingerprint
    assert paged._WRITES.hits == 0 and len(writes()) == 3
    monkeypatch.setattr(settings, "MAX_SPLITS", settings.MAX_SPLITS + 1)
    write(*write_case(4))
    assert paged._WRITES.hits == 0 and len(writes()) == 1, "a replay served a call under other settings"


def test_k_and_v_one_tensor_take_the_full_path():
    cache, k, _, slots = write_case(1)
    reference = copy_of(cache)
    paged.write_kv(cache.k, cache.v, k, k, slots)
    paged.write_kv(cache.k, cache.v, k, k, slots)
    assert writes() == [], "inputs at one address were recorded"
    paged.write_kv(reference.k, reference.v, k, k, slots, backend="torch")
    assert same_bytes(cache, reference)
    paged.write_kv(cache.k, cache.v, k, k.clone(), slots)  # distinct tensors: the fingerprint is recorded
    assert isinstance(writes()[0][0], replay.Replay)
    paged.write_kv(cache.k, cache.v, k, k, slots)  # a replay reads k for both, as the full path does
    assert paged._WRITES.hits == 1 and same_bytes(cache, reference)


def test_overlapping_caches_are_refused_after_a_replayed_layout(monkeypatch):
    """The disjointness of K and V depends on where they lie, not only on their layout: caches of the
    recorded layout that share elements must take the full path and be refused; caches of that layout
    apart are replayed."""
    cache, k, v, slots = write_case(1)
    write(cache, k, v, slots)
    full_calls = []
    full = paged._write_kv_full
    monkeypatch.setattr(paged, "_write_kv_full", lambda *a: full_calls.append(a) or full(*a))
    shifted = torch.as_strided(cache.storage, cache.v.shape, cache.v.stride(), cache.k.storage_offset() + 1)
    assert replay.tensor_key(shifted) == replay.tensor_key(cache.v)
    with pytest.raises(ValueError, match="must not share memory"):
        paged.write_kv(cache.k, shifted, k, v, slots)
    with pytest.raises(ValueError, match="must not share memory"):
        paged.write_kv(cache.k, cache.k, k, v, slots)
    assert len(full_calls) == 2
    assert paged._WRITES.hits == 0, "a refused replay was counted as served"
    other = write_case(2)[0]
    apart_before = copy_of(other)
    paged.write_kv(cache.k, other.v, k, v, slots)  # the V half of another storage: apart
    assert len(full_calls) == 2, "caches apart were not replayed"
    assert paged._WRITES.hits == 1
    paged._WRITES.clear()
    paged.write_kv(cache.k, apart_before.v, k, v, slots)
    assert torch.equal(other.v.contiguous().view(torch.uint8), apart_before.v.contiguous().view(torch.uint8))


def test_bad_write_input_is_refused_after_a_replayed_shape():
    cache, k, v, slots = write_case(1, "fp8_e4m3", torch.bfloat16)
    for _ in range(2):
        write(cache, k, v, slots)
    assert paged._WRITES.hits == 1
    kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0)
    with pytest.raises(TypeError, match="slot_mapping"):
        paged.write_kv(cache.k, cache.v, k, v, slots.float(), **kw)
    with pytest.raises(TypeError, match="k must have dtype"):
        paged.write_kv(cache.k, cache.v, k.to(torch.int32), v.to(torch.int32), slots, **kw)
    with pytest.raises(ValueError, match="k_scale"):
        paged.write_kv(cache.k, cache.v, k, v, slots, kv_cache_dtype="fp8_e4m3", k_scale=-0.5, v_scale=2.0)
    with pytest.raises(TypeError, match="v_scale"):
        paged.write_kv(cache.k, cache.v, k, v, slots, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=True)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        paged.write_kv(cache.k, cache.v, k, v, torch.stack([slots, slots], 1)[:, 0], **kw)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        paged.write_kv(cache.k, cache.v, k, v, slots, kv_cache_dtype="fp8", k_scale=0.5, v_scale=2.0)
    assert paged._WRITES.hits == 1, "a bad input was served by a replay"


# update_compressed_keys


def key_case(seed, dtype=torch.bfloat16, weight=True, rot=8):
    """One ordered step of 2 requests (a chunk of request 0 whose first group opened in an earlier step, then
    a prefill chunk of request 1), the layer's norm_rope, NaN-filled caches: new tensors and values every
    seed."""
    from qsa.model.functional import rope_cos_sin

    g = torch.Generator().manual_seed(seed)
    D, rpb, num_blocks = 16, BS // 4, 8
    req = torch.tensor([0] * 6 + [1] * 9, dtype=torch.int32)
    pos = torch.cat([torch.arange(2, 8), torch.arange(0, 9)])
    raw = torch.randn(req.shape[0], D, generator=g) * 3
    bt = torch.randperm(num_blocks, generator=g)[:4].reshape(2, 2).to(torch.int32)
    kc = torch.full((num_blocks, rpb, D), float("nan"), dtype=dtype)
    partial = torch.full((2, 3, D), float("nan"))
    partial[0, :2] = torch.randn(2, D, generator=g)  # request 0's open group: positions 0 and 1
    w = torch.randn(D, generator=g) * 0.2 if weight else None
    cos, sin = rope_cos_sin(torch.div(pos, 4, rounding_mode="floor") * 4, rot, 1e4 * seed) if rot else (None, None)
    return dict(raw_k=raw, token_to_req=req, positions=pos, kc_cache=kc, block_table=bt, partial=partial,
                norm_rope=(w, 1e-6, cos, sin))


def update(c, **kw):
    kw = {"rows_ordered": True, **kw}
    sel.update_compressed_keys(c["raw_k"], c["token_to_req"], c["positions"], c["kc_cache"], c["block_table"],
                               c["partial"], block_size=BS, norm_rope=c["norm_rope"], **kw)
    return c["kc_cache"], c["partial"]


def copy_case(c):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.items()}


def updates():
    return list(sel._UPDATES.entries.values())


def same(a, b):
    return all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype,weight,rot", [(torch.bfloat16, True, 8), (torch.float32, False, 0)])
def test_a_key_update_replay_gives_the_full_paths_bits(dtype, weight, rot):
    first = key_case(1, dtype, weight, rot)
    a = update(first)
    assert len(updates()) == 1 and isinstance(updates()[0], replay.Replay), "the first call recorded no replay"
    for t in updates()[0].keep:
        if t.shape[0] != first["raw_k"].shape[1]:  # the scratch, not the (1 + 0) weight
            t.fill_(float("nan") if t.is_floating_point() else 1 << 40)  # scratch read before written would show
    second = key_case(2, dtype, weight, rot)  # the first case stays alive: every tensor is at a new address
    full_in, torch_in = copy_case(second), copy_case(second)
    got = update(second)
    assert sel._UPDATES.hits == 1, "the second call was not replayed"
    sel._UPDATES.clear()
    full = update(full_in)
    assert same(got, full), "replay vs full path"
    assert same(full, update(torch_in, backend="torch")), "full path vs the PyTorch path"
    assert not same(a, got), "the two cases write alike: the test proves nothing"
    assert torch.isfinite(got[0][first["block_table"].long()].float()).any()


@pytest.mark.parametrize("lost", ["raw_k", "partial", "cos"])
def test_a_key_update_replay_that_lost_an_input_is_caught(lost):
    """Known-wrong variant: a replay that launches the first call's tensor in place of one input; the
    comparison with the full path, as above, must reject it."""
    update(key_case(1))
    (step,) = updates()
    step.drop_input(lost)
    second = key_case(2)
    full_in = copy_case(second)
    stale = update(second)
    assert sel._UPDATES.hits == 1
    sel._UPDATES.clear()
    assert not same(stale, update(full_in)), f"a stale {lost} went unnoticed"


def test_key_updates_that_sort_transform_or_refuse_on_the_host_are_not_recorded():
    """Only ordered rows with no transform callable are recorded; a call with ``next_pos`` on the CPU checks
    its refusals on the host between launches, so it takes the full path too."""
    c = key_case(1)
    update(c, rows_ordered=False)
    sel.update_compressed_keys(c["raw_k"], c["token_to_req"], c["positions"], c["kc_cache"], c["block_table"],
                               c["partial"], block_size=BS, transform=lambda kc, b: kc * 2, rows_ordered=True)
    update(c, next_pos=torch.tensor([2, 0]))
    update(c, backend="torch")
    assert updates() == [] and sel._UPDATES.hits == 0


def test_a_key_update_of_another_shape_or_eps_is_not_replayed():
    update(key_case(1))
    c = key_case(2)
    c["norm_rope"] = (c["norm_rope"][0], 1e-5, *c["norm_rope"][2:])
    update(c)
    update(key_case(3, weight=False))
    update(key_case(4, rot=4))
    assert sel._UPDATES.hits == 0 and len(updates()) == 4


def test_bad_key_update_input_is_refused_after_a_replayed_shape():
    for seed in (1, 2):
        update(key_case(seed))
    assert sel._UPDATES.hits == 1
    c = key_case(3)
    w, eps, cos, sin = c["norm_rope"]
    for norm_rope, error, match in (((w.to(torch.int32), eps, cos, sin), TypeError, "norm_rope weight"),
                                    ((w[:8], eps, cos, sin), ValueError, "norm_rope weight"),
                                    ((w, -1.0, cos, sin), ValueError, "eps"),
                                    ((w, float("nan"), cos, sin), ValueError, "eps"),
                                    ((w, eps, cos, None), ValueError, "both"),
                                    ((w, eps, cos.double(), sin.double()), TypeError, "norm_rope cos"),
                                    ((w, eps, cos[:3], sin[:3]), ValueError, "norm_rope cos"),
                                    ([w, eps, cos, sin], TypeError, "norm_rope must be a tuple")):
        with pytest.raises(error, match=match):
            update({**c, "norm_rope": norm_rope})
    with pytest.raises(ValueError, match="not both"):
        update(c, transform=lambda kc, b: kc)
    with pytest.raises(TypeError, match="raw_k"):
        update({**c, "raw_k": c["raw_k"].to(torch.int32)})
    assert sel._UPDATES.hits == 1, "a bad input was served by a replay"
