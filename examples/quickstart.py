"""Quickstart: one step of QSA sparse paged attention, end to end, with the public API of ``qsa``.

What it does, in order:

1. allocates a paged KV cache and gives two requests of different lengths their pages with a
   ``qsa.BlockAllocator`` (block table + slot mapping);
2. writes the K/V of their prompts into the cache (``qsa.write_kv``) and builds the compressed-key
   cache of the indexer from raw index keys (``qsa.CompressedKeyCache`` + ``qsa.update_compressed_keys``),
   first for the tokens of earlier steps, then for the tokens of this step;
3. selects, for every row of this step, the ``k`` best 4-token blocks of its request plus its causal
   tail (``qsa.select_tokens``), with more candidate blocks than ``k`` so the selection is sparse;
4. runs the attention twice: planned once and run (``qsa.plan_attention`` + ``qsa.run_attention``, with
   a gate), and in one call (``qsa.sparse_paged_attention``);
5. checks both against the fp64 ``qsa.reference_attention`` and exits 1 on a mismatch.

Run it with::

    python examples/quickstart.py                 # the GPU if there is one, else the CPU
    python examples/quickstart.py --device cpu    # Triton kernels under the CPU interpreter
    python examples/quickstart.py --size reference   # QSA's real head shape (meant for a GPU)

Without a CUDA device the Triton kernels run under the Triton interpreter: the script sets
``TRITON_INTERPRET=1`` before importing ``qsa`` (the flag is read when the kernels are defined) and
says so. The default size on a CPU (``small``) finishes in seconds; on a GPU the default is
``reference``: 6 query heads and 1 KV head of 256, index queries of 4 x 128 and the top-512 blocks.

The tolerance is the one the project's tests use: the kernel's largest error against the fp64
reference may be at most twice that of plain PyTorch at the activation precision
(``reference_attention(..., compute_dtype=bfloat16)``), plus one unit of rounding at the largest value.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

# The Triton interpreter must be switched on before qsa (and so its kernels) is imported.
INTERPRETER_SET_HERE = False
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    os.environ["TRITON_INTERPRET"] = "1"
    INTERPRETER_SET_HERE = True

import qsa  # noqa: E402


@dataclass(frozen=True)
class Size:
    """The shapes of the example."""

    num_q_heads: int        # query heads (per tensor-parallel rank)
    num_kv_heads: int       # KV heads; each serves num_q_heads // num_kv_heads query heads
    head_dim: int           # D of q, K and V
    index_heads: int        # heads of the index queries
    index_dim: int          # width of the index queries and keys (a power of two >= 16)
    k: int                  # 4-token blocks each row keeps
    block_size: int         # tokens per page of the KV cache (a multiple of 4)
    prompt_lens: tuple      # total tokens of each request after this step
    step_lens: tuple        # of which this step brings the last ones (the rows of the step)
    num_blocks: int         # physical pages of the cache


SIZES = {
    # Seconds under the interpreter. A prefill chunk of 64 rows of request 0 (grouped route) next to a
    # decode row of request 1 (single-row route). Each row sees 9 to 25 blocks of 4 tokens: more than
    # k = 8, so it keeps only some of its candidates.
    "small": Size(num_q_heads=4, num_kv_heads=1, head_dim=64, index_heads=4, index_dim=32, k=8,
                  block_size=16, prompt_lens=(101, 62), step_lens=(64, 1), num_blocks=24),
    # QSA's shape on one rank of TP4: 6/1 heads of 256, index 4 x 128, top-512 blocks (2048 tokens plus
    # the causal tail). A prefill chunk of 128 rows (grouped route) next to a decode row (single-row
    # route), over 6000 and 3001 tokens of context.
    "reference": Size(num_q_heads=6, num_kv_heads=1, head_dim=256, index_heads=4, index_dim=128, k=512,
                      block_size=16, prompt_lens=(6000, 3001), step_lens=(128, 1), num_blocks=640),
}

DTYPE = torch.bfloat16  # activations, KV cache, index queries and compressed keys, as in QSA


@dataclass
class CheckResult:
    """Outcome of :func:`check_attention`: ``ok`` iff ``err <= bound``."""

    ok: bool
    err: float        # max |out - ref| (inf when out has a NaN or an inf)
    torch_err: float  # max |ref_lowp - ref|: what plain PyTorch at the activation dtype gets
    bound: float      # factor * torch_err + one rounding step at max |ref|


def check_attention(out: torch.Tensor, ref: torch.Tensor, ref_lowp: torch.Tensor, *,
                    factor: float = 2.0) -> CheckResult:
    """Compare ``out`` with the fp64 reference ``ref``.

    Passes when ``max |out - ref| <= factor * max |ref_lowp - ref| + eps(out.dtype) * max |ref|``, where
    ``ref_lowp`` is the same attention computed by PyTorch at ``out``'s precision. A non-finite value in
    ``out`` or a shape mismatch fails.
    """
    ref = ref.double()
    torch_err = float((ref_lowp.double() - ref).abs().max())
    floor = torch.finfo(out.dtype).eps * float(ref.abs().max())
    bound = factor * torch_err + floor
    if out.shape != ref.shape or not bool(torch.isfinite(out).all()):
        return CheckResult(False, float("inf"), torch_err, bound)
    err = float((out.double() - ref).abs().max())
    return CheckResult(err <= bound, err, torch_err, bound)


def build_step(size: Size, device: torch.device, seed: int = 0) -> dict:
    """Pages, cache contents, compressed keys and this step's inputs; returns the tensors of the step."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):  # drawn on the CPU so every device gets the same numbers
        return torch.randn(*shape, generator=gen).to(DTYPE).to(device)

    num_reqs = len(size.prompt_lens)

    # --- 1. Pages. The allocator hands out shuffled physical blocks (block 0 is kept back), so the
    # logical order of a request's pages has nothing to do with their physical order.
    allocator = qsa.BlockAllocator(size.num_blocks, size.block_size, generator=seed)
    for req, length in enumerate(size.prompt_lens):
        allocator.allocate(req, length)
    block_table = allocator.block_table(range(num_reqs), device=device)       # [num_reqs, max_blocks] int32
    seq_lens = torch.tensor(size.prompt_lens, dtype=torch.int32, device=device)  # tokens after this step

    # The KV cache: [num_blocks, 2, block_size, Hkv, D], K = kv[:, 0], V = kv[:, 1]. Filled with NaN, so a
    # read of any slot that was never written would show up in the output.
    cache = qsa.allocate_kv_cache(size.num_blocks, size.block_size, size.num_kv_heads, size.head_dim,
                                  dtype=DTYPE, fill="nan", device=device)
    # The indexer's compressed keys: one key per 4 tokens, paged with the same block table
    # ([num_blocks, block_size // 4, index_dim]), plus each request's still-open group of raw keys.
    kc = qsa.CompressedKeyCache(size.num_blocks, size.block_size, num_reqs, dim=size.index_dim, dtype=DTYPE,
                                device=device)

    # --- 2. Fill the caches, step by step as a serving engine does. A step is a flat batch of tokens:
    # token_to_req says whose each row is, positions where it sits in its request.
    def rows_of(spans):
        """token_to_req, positions and slot_mapping of the token ranges [start, end) of each request."""
        reqs = [torch.full((end - start,), req, dtype=torch.int32) for req, (start, end) in enumerate(spans)]
        pos = [torch.arange(start, end, dtype=torch.int64) for start, end in spans]
        slots = [allocator.slot_mapping(req, start, end, device=device) for req, (start, end) in enumerate(spans)]
        return torch.cat(reqs).to(device), torch.cat(pos).to(device), torch.cat(slots)

    def write_tokens(token_to_req, positions, slot_mapping):
        """What every step does first: store the new tokens' K/V and fold their raw index keys into the
        compressed-key cache (a group of 4 tokens may close in a later step: ``kc.partial`` carries it)."""
        n = token_to_req.shape[0]
        k_new = randn(n, size.num_kv_heads, size.head_dim)
        v_new = randn(n, size.num_kv_heads, size.head_dim)
        qsa.write_kv(cache.k, cache.v, k_new, v_new, slot_mapping)
        raw_index_keys = randn(n, size.index_dim)
        # (A QSA layer also passes transform=, RMSNorm and RoPE of each compressed key; see docs/layer.md.)
        qsa.update_compressed_keys(raw_index_keys, token_to_req, positions, kc.kc_cache, block_table,
                                   kc.partial, block_size=size.block_size)

    # Earlier steps: everything before this step's tokens (one batch here, for brevity).
    earlier = [(0, total - new) for total, new in zip(size.prompt_lens, size.step_lens)]
    write_tokens(*rows_of(earlier))

    # This step: the last step_lens[i] tokens of request i. Their K/V and keys go in before the
    # selection and the attention, so each row sees its own token.
    now = [(total - new, total) for total, new in zip(size.prompt_lens, size.step_lens)]
    token_to_req, positions, slot_mapping = rows_of(now)
    write_tokens(token_to_req, positions, slot_mapping)
    rows = token_to_req.shape[0]

    # --- 3. Selection. The index queries of this step's rows score every visible 4-token block of their
    # request against its compressed key; each row keeps the k best blocks (ascending) + its causal tail.
    index_q = randn(rows, size.index_heads, size.index_dim)
    indices = qsa.select_tokens(index_q, kc.kc_cache, block_table, token_to_req, positions, seq_lens,
                                k=size.k, block_size=size.block_size)   # [rows, 4k + 3] int32, -1 = none

    # The attention's activations of this step: queries and the output gate, [rows, Hq, D].
    q = randn(rows, size.num_q_heads, size.head_dim)
    gate = randn(rows, size.num_q_heads, size.head_dim)
    return dict(q=q, gate=gate, kv=cache.storage, indices=indices, block_table=block_table,
                token_to_req=token_to_req, positions=positions, seq_lens=seq_lens)


def run_example(size: Size, device: torch.device, seed: int = 0) -> dict:
    """Build a step, run the attention both ways and the references. Returns the step's tensors, the
    outputs (``planned``, ``one_call``), the references (``ref`` fp64, ``ref_lowp`` bf16) and the plan."""
    step = build_step(size, device, seed)
    q, gate, kv = step["q"], step["gate"], step["kv"]
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    batch = (step["indices"], step["block_table"], step["token_to_req"], step["positions"], step["seq_lens"])

    # --- 4a. Plan once, run many: the plan (which kernel takes which rows, and their work lists) is built
    # on the device without a host synchronisation and serves every layer that shares the selection.
    # rows_sorted=True: the indices come from select_tokens, ascending with -1 last.
    plan = qsa.plan_attention(*batch, block_size=size.block_size, num_blocks=size.num_blocks,
                              num_q_heads=size.num_q_heads, num_kv_heads=size.num_kv_heads,
                              head_dim=size.head_dim, rows_sorted=True)
    planned = qsa.run_attention(plan, q, k_cache, v_cache, gate=gate)  # round(attn) * sigmoid(gate)

    # --- 4b. The same in one call (it plans inside).
    one_call = qsa.sparse_paged_attention(q, k_cache, v_cache, *batch, gate=gate, rows_sorted=True)

    # --- 5. References in PyTorch: fp64 (the truth) and bf16 (the yardstick for the tolerance).
    ref, _ = qsa.reference_attention(q, k_cache, v_cache, *batch, gate=gate, compute_dtype=torch.float64)
    ref_lowp, _ = qsa.reference_attention(q, k_cache, v_cache, *batch, gate=gate, compute_dtype=DTYPE)
    return dict(step, planned=planned, one_call=one_call, ref=ref, ref_lowp=ref_lowp, plan=plan)


def describe_route(plan) -> str:
    """Which kernels the plan sends the rows to."""
    r = plan.routes
    rows = plan.num_rows
    if r.route in ("grouped", "xqa"):
        parts = []
        if r.grouped_rows:
            parts.append(f"{r.grouped_rows} rows grouped (8 adjacent rows per K/V load)")
        if rows > r.grouped_rows:
            n = rows - r.grouped_rows
            how = "direct, planned inside the kernel" if r.direct else "planned"
            parts.append(f"{n} row{'s' * (n != 1)} single-row xqa ({how})")
        return "; ".join(parts)
    return f"{rows} rows on the {r.route} route"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda if available, else cpu (Triton interpreter)")
    p.add_argument("--size", choices=("auto",) + tuple(SIZES), default="auto",
                   help="auto: reference on cuda, small on cpu")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device found", file=sys.stderr)
        return 2
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type == "cpu" and not interpreted:
        # qsa was imported with the interpreter off (there is a GPU); rerun this script with it on.
        return subprocess.call([sys.executable, os.path.abspath(__file__), *argv],
                               env=dict(os.environ, TRITON_INTERPRET="1"))
    size_name = args.size if args.size != "auto" else ("reference" if device.type == "cuda" else "small")
    size = SIZES[size_name]

    if INTERPRETER_SET_HERE:
        print("no CUDA device: TRITON_INTERPRET=1 set, the Triton kernels run under the CPU interpreter")
    elif device.type == "cpu":
        print("the Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)")
    print(f"qsa {qsa.__version__} on {device}, size {size_name}: {size.num_q_heads}/{size.num_kv_heads} heads "
          f"x {size.head_dim}, index {size.index_heads} x {size.index_dim}, top-{size.k} blocks, "
          f"block size {size.block_size}")

    res = run_example(size, device, args.seed)

    # What the selection kept: every row attends at most 4k + 3 tokens of its causal context.
    kept = (res["indices"] >= 0).sum(1).cpu()
    context = (res["positions"] + 1).cpu()
    candidates = torch.minimum(context // 4, res["seq_lens"].cpu()[res["token_to_req"].long().cpu()] // 4)
    rows_per_req = ", ".join(f"the last {n} of request {i}" for i, n in enumerate(size.step_lens))
    print(f"step: requests of {' and '.join(map(str, size.prompt_lens))} tokens; "
          f"{res['q'].shape[0]} rows: {rows_per_req}")
    print(f"selection: {int(candidates.min())}-{int(candidates.max())} candidate blocks per row, k = {size.k}; "
          f"each row attends {int(kept.min())}-{int(kept.max())} of its {int(context.min())}-{int(context.max())} "
          f"tokens")
    print(f"route: {describe_route(res['plan'])}")

    ok = True
    for name in ("planned", "one_call"):
        c = check_attention(res[name], res["ref"], res["ref_lowp"])
        label = "plan_attention + run_attention" if name == "planned" else "sparse_paged_attention"
        print(f"{label}: max |err| vs fp64 reference {c.err:.3e} (bf16 PyTorch {c.torch_err:.3e}, "
              f"bound {c.bound:.3e}): {'ok' if c.ok else 'MISMATCH'}")
        ok &= c.ok
    same = torch.equal(res["planned"], res["one_call"])
    print(f"plan + run and the one-call op bitwise equal: {same}")
    ok &= same
    print("quickstart: all checks passed" if ok else "quickstart: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
