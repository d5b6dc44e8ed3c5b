"""The adversarial case on the GPU, for ``compute-sanitizer --tool memcheck python tests/gpu_memcheck.py``.

Wild index values (INT32_MIN/MAX, huge, negative), wild block-table entries, padding rows, FP8 and
fp16 caches, every route (the invariant one folding and merging) and both planners. Exits non-zero if an output is not finite.
"""

import sys

import torch

import qsa
import qsa.attention.invariant.launch
from helpers import make_attention_case


def negatives_last(indices: torch.Tensor) -> torch.Tensor:
    """Each row sorted ascending with its negative entries moved to the end as -1 (int32)."""
    key = torch.sort(torch.where(indices < 0, 2**40, indices.long()), dim=1).values
    return torch.where(key == 2**40, -1, key).to(torch.int32)


def main() -> int:
    g = torch.Generator().manual_seed(0)
    wild = torch.tensor([-2**31, -5, 2**31 - 1, 2**30, 10**6], dtype=torch.int32)
    bad = 0
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        case = make_attention_case(rows=77, num_reqs=3, num_q_heads=6, num_kv_heads=1, head_dim=64,
                                   width=40, kv_cache_dtype=kv_cache_dtype, seed=1, device="cuda")
        pick = torch.randint(0, 5, case.indices.shape, generator=g)
        swap = torch.rand(case.indices.shape, generator=g) < 0.3
        idx = case.indices.cpu()
        idx[swap] = wild[pick[swap]]
        case.indices = idx.cuda()
        case.block_table[:, -1] = torch.tensor([2**31 - 1, -2**31, case.cache.num_blocks],
                                               dtype=torch.int32, device="cuda")[:case.block_table.shape[0]]
        runs = [(route, {}) for route in ("auto", "grouped", "xqa", "splitk", "invariant")]
        runs.append(("xqa", dict(rows_sorted=True)))  # 77 rows: the planned kernel
        for route, kw in runs:
            out, lse = case.run(qsa.sparse_paged_attention, route=route, return_lse=True, **kw)
            torch.cuda.synchronize()
            ok = bool(torch.isfinite(out).all())
            bad += not ok
            print(f"{kv_cache_dtype:9s} {route:8s} {kw} finite={ok}")
        # splitk's long and short tiles, whichever the case's lists would take (the long ones: past
        # SPLITK_FEW_LISTS lists outside the one-wave window, and past SPLITK_FP8_FEW_LISTS over an FP8 cache,
        # on three stages there).
        names = ("SPLITK_FEW_LISTS", "SPLITK_FP8_FEW_LISTS", "SPLITK_SHORT_PER_SM")
        bounds = {k: getattr(qsa.settings, k) for k in names}
        for tiles, value in (("long", 0), ("short", 1 << 30)):
            for k in names:
                setattr(qsa.settings, k, value)
            try:
                out, lse = case.run(qsa.sparse_paged_attention, route="splitk", return_lse=True)
                torch.cuda.synchronize()
            finally:
                for k, v in bounds.items():
                    setattr(qsa.settings, k, v)
            ok = bool(torch.isfinite(out).all())
            bad += not ok
            print(f"{kv_cache_dtype:9s} splitk   {tiles} tiles finite={ok}")
        bad += _invariant_folding(case, kv_cache_dtype, "as given")
        # Wild rows sorted with negatives last: the row planner's ascending-row path (xqa, splitk), the
        # invariant route's rows read as their own lists.
        given = case.indices
        case.indices = negatives_last(given)
        bad += _invariant_folding(case, kv_cache_dtype, "sorted")
        for route in ("xqa", "splitk", "invariant"):
            out, lse = case.run(qsa.sparse_paged_attention, route=route, return_lse=True)
            torch.cuda.synchronize()
            ok = bool(torch.isfinite(out).all())
            bad += not ok
            print(f"{kv_cache_dtype:9s} {route:8s} sorted finite={ok}")
        case.indices = given
        # The direct kernel (few rows, rows_sorted): wild rows as given (in-kernel sort) and sorted
        # with negatives last (its fast path reads the row itself).
        small = torch.arange(12, device="cuda")
        for order in ("as given", "sorted"):
            idx = case.indices[:12]
            if order == "sorted":
                idx = negatives_last(idx)
            out, lse = qsa.sparse_paged_attention(
                case.q[:12], case.cache.k, case.cache.v, idx, case.block_table,
                case.token_to_req[small], case.positions[small], case.seq_lens, kv_cache_dtype=kv_cache_dtype,
                k_scale=case.cache.k_scale, v_scale=case.cache.v_scale, rows_sorted=True, return_lse=True)
            torch.cuda.synchronize()
            ok = bool(torch.isfinite(out).all())
            bad += not ok
            print(f"{kv_cache_dtype:9s} direct   {order} finite={ok}")
    # Real width, 64 rows: the direct kernel's one-wave splits of 1024 (one KV head) and 2048 (two)
    # entries, read before the loop, with wild entries in sorted rows; without the hint, the planned kernel
    # cut by the width's tiles as the direct kernel is (qsa.attention.xqa.launch.xqa_cut), short rows among them.
    for num_kv_heads in (1, 2):
        case = make_attention_case(rows=64, num_reqs=64, num_q_heads=6 * num_kv_heads, num_kv_heads=num_kv_heads,
                                   head_dim=64, width=2051, max_seq_len=2400, padding_rows=2, seed=2, device="cuda")
        idx = case.indices.cpu().long()
        pick = torch.randint(0, 5, idx.shape, generator=g)
        swap = torch.rand(idx.shape, generator=g) < 0.05
        idx[swap] = wild[pick[swap]].long()
        case.indices = negatives_last(idx).cuda()
        for hint in (True, False):
            out, lse = case.run(qsa.sparse_paged_attention, route="xqa", rows_sorted=hint, return_lse=True)
            torch.cuda.synchronize()
            ok = bool(torch.isfinite(out).all())
            bad += not ok
            print(f"{'direct' if hint else 'planned'}, 64 rows x 2051, {num_kv_heads} KV heads finite={ok}")
        out, lse = case.run(qsa.sparse_paged_attention, route="invariant", return_lse=True)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all())
        bad += not ok
        print(f"invariant, 64 rows x 2051, {num_kv_heads} KV heads finite={ok}")
        bad += _invariant_folding(case, "auto", f"64 rows x 2051, {num_kv_heads} KV heads")
    return 1 if bad else 0


def _invariant_folding(case, kv_cache_dtype, what) -> int:
    """The invariant route with one program per row folding its splits (shipped from
    ``INVARIANT_FOLD_LISTS`` lists; forced here): 1 if an output is not finite."""
    folds = qsa.attention.invariant.launch.invariant_folds
    qsa.attention.invariant.launch.invariant_folds = lambda lists: True
    try:
        out, lse = case.run(qsa.sparse_paged_attention, route="invariant", return_lse=True)
        torch.cuda.synchronize()
    finally:
        qsa.attention.invariant.launch.invariant_folds = folds
    ok = bool(torch.isfinite(out).all())
    print(f"{kv_cache_dtype:9s} invariant folding, {what} finite={ok}")
    return int(not ok)


if __name__ == "__main__":
    sys.exit(main())
