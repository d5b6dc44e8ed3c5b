"""Selection stage: scores, exact top-k, expansion, compressed-key feeding.

CPU tests run the Triton kernels under the interpreter with tiny shapes; ``gpu`` tests use production
sizes, CUDA graphs and bitwise comparisons on a real device.
"""

import functools
import math

import pytest
import torch

from benchmarks.baselines import torch_select_baseline
from helpers import poisoned, slow
import qsa
import qsa.selection.api
import qsa.selection.reference
import qsa.settings

NAN, INF = float("nan"), float("inf")
BS = 16  # the main KV cache's block size of _stage_inputs (kc_cache rows per block: BS // 4)


# helpers


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def special_scores(rows, n, seed, *, levels=6):
    """Small-integer scores (many ties) with -0.0/+0.0, +-inf and NaN sprinkled in."""
    g = _gen(seed)
    s = torch.randint(0, levels, (rows, n), generator=g).float() - 1.0     # -1 .. levels-2
    pick = torch.rand(rows, n, generator=g)
    s[pick < 0.08] = NAN
    s[(pick >= 0.08) & (pick < 0.12)] = -INF
    s[(pick >= 0.12) & (pick < 0.15)] = INF
    s[(pick >= 0.15) & (pick < 0.25)] = -0.0
    s[(pick >= 0.25) & (pick < 0.30)] = 0.0
    return s


def visible_cases(n, k):
    vals = [-1, 0, 1, k - 1, k, k + 1, n, n + 5]
    return torch.tensor([v for v in vals], dtype=torch.int64)


def make_cache(*, num_reqs, max_blocks, block_size, seq_lens, D=128, dtype=torch.float32, seed=0,
               lo=-3, hi=4, invalid=(), device="cpu"):
    """Integer-valued compressed keys in a shuffled paged layout; ``invalid`` lists (req, i) table
    entries to break (-1 or out of range). One extra physical block is aliased by two requests."""
    g = _gen(seed)
    rpb = block_size // 4
    num_blocks = num_reqs * max_blocks + 2
    kc = torch.randint(lo, hi, (num_blocks, rpb, D), generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    bt = perm[: num_reqs * max_blocks].reshape(num_reqs, max_blocks).to(torch.int32)
    if num_reqs > 1 and max_blocks > 1:
        bt[1, 0] = bt[0, 0]                                           # page aliasing
    for n_bad, (r, i) in enumerate(invalid):
        bt[r, i] = -1 if n_bad % 2 == 0 else num_blocks + 7
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return kc.to(device), bt.to(device), seq.to(device)


def rows_for(seq_lens, picks, seed=0):
    """token_to_req/positions from (req, position) pairs; position None draws one at random."""
    g = _gen(seed)
    req, pos = [], []
    for r, p in picks:
        if p is None:
            p = int(torch.randint(0, max(int(seq_lens[r]), 1), (1,), generator=g))
        req.append(r)
        pos.append(p)
    return torch.tensor(req, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64)


# top-k


TOPK_PATHS = {
    "tile": None,                                                    # whole row in registers
    "tile_emit_chunks": dict(SINGLE_TILE=True, BLOCK_N=64, EMIT_BLOCK=16, OUT_BLOCK=16),
    "chunked": dict(SINGLE_TILE=False, BLOCK_N=16, EMIT_BLOCK=16, OUT_BLOCK=16),   # radix select
}


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("path", list(TOPK_PATHS))
def test_topk_blocks_exact(device, k, path):
    n = 40
    vis = visible_cases(n, k)
    s = special_scores(vis.shape[0], n, seed=k)
    s[0, :] = NAN                                                    # a row of NaN only
    s[1, :] = 2.0                                                    # a row of ties only
    config = TOPK_PATHS[path]
    out = poisoned((s.shape[0], k), torch.int32, device).fill_(12345)
    qsa.selection.api._launch_topk(s.to(device), out, k, from_scores=True, visible=vis.to(device), config=config)
    want = qsa.selection.reference.topk_blocks_reference(s, vis, k)
    assert torch.equal(out.cpu(), want)
    assert torch.equal(qsa.selection.api.topk_blocks(s.to(device), vis.to(device), k).cpu(), want)


@pytest.mark.parametrize("path", list(TOPK_PATHS))
def test_topk_distinct_scores(device, path):
    """Distinct scores end the bit search early; partial ties at the threshold do not."""
    k, n = 7, 300
    g = _gen(17)
    s = torch.randn(6, n, generator=g)
    s[3, 100:200] = s[3, 5]                                          # ties straddling the threshold
    s[4] = torch.randn(n, generator=g).abs() * 1e-39                 # subnormals
    s[5] = -torch.randn(n, generator=g).abs()                       # all negative
    vis = torch.tensor([n, 250, 9, n, n, n])
    config = {"tile": None, "tile_emit_chunks": dict(SINGLE_TILE=True, BLOCK_N=512, EMIT_BLOCK=32),
              "chunked": dict(SINGLE_TILE=False, BLOCK_N=64, EMIT_BLOCK=32)}[path]
    out = torch.empty(6, k, dtype=torch.int32, device=device)
    qsa.selection.api._launch_topk(s.to(device), out, k, from_scores=True, visible=vis.to(device), config=config)
    assert torch.equal(out.cpu(), qsa.selection.reference.topk_blocks_reference(s, vis, k))


def test_topk_dense_and_padding(device):
    """visible <= k gives 0..visible-1 whatever the scores; the rest is -1."""
    k, n = 6, 9
    s = special_scores(5, n, seed=3)
    vis = torch.tensor([0, 1, 5, 6, -3], dtype=torch.int32)
    out = qsa.selection.api.topk_blocks(s.to(device), vis.to(device), k).cpu()
    for r, v in enumerate(vis.clamp(min=0).tolist()):
        assert out[r, :v].tolist() == list(range(v))
        assert (out[r, v:] == -1).all()


def test_topk_row_independent(device):
    """A row's result does not depend on the other rows of the batch."""
    k, n = 4, 33
    s = special_scores(7, n, seed=5)
    vis = torch.tensor([33, 2, 17, 4, 5, 0, 30])
    full = qsa.selection.api.topk_blocks(s.to(device), vis.to(device), k).cpu()
    for r in (0, 3, 6):
        alone = qsa.selection.api.topk_blocks(s[r:r + 1].to(device), vis[r:r + 1].to(device), k).cpu()
        assert torch.equal(alone[0], full[r])


def test_topk_65536_blocks(device):
    n, k = 65536, 512
    g = _gen(11)
    s = torch.randint(0, 900, (3, n), generator=g).float()           # heavy ties at the threshold
    s[0, torch.randint(0, n, (4000,), generator=g)] = NAN
    s[1, :600] = -INF
    s[1, 600:] = NAN
    s[2, torch.randint(0, n, (300,), generator=g)] = INF
    vis = torch.tensor([n, n - 3, 40000])
    want = qsa.selection.reference.topk_blocks_reference(s, vis, k)
    assert torch.equal(qsa.selection.api.topk_blocks(s.to(device), vis.to(device), k).cpu(), want)
    # the largest row held in registers (16384 blocks), same data
    m = qsa.settings.SELECT_MAX_REGISTER_TILE
    vis = torch.tensor([m, m - 1, 9000])
    assert torch.equal(qsa.selection.api.topk_blocks(s[:, :m].to(device), vis.to(device), k).cpu(),
                       qsa.selection.reference.topk_blocks_reference(s[:, :m], vis, k))


def test_topk_k2048(device):
    n, k = 5000, 2048
    s = special_scores(2, n, seed=8, levels=40)
    vis = torch.tensor([n, 2049])
    assert torch.equal(qsa.selection.api.topk_blocks(s.to(device), vis.to(device), k).cpu(),
                       qsa.selection.reference.topk_blocks_reference(s, vis, k))


def test_topk_half_precision_scores(device):
    k, n = 5, 30
    s = special_scores(4, n, seed=9).to(torch.bfloat16)
    vis = torch.tensor([30, 30, 12, 3])
    assert torch.equal(qsa.selection.api.topk_blocks(s.to(device), vis.to(device), k).cpu(),
                       qsa.selection.reference.topk_blocks_reference(s, vis, k))


# Known-wrong orderings: the checks above must be able to tell them from the right one.


def _wrong_topk(scores, visible, k, variant):
    """Top-k by a deliberately wrong order (one rule of the contract broken)."""
    rows, n = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int32)
    for r in range(rows):
        vals = [float(v) for v in scores[r, :max(min(int(visible[r]), n), 0)]]

        def key(i):
            v = vals[i]
            nan = math.isnan(v)
            v = 0.0 if nan else v
            if variant == "ties_by_higher_index":
                return (nan, -v, -i)
            if variant == "nan_largest":
                return (not nan, -v, i)
            if variant == "negative_zero_below" and v == 0.0 and math.copysign(1.0, v) < 0:
                v = -1e-300
            return (nan, -v, i)

        chosen = sorted(sorted(range(len(vals)), key=key)[:k])
        out[r, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


@pytest.mark.parametrize("variant", ["ties_by_higher_index", "nan_largest", "negative_zero_below"])
def test_wrong_orderings_are_rejected(device, variant):
    k, n = 3, 12
    s = torch.tensor([
        [1.0, 2.0, 2.0, 2.0, 0.5, 2.0, 1.0, 0.0, 0.0, 2.0, 1.0, 1.0],      # ties at the threshold
        [NAN, NAN, 1.0, -INF, NAN, 0.5, NAN, NAN, NAN, NAN, NAN, -1.0],    # NaN below numbers
        [-0.0, 0.0, -0.0, -1.0, 0.0, -0.0, -2.0, -0.0, 0.0, -3.0, -0.0, 0.0],  # -0.0 == +0.0
    ])
    vis = torch.full((3,), n)
    got = qsa.selection.api.topk_blocks(s.to(device), vis.to(device), k).cpu()
    assert torch.equal(got, qsa.selection.reference.topk_blocks_reference(s, vis, k))
    wrong = _wrong_topk(s, vis, k, variant)
    assert not torch.equal(wrong, got), variant


# expansion


def test_tokens_from_scores_expansion(device):
    k = 3
    seq = torch.tensor([41, 13, 64], dtype=torch.int32)
    req = torch.tensor([0, 0, 0, 0, 1, 1, 2, -1, 5, 2, 0], dtype=torch.int32)
    pos = torch.tensor([40, 39, 38, 37, 12, 20, 0, 3, 3, -1, 2], dtype=torch.int64)
    n = 16
    s = special_scores(req.shape[0], n, seed=4)
    out = qsa.selection.api.tokens_from_scores(s.to(device), req.to(device), pos.to(device), seq.to(device), k=k).cpu()
    vis = qsa.selection.reference.visible_blocks_reference(req, pos, seq)
    want = qsa.selection.reference.expand_tokens_reference(qsa.selection.reference.topk_blocks_reference(s, vis, k), req, pos, seq)
    assert torch.equal(out, want)
    # spot checks of the contract itself
    assert out[0, 12:].tolist() == [40, -1, -1]                      # pos 40: tail is [40]
    assert out[1, 12:].tolist() == [-1, -1, -1]                      # pos 39: no tail
    assert out[2, 12:].tolist() == [36, 37, 38]                      # pos 38: tail 36..38
    assert (out[7] == -1).all() and (out[8] == -1).all() and (out[9] == -1).all()
    assert out[5].tolist() == list(range(12)) + [-1] * 3            # pos >= seq_len: blocks < 3, tail -1
    assert out[6].tolist() == [0] + [-1] * 14                        # pos 0: no block, tail [0]
    assert out[10, :3].tolist() == [0, 1, 2] and (out[10, 3:] == -1).all()


def _wrong_expand(blocks, token_to_req, positions, seq_lens, variant):
    out = qsa.selection.reference.expand_tokens_reference(blocks, token_to_req, positions, seq_lens)
    n_kept = (blocks >= 0).sum(1)
    for r in range(out.shape[0]):
        req, pos = int(token_to_req[r]), int(positions[r])
        if variant == "no_tail":
            out[r, 4 * int(n_kept[r]):] = -1
        elif variant == "tail_not_clipped" and 0 <= req < seq_lens.shape[0] and pos >= 0:
            tail = list(range(((pos + 1) // 4) * 4, pos + 1))
            out[r, 4 * int(n_kept[r]):4 * int(n_kept[r]) + len(tail)] = torch.tensor(tail, dtype=torch.int32)
    return out


@pytest.mark.parametrize("variant", ["no_tail", "tail_not_clipped"])
def test_wrong_expansions_are_rejected(device, variant):
    k = 2
    seq = torch.tensor([30, 9], dtype=torch.int32)
    req = torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.int32)
    pos = torch.tensor([29, 28, 27, 26, 10, 13])
    s = special_scores(6, 8, seed=2)
    got = qsa.selection.api.tokens_from_scores(s.to(device), req.to(device), pos.to(device), seq.to(device), k=k).cpu()
    blocks = qsa.selection.reference.topk_blocks_reference(s, qsa.selection.reference.visible_blocks_reference(req, pos, seq), k)
    assert torch.equal(got, qsa.selection.reference.expand_tokens_reference(blocks, req, pos, seq))
    assert not torch.equal(got, _wrong_expand(blocks, req, pos, seq, variant))


# scores and the whole stage


def _stage_inputs(dtype, *, H=4, D=128, seed=0, block_size=16, device="cpu", integer=True):
    seq_lens = [70, 45, 9]
    kc, bt, seq = make_cache(num_reqs=3, max_blocks=5, block_size=block_size, seq_lens=seq_lens, D=D,
                             dtype=dtype, seed=seed, invalid=[(0, 3), (1, 2)], device=device)
    # rows from several requests, interleaved, plus padding rows
    picks = [(0, 69), (0, 68), (1, 44), (0, 30), (2, 8), (1, None), (0, 3), (-1, 5), (2, -1), (0, 67),
             (1, 43), (0, None), (7, 2)]
    req, pos = rows_for(seq_lens, picks, seed=seed)
    g = _gen(seed + 1)
    if integer:
        q = torch.randint(-2, 3, (req.shape[0], H, D), generator=g).to(dtype)
    else:
        q = torch.randn(req.shape[0], H, D, generator=g).to(dtype)
        kc = torch.randn(kc.shape, generator=g).to(dtype).to(device)
    return q.to(device), kc, bt, req.to(device), pos.to(device), seq


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_scores_exact_inputs(device, dtype):
    args = _stage_inputs(dtype, device=device)
    got = qsa.selection.api.block_scores(*args, block_size=BS)
    want = qsa.selection.reference.block_scores_reference(*args)
    assert torch.equal(got, want)


def test_scores_cut_over_column_programs(device, monkeypatch):
    """Columns cut over several programs (as for few rows on a GPU): the same scores and selection."""
    cut = dict(BLOCK_R=16, BLOCK_N=16, n_per_prog=16, num_warps=4, num_stages=1)
    monkeypatch.setattr(qsa.selection.api, "_score_config", lambda n_cols, dtype: dict(cut))
    args = _stage_inputs(torch.bfloat16, device=device, seed=5)
    assert args[2].shape[1] * args[1].shape[1] > 16
    assert torch.equal(qsa.selection.api.block_scores(*args, block_size=BS), qsa.selection.reference.block_scores_reference(*args))
    assert torch.equal(qsa.selection.api.select_tokens(*args, block_size=BS, k=3).cpu(), qsa.selection.reference.select_tokens_reference(*args, k=3).cpu())


@pytest.mark.parametrize("H", [1, 3])
def test_block_scores_head_counts(device, H):
    args = _stage_inputs(torch.bfloat16, H=H, D=64, block_size=8, device=device)
    assert torch.equal(qsa.selection.api.block_scores(*args, block_size=8), qsa.selection.reference.block_scores_reference(*args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_scores_rounding(device, dtype):
    """Random inputs: kernel error vs fp64 at most 2x the fp32 reference's error plus a floor."""
    args = _stage_inputs(dtype, device=device, integer=False, seed=3)
    got = qsa.selection.api.block_scores(*args, block_size=BS).double().cpu()
    exact = qsa.selection.reference.block_scores_reference(*args, dtype=torch.float64).cpu()
    f32 = qsa.selection.reference.block_scores_reference(*args).double().cpu()
    fin = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(got), fin)
    err, err32 = (got - exact)[fin].abs(), (f32 - exact)[fin].abs()
    floor = 4 * torch.finfo(torch.float32).eps * exact[fin].abs().max()
    assert err.max() <= 2 * err32.max() + floor


@pytest.mark.parametrize("k", [1, 3, 8])
def test_select_tokens_exact(device, k):
    args = _stage_inputs(torch.bfloat16, device=device, seed=k)
    out = poisoned((args[0].shape[0], 4 * k + 3), torch.int32, device).fill_(777)
    got = qsa.selection.api.select_tokens(*args, block_size=BS, k=k, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = qsa.selection.reference.select_tokens_reference(*args, k=k)
    assert torch.equal(got.cpu(), want.cpu())
    assert (got[7:9] == -1).all() and (got[12] == -1).all()           # padding rows


def test_select_tokens_non_candidates_excluded(device):
    """Blocks with an invalid table entry are never chosen, even when that leaves fewer than k."""
    k = 16
    args = _stage_inputs(torch.float32, device=device, seed=5)
    q, kc, bt, req, pos, seq = (t.cpu() for t in args)
    got = qsa.selection.api.select_tokens(*args, block_size=BS, k=k).cpu()
    assert torch.equal(got, qsa.selection.reference.select_tokens_reference(*args, k=k).cpu())
    rpb = kc.shape[1]
    vis = qsa.selection.reference.visible_blocks_reference(req, pos, seq)
    n_checked = 0
    for r in range(req.shape[0]):
        toks = got[r][got[r] >= 0]
        for b in (toks // 4).unique().tolist():
            if b < int(vis[r]):                                      # a complete block, not the tail
                page = int(bt[int(req[r]), b // rpb])
                assert 0 <= page < kc.shape[0]
                n_checked += 1
    assert n_checked > 0
    assert (got[0] >= 0).sum() < 4 * k                                # row 0 lost blocks 12..15


def test_positions_past_int32_select_as_past_the_length(device):
    """A row's position only bounds its tokens: any position past the request's length selects the same
    tokens, up to the int64 limit (where ``pos + 1`` would overflow), in the kernels, the baseline and
    the reference; such a row is not a padding row."""
    q, kc, bt, req, pos, seq = _stage_inputs(torch.float32, device=device, integer=False, seed=9)
    real = (req >= 0) & (req < seq.shape[0]) & (pos >= 0)
    lens = seq.long().to(req.device)[torch.where(real, req, 0).long()]
    near = torch.where(real, lens + 10, pos)
    far = near.clone()
    far[0], far[3], far[5] = 2**63 - 1, 2**31 + 5, 2**31 - 1
    select = functools.partial(qsa.selection.api.select_tokens, block_size=BS)
    select.__name__ = "select_tokens"
    for fn in (select, torch_select_baseline, qsa.selection.reference.select_tokens_reference):
        want = fn(q, kc, bt, req, near, seq, k=5)
        got = fn(q, kc, bt, req, far, seq, k=5)
        assert torch.equal(got.cpu(), want.cpu()), fn.__name__
        assert bool((got[[0, 3, 5]] >= 0).any(1).all()), fn.__name__


def test_requests_past_int32_are_not_request_zero(device):
    """An int64 request id past the int32 range (2**32, -2**40) is a padding row, not request 0."""
    q, kc, bt, req, pos, seq = _stage_inputs(torch.float32, device=device, seed=4)
    wide = req.long().clone()
    wide[0], wide[3] = 2**32, -2**40
    got = qsa.selection.api.block_scores(q, kc, bt, wide, pos, seq, block_size=BS)
    want = qsa.selection.reference.block_scores_reference(q, kc, bt, wide, pos, seq)
    assert torch.equal(got.cpu(), want.cpu())
    assert bool((got[[0, 3]] == -INF).all())
    assert torch.equal(qsa.selection.api.select_tokens(q, kc, bt, wide, pos, seq, block_size=BS, k=3).cpu(),
                       qsa.selection.reference.select_tokens_reference(q, kc, bt, wide, pos, seq, k=3).cpu())


def test_select_tokens_refuses_an_out_whose_rows_overlap(device):
    args = _stage_inputs(torch.float32, device=device, seed=2)
    rows, width = args[0].shape[0], 4 * 2 + 3
    for out in (torch.empty(width, dtype=torch.int32, device=device).expand(rows, width),
                torch.empty(5 * rows + width, dtype=torch.int32, device=device).as_strided((rows, width), (5, 1))):
        with pytest.raises(ValueError, match="share memory"):
            qsa.selection.api.select_tokens(*args, block_size=BS, k=2, out=out)


def test_select_tokens_matches_baseline(device):
    """Tie-free random inputs: the PyTorch baseline gives the same selection."""
    args = _stage_inputs(torch.float32, device=device, integer=False, seed=7)
    got = qsa.selection.api.select_tokens(*args, block_size=BS, k=5)
    assert torch.equal(got.cpu(), torch_select_baseline(*args, k=5).cpu())


def test_padded_heads_keep_an_infinite_score(device):
    """H = 3 is padded to 4 heads in the score tile: the zero padding head must not turn an infinite
    compressed key into NaN (0 * inf) in the head sum."""
    q = torch.zeros(1, 3, 16)
    q[0, :, 0] = 1.0
    kc = torch.zeros(1, 2, 16)
    kc[0, 0, 0] = INF
    kc[0, 1, 0] = 1.0
    args = (q.to(device), kc.to(device), torch.tensor([[0]], dtype=torch.int32, device=device),
            torch.tensor([0], device=device), torch.tensor([7], device=device), torch.tensor([8], device=device))
    scores = qsa.selection.api.block_scores(*args, block_size=8)
    assert scores[0, 0].item() == INF
    assert torch.equal(scores.cpu(), qsa.selection.reference.block_scores_reference(*args).cpu())
    want = qsa.selection.reference.select_tokens_reference(*args, k=1).cpu()
    assert want[0, :4].tolist() == [0, 1, 2, 3]
    assert torch.equal(qsa.selection.api.select_tokens(*args, block_size=8, k=1).cpu(), want)
    assert torch.equal(qsa.selection.api.select_tokens(*args, block_size=8, k=1, backend="torch").cpu(), want)


def test_no_request_selects_nothing(device):
    """num_reqs = 0: every row is a padding row, for the kernels and the references alike."""
    q = torch.ones(2, 3, 16, device=device)
    kc = torch.ones(2, 2, 16, device=device)
    bt = torch.zeros(0, 3, dtype=torch.int32, device=device)
    req, pos = torch.tensor([0, 1], device=device), torch.tensor([9, 5], device=device)
    seq = torch.zeros(0, dtype=torch.int32, device=device)
    args = (q, kc, bt, req, pos, seq)
    got = qsa.selection.api.select_tokens(*args, block_size=8, k=2)
    assert bool((got == -1).all()) and got.shape == (2, 11)
    assert torch.equal(qsa.selection.reference.select_tokens_reference(*args, k=2), got)
    assert torch.equal(qsa.selection.api.select_tokens(*args, block_size=8, k=2, backend="torch"), got)
    cand = qsa.selection.reference.candidate_mask_reference(kc, bt, req, pos, seq)
    assert cand.shape == (2, 6) and not bool(cand.any())
    assert qsa.selection.reference.visible_blocks_reference(req, pos, seq).tolist() == [0, 0]
    assert torch.equal(qsa.selection.reference.expand_tokens_reference(torch.tensor([[0, 1], [-1, -1]], device=device), req, pos, seq), got)
    assert torch.equal(qsa.selection.reference.block_scores_reference(*args), qsa.selection.api.block_scores(*args, block_size=8))


def test_torch_select_baseline_edges(device):
    args = _stage_inputs(torch.float32, device=device, integer=False, seed=7)
    n_cols = args[2].shape[1] * args[1].shape[1]
    with pytest.raises(ValueError, match=rf"k must be <= n_cols .*{n_cols}"):
        torch_select_baseline(*args, k=n_cols + 1)
    q, kc, bt, req, pos, seq = args
    # no physical block (every table entry invalid) and no request: only causal tails, or nothing
    no_blocks = (q, kc[:0], bt, req, pos, seq)
    assert torch.equal(torch_select_baseline(*no_blocks, k=3).cpu(),
                       qsa.selection.api.select_tokens(*no_blocks, block_size=BS, k=3).cpu())
    no_reqs = (q, kc, bt[:0], req, pos, seq[:0])
    got = torch_select_baseline(*no_reqs, k=3)
    assert got.shape == (q.shape[0], 15) and bool((got == -1).all())


def test_k_may_be_a_numpy_integer(device):
    np = pytest.importorskip("numpy")
    s = special_scores(3, 10, seed=4)
    vis = torch.tensor([10, 4, 0])
    want = qsa.selection.api.topk_blocks(s.to(device), vis.to(device), 3)
    assert torch.equal(qsa.selection.api.topk_blocks(s.to(device), vis.to(device), np.int64(3)), want)
    with pytest.raises(TypeError, match="k must be an int"):
        qsa.selection.api.topk_blocks(s.to(device), vis.to(device), True)


# compressed-key feeding


def _rope_like(kc, block_idx):
    """A row-wise caller transform: RoPE-style rotation at position 4b plus a scale."""
    half = kc.shape[1] // 2
    pos = (4 * block_idx).double()[:, None]
    ang = pos * torch.arange(half, dtype=torch.float64, device=kc.device)[None, :] * 0.01
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    a, b = kc[:, :half], kc[:, half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=1) * 1.5


@pytest.mark.parametrize("dtype,transform", [(torch.float32, None), (torch.float32, _rope_like),
                                             (torch.bfloat16, _rope_like)])
def test_compressed_keys_chunked_prefill_and_decode(device, dtype, transform):
    D, block_size, max_blocks = 32, 8, 6
    num_reqs = 3
    lengths = [23, 19, 0]
    g = _gen(21)
    raw = [torch.randn(L, D, generator=g) for L in lengths]
    cache = qsa.selection.api.CompressedKeyCache(num_reqs * max_blocks + 1, block_size, num_reqs, dim=D, dtype=dtype,
                                  device=device, transform=transform)
    cache.partial.fill_(NAN)                                        # stale slots must never be read
    perm = torch.randperm(num_reqs * max_blocks + 1, generator=g)[: num_reqs * max_blocks]
    bt = perm.reshape(num_reqs, max_blocks).to(torch.int32).to(device)
    # request 0: chunks 5, 3, 7, 1 then decode; request 1: chunks 2, 9, then decode; padding rows too
    plan = {0: [5, 3, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1], 1: [2, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]}
    done = {0: 0, 1: 0}
    for step in range(12):
        ks, reqs, poss = [], [], []
        for r in (1, 0):                                            # request order varies per batch
            c = min(plan[r][step], lengths[r] - done[r])
            ks.append(raw[r][done[r]:done[r] + c])
            reqs += [r] * c
            poss += list(range(done[r], done[r] + c))
            done[r] += c
        ks.append(torch.randn(2, D, generator=g))
        reqs += [-1, 2]
        poss += [4, -1]
        cache.update(torch.cat(ks).to(device), torch.tensor(reqs, dtype=torch.int32, device=device),
                     torch.tensor(poss, dtype=torch.int64, device=device), bt)
    assert done == {0: 23, 1: 19}
    rpb = block_size // 4
    for r in (0, 1):
        want = qsa.selection.reference.compressed_keys_reference(raw[r], transform).to(dtype)
        got = torch.stack([cache.kc_cache[int(bt[r, b // rpb]), b % rpb] for b in range(want.shape[0])])
        assert torch.equal(got.cpu(), want)
    # the open group of each request is kept
    assert torch.equal(cache.partial[0, :3].cpu(), raw[0][20:23])
    assert torch.equal(cache.partial[1, :3].cpu(), raw[1][16:19])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_compressed_keys_of_ordered_rows_skip_the_sort(device, backend):
    """Rows that already come by (request, position), as the layer's batches do, fed with
    ``rows_ordered=True`` write every bit the sorted path writes (keys and open groups), step after step.
    Known-wrong: the same promise made for rows out of order builds other keys, which the comparison
    sees."""
    if backend == "triton" and device == "cpu" and not qsa.utils.interpreter_enabled():
        pytest.skip("the Triton path needs the interpreter on the CPU")
    D, block_size, max_blocks, num_reqs = 16, 8, 4, 2
    g = _gen(31)
    raw = torch.randn(2, 14, D, generator=g)
    bt = torch.randperm(num_reqs * max_blocks, generator=g).reshape(num_reqs, max_blocks).to(torch.int32).to(device)

    def fresh():
        return (torch.full((num_reqs * max_blocks, block_size // 4, D), NAN, device=device),
                torch.zeros(num_reqs, 3, D, device=device))

    def feed(caches, steps, **kw):
        kc, partial = caches
        for rows in steps:
            reqs = torch.tensor([r for r, _ in rows], dtype=torch.int32, device=device)
            pos = torch.tensor([p for _, p in rows], dtype=torch.int64, device=device)
            keys = torch.stack([raw[r, p] for r, p in rows]).to(device)
            qsa.selection.api.update_compressed_keys(keys, reqs, pos, kc, bt, partial, block_size=block_size,
                                                     transform=_rope_like, backend=backend, **kw)
        return kc.cpu(), partial.cpu()

    steps = [[(0, p) for p in range(6)] + [(1, p) for p in range(5)],       # a prefill chunk of each
             [(0, 6), (0, 7), (0, 8), (1, 5)], [(0, 9), (1, 6)], [(0, 10), (1, 7)]]  # MTP, then decode
    want = feed(fresh(), steps)
    got = feed(fresh(), steps, rows_ordered=True)
    assert torch.equal(got[0].nan_to_num(7.0), want[0].nan_to_num(7.0)) and torch.equal(got[1], want[1])
    shuffled = [list(reversed(rows)) for rows in steps]
    assert torch.equal(feed(fresh(), shuffled)[0].nan_to_num(7.0), want[0].nan_to_num(7.0))  # any order, sorted
    wrong = feed(fresh(), shuffled, rows_ordered=True)
    assert not torch.equal(wrong[0].nan_to_num(7.0), want[0].nan_to_num(7.0)), "a broken promise went unseen"
    with pytest.raises(TypeError, match="rows_ordered"):
        feed(fresh(), steps[:1], rows_ordered=1)


def _key_rope(pos, rot, theta=1e4):
    """The RoPE tables of each row's group start 4 * (pos // 4), as the layer passes them."""
    from qsa.model.functional import rope_cos_sin

    return rope_cos_sin(torch.div(pos, 4, rounding_mode="floor") * 4, rot, theta) if rot else (None, None)


@pytest.mark.parametrize("dtype,rot,with_weight,ordered", [(torch.float32, 8, True, True),
                                                           (torch.bfloat16, 8, True, False),
                                                           (torch.float16, 0, False, True),
                                                           slow(torch.float32, 16, False, False)])
def test_fused_norm_rope_gives_the_transforms_bits(device, dtype, rot, with_weight, ordered):
    """``norm_rope=(weight, eps, cos, sin)``: the Triton store normalises and rotates the closing rows'
    means itself (no PyTorch op). Every bit is the PyTorch path's, the ``transform=index_key_transform(...)``
    path's and the reference compressed keys', over prefill chunks, MTP and decode steps whose groups
    span steps (the open groups held in ``partial``). Known-wrong transforms (the mean of squares summed in
    fp32, RoPE at each closing row's own position instead of the group start, the norm without
    ``1 + w``) give other keys, which the same comparison sees."""
    from qsa.model.functional import apply_rope, index_key_transform, rms_norm, rope_cos_sin

    if device == "cpu" and not qsa.utils.interpreter_enabled():
        pytest.skip("the Triton path needs the interpreter on the CPU")
    D, block_size, max_blocks, num_reqs, eps, theta = 32, 8, 4, 2, 1e-6, 1e4
    g = _gen(41)
    raw = torch.randn(2, 15, D, generator=g) * 3.0
    weight = (torch.randn(D, generator=g) * 0.3).to(device) if with_weight else None
    bt = torch.randperm(num_reqs * max_blocks, generator=g).reshape(num_reqs, max_blocks).to(torch.int32).to(device)
    steps = [[(0, p) for p in range(6)] + [(1, p) for p in range(5)],
             [(0, 6), (0, 7), (0, 8), (1, 5)], [(0, 9), (1, 6)], [(0, 10), (1, 7)], [(0, 11), (1, 8)],
             [(0, p) for p in range(12, 15)] + [(1, p) for p in range(9, 13)]]

    def feed(backend, **kw):
        kc = torch.full((num_reqs * max_blocks, block_size // 4, D), NAN, dtype=dtype, device=device)
        partial = torch.full((num_reqs, 3, D), NAN, device=device)  # a slot read before it is written shows
        for rows in steps:
            rows = rows if ordered else list(reversed(rows))
            reqs = torch.tensor([r for r, _ in rows], dtype=torch.int32, device=device)
            pos = torch.tensor([p for _, p in rows], dtype=torch.int64, device=device)
            keys = torch.stack([raw[r, p] for r, p in rows]).to(device)
            extra = dict(norm_rope=(weight, eps, *_key_rope(pos, rot, theta))) if "transform" not in kw else {}
            qsa.selection.api.update_compressed_keys(keys, reqs, pos, kc, bt, partial, block_size=block_size,
                                                     backend=backend, rows_ordered=ordered, **extra, **kw)
        return kc.cpu()

    def keys_of(kc):
        rpb = block_size // 4
        return torch.cat([torch.stack([kc[int(bt[r, b // rpb]), b % rpb] for b in range(n // 4)])
                          for r, n in ((0, 15), (1, 13))])

    def reference(transform):
        return torch.cat([qsa.selection.reference.compressed_keys_reference(raw[r, :n].to(device), transform)
                          for r, n in ((0, 15), (1, 13))]).to(dtype).cpu()

    fused = feed("triton")
    got = keys_of(fused)
    assert torch.isfinite(got).all()
    transform = index_key_transform(weight, eps, rot, theta)
    assert torch.equal(got, reference(transform)), "fused store vs the reference compressed keys"
    assert torch.equal(fused.nan_to_num(7.0), feed("torch").nan_to_num(7.0)), "Triton vs PyTorch path"
    assert torch.equal(fused.nan_to_num(7.0), feed("torch", transform=transform).nan_to_num(7.0)), \
        "norm_rope vs the transform callable"

    def fp32_sum(kc, b):
        cos, sin = rope_cos_sin(4 * b, rot, theta) if rot else (kc[:, :0], kc[:, :0])
        return apply_rope(rms_norm(kc, weight, eps), cos, sin)

    def at_closing_row(kc, b):
        return qsa.selection.reference.norm_rope_keys(kc, weight, eps, *rope_cos_sin(4 * b + 3, rot, theta))

    def without_weight(kc, b):
        return index_key_transform(None, eps, rot, theta)(kc, b)

    wrong = {"fp32 sum": fp32_sum}
    if rot:
        wrong["RoPE at the closing row"] = at_closing_row
    if with_weight:
        wrong["no 1 + w"] = without_weight
    if dtype != torch.float32:
        wrong.pop("fp32 sum")  # a last-bit difference of fp32 that the cast may hide
    for name, variant in wrong.items():
        assert not torch.equal(got, reference(variant)), f"known-wrong variant {name!r} passes"


def test_compressed_keys_invalid_table_entry_skipped(device):
    D = 16
    kc = torch.full((4, 1, D), 5.0, device=device)
    partial = torch.zeros(1, 3, D, device=device)
    bt = torch.tensor([[2, -1, 9]], dtype=torch.int32, device=device)
    raw = torch.arange(12 * D, dtype=torch.float32).reshape(12, D).to(device)
    qsa.selection.api.update_compressed_keys(raw, torch.zeros(12, dtype=torch.int32, device=device),
                              torch.arange(12, device=device), kc, bt, partial, block_size=4)
    assert torch.equal(kc[2, 0].cpu(), qsa.selection.reference.compressed_keys_reference(raw.cpu())[0])
    assert (kc[[0, 1, 3]] == 5.0).all()


def test_compressed_keys_reference_short_sequences():
    """Fewer than 4 tokens close no group: an empty [0, D] result, not an error."""
    x = torch.arange(5 * 16, dtype=torch.float32).reshape(5, 16)
    for length in (0, 1, 3):
        kc = qsa.selection.reference.compressed_keys_reference(x[:length])
        assert kc.shape == (0, 16) and kc.dtype == torch.float32
    assert torch.equal(qsa.selection.reference.compressed_keys_reference(x), x[:4].mean(0, keepdim=True))


def test_compressed_key_feeding_refuses_a_zero_width(device):
    req, pos = torch.zeros(4, dtype=torch.int64, device=device), torch.arange(4, device=device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="raw_k width D must be a power of two >= 1"):
        qsa.selection.api.update_compressed_keys(torch.zeros(4, 0, device=device), req, pos,
                                  torch.zeros(2, 4, 0, device=device), bt, torch.zeros(1, 3, 0, device=device),
                                  block_size=16)


@pytest.mark.parametrize("change,exc,match", [
    (dict(dim=0), ValueError, "dim must be a power of two >= 16"),
    (dict(dim=8), ValueError, "dim must be a power of two >= 16"),
    (dict(dim=48), ValueError, "dim must be a power of two >= 16"),
    (dict(dim=16.0), TypeError, "dim must be an int"),
    (dict(num_blocks=-1), ValueError, "num_blocks must be an int >= 0"),
    (dict(num_blocks=2.0), TypeError, "num_blocks must be an int"),
    (dict(num_reqs=-1), ValueError, "num_reqs must be an int >= 0"),
    (dict(dtype=torch.int32), TypeError, "dtype must be float16, bfloat16 or float32"),
    (dict(dtype=torch.float64), TypeError, "dtype must be float16, bfloat16 or float32"),
    (dict(transform="rope"), TypeError, "transform must be callable or None, got str"),
])
def test_compressed_key_cache_checks_its_geometry(change, exc, match):
    kw = dict(num_blocks=2, block_size=8, num_reqs=1, dim=16, dtype=torch.float32, device="cpu")
    qsa.selection.api.CompressedKeyCache(**kw)
    kw.update(change)
    with pytest.raises(exc, match=match):
        qsa.selection.api.CompressedKeyCache(**kw)


# argument checks


def test_bad_arguments(device):
    q, kc, bt, req, pos, seq = _stage_inputs(torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="index_q"):
        qsa.selection.api.select_tokens(q[:, 0], kc, bt, req, pos, seq, block_size=BS)
    with pytest.raises(TypeError, match="kc_cache"):
        qsa.selection.api.select_tokens(q, kc.float(), bt, req, pos, seq, block_size=BS)
    with pytest.raises(ValueError, match="kc_cache"):
        qsa.selection.api.select_tokens(q, kc[..., :64], bt, req, pos, seq, block_size=BS)
    with pytest.raises(TypeError, match="block_table"):
        qsa.selection.api.select_tokens(q, kc, bt.long(), req, pos, seq, block_size=BS)
    with pytest.raises(ValueError, match="positions"):
        qsa.selection.api.select_tokens(q, kc, bt, req, pos[:-1], seq, block_size=BS)
    with pytest.raises(TypeError, match="token_to_req"):
        qsa.selection.api.select_tokens(q, kc, bt, req.float(), pos, seq, block_size=BS)
    with pytest.raises(ValueError, match="seq_lens"):
        qsa.selection.api.select_tokens(q, kc, bt, req, pos, seq[:-1], block_size=BS)
    with pytest.raises(ValueError, match="k must be"):
        qsa.selection.api.select_tokens(q, kc, bt, req, pos, seq, block_size=BS, k=0)
    with pytest.raises(ValueError, match="k must be"):
        qsa.selection.api.topk_blocks(torch.zeros(2, 4, device=device), torch.zeros(2, dtype=torch.int32, device=device), 2049)
    with pytest.raises(TypeError, match="k must be"):
        qsa.selection.api.topk_blocks(torch.zeros(2, 4, device=device), torch.zeros(2, dtype=torch.int32, device=device), 2.0)
    with pytest.raises(ValueError, match="visible"):
        qsa.selection.api.topk_blocks(torch.zeros(2, 4, device=device), torch.zeros(3, dtype=torch.int32, device=device), 2)
    with pytest.raises(TypeError, match="scores"):
        qsa.selection.api.topk_blocks(torch.zeros(2, 4, dtype=torch.int32, device=device),
                       torch.zeros(2, dtype=torch.int32, device=device), 2)
    with pytest.raises(ValueError, match="out"):
        qsa.selection.api.select_tokens(q, kc, bt, req, pos, seq, block_size=BS, k=2,
                         out=torch.empty(3, 11, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="partial"):
        qsa.selection.api.update_compressed_keys(torch.zeros(4, 128, device=device), req[:4], pos[:4],
                                  kc, bt, torch.zeros(3, 4, 128, device=device), block_size=BS)
    with pytest.raises(TypeError, match="index_q must be a torch.Tensor"):
        qsa.selection.api.select_tokens(q.tolist(), kc, bt, req, pos, seq, block_size=BS)
    with pytest.raises(TypeError, match="transform must be callable or None, got int"):
        qsa.selection.api.update_compressed_keys(torch.zeros(4, 128, device=device), req[:4], pos[:4], kc.float(), bt,
                                  torch.zeros(bt.shape[0], 3, 128, device=device), block_size=BS, transform=3)


# GPU: production sizes, bitwise, CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16384, 65536])
def test_gpu_topk_production(n):
    rows, k = 257, 512
    g = _gen(n)
    s = torch.randint(0, 2000, (rows, n), generator=g).float()
    s[torch.rand(rows, n, generator=g) < 0.01] = NAN
    s[torch.rand(rows, n, generator=g) < 0.01] = -0.0
    s[3, :] = 1.0
    vis = torch.randint(-1, n + 2, (rows,), generator=g)
    vis[:6] = torch.tensor([0, 1, k - 1, k, k + 1, n])
    s, vis = s.cuda(), vis.cuda()
    want = qsa.selection.reference.topk_blocks_reference(s, vis, k)
    assert torch.equal(qsa.selection.api.topk_blocks(s, vis, k), want)
    assert torch.equal(qsa.selection.api.topk_blocks(s, vis, k), want)             # run to run


def _gpu_stage(rows, n_blocks, *, num_reqs=3, block_size=64, seed=0, integer=True):
    g = _gen(seed)
    rpb = block_size // 4
    max_blocks = n_blocks // rpb
    num_blocks = num_reqs * max_blocks + 5
    D, H = 128, 4
    if integer:
        kc = torch.randint(-4, 5, (num_blocks, rpb, D), generator=g).to(torch.bfloat16)
        q = torch.randint(-3, 4, (rows, H, D), generator=g).to(torch.bfloat16)
    else:
        kc = torch.randn(num_blocks, rpb, D, generator=g).to(torch.bfloat16)
        q = torch.randn(rows, H, D, generator=g).to(torch.bfloat16)
    bt = torch.randperm(num_blocks, generator=g)[: num_reqs * max_blocks].reshape(num_reqs, max_blocks)
    bt = bt.to(torch.int32)
    bt[0, 3] = -1
    seq = torch.randint(4 * n_blocks // 2, 4 * n_blocks + 1, (num_reqs,), generator=g).to(torch.int32)
    req = torch.sort(torch.randint(0, num_reqs, (rows,), generator=g)).values.to(torch.int32)
    pos = (seq.long()[req] - 1 - torch.randint(0, 2000, (rows,), generator=g)).clamp(min=-1)
    req[-3:] = torch.tensor([-1, num_reqs, 0], dtype=torch.int32)
    pos[-1] = -1
    return [t.cuda() for t in (q, kc, bt, req, pos, seq)]


@pytest.mark.gpu
def test_gpu_select_tokens_exact():
    args = _gpu_stage(1031, 8192, seed=1)
    got = qsa.selection.api.select_tokens(*args, block_size=64, k=512)
    assert torch.equal(got, qsa.selection.reference.select_tokens_reference(*args, k=512))
    assert torch.equal(got, qsa.selection.api.select_tokens(*args, block_size=64, k=512))


@pytest.mark.gpu
def test_gpu_scores_rounding():
    args = _gpu_stage(300, 4096, seed=2, integer=False)
    got = qsa.selection.api.block_scores(*args, block_size=64).double()
    exact = qsa.selection.reference.block_scores_reference(*args, dtype=torch.float64)
    f32 = qsa.selection.reference.block_scores_reference(*args).double()
    fin = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(got), fin)
    floor = 4 * torch.finfo(torch.float32).eps * exact[fin].abs().max()
    assert (got - exact)[fin].abs().max() <= 2 * (f32 - exact)[fin].abs().max() + floor
    # top-k + expansion on the kernel's own scores is bitwise the reference's
    q, kc, bt, req, pos, seq = args
    cand = qsa.selection.reference.candidate_mask_reference(kc, bt, req, pos, seq)
    vis = qsa.selection.reference.visible_blocks_reference(req, pos, seq)
    blocks = qsa.selection.reference.topk_blocks_reference(got.float(), vis, 512, candidates=cand)
    assert torch.equal(qsa.selection.api.select_tokens(*args, block_size=64, k=512),
                       qsa.selection.reference.expand_tokens_reference(blocks, req, pos, seq))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    k = 512
    a = _gpu_stage(515, 8192, seed=3)
    static = [t.clone() for t in a]
    qsa.selection.api.select_tokens(*static, block_size=64, k=k)                    # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qsa.selection.api.select_tokens(*static, block_size=64, k=k)
    for seed in (4, 5):
        b = _gpu_stage(515, 8192, seed=seed)
        for dst, src in zip(static, b):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, qsa.selection.api.select_tokens(*b, block_size=64, k=k))
        assert torch.equal(out, qsa.selection.reference.select_tokens_reference(*b, k=k))


@pytest.mark.gpu
def test_gpu_cuda_graph_topk_replay():
    rows, n, k = 129, 16384, 512
    s = torch.randn(rows, n, device="cuda")
    vis = torch.full((rows,), n, device="cuda")
    qsa.selection.api.topk_blocks(s, vis, k)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qsa.selection.api.topk_blocks(s, vis, k)
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        s.copy_(torch.randint(0, 50, (rows, n), device="cuda", generator=g).float())
        vis.copy_(torch.randint(-1, n + 1, (rows,), device="cuda", generator=g))
        graph.replay()
        assert torch.equal(out, qsa.selection.reference.topk_blocks_reference(s, vis, k))
