"""Plan + attention captured in one CUDA graph and replayed over several serving steps.

The attention plan is built on the device without any host synchronisation, and
``qsa.plan_attention(..., out=plan)`` refills an existing plan's buffers in place, so planning and
attention can be captured together once and replayed every step after the step's data has been copied
into the captured input buffers. This script:

1. fills a paged KV cache and the indexer's compressed-key cache with two requests' context, builds
   the first step (a 64- or 128-row prefill chunk of request 0 next to a decode row of request 1),
   selects its tokens, and captures ``plan_attention(..., out=plan)`` + ``run_attention`` in a
   ``torch.cuda.CUDAGraph``;
2. replays the graph for that step, then for the next step (new tokens' K/V written into the cache,
   new compressed keys, a new selection, new positions and sequence lengths, new q and gate), then for
   the same step after every page of the cache has moved (``qsa.relocate``: a new block table, the
   selection made again through it), then for one more step written through the moved pages;
3. checks each replay bitwise against an eager ``qsa.sparse_paged_attention`` on the same data, against
   the fp64 ``qsa.reference_attention`` within the quickstart's tolerance, and the replay after the move
   bitwise against the one before it (outputs do not depend on where the pages are).

It prints what it checked and exits 1 if any check fails. It needs a CUDA device: without one it prints
a message saying so and exits 0, so that it can run anywhere (CI included) without failing.

    python examples/cuda_graph.py                  # QSA's shape: 6/1 heads x 256, top-512 blocks
    python examples/cuda_graph.py --size small     # the quickstart's small shape
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import DTYPE, SIZES, Size, check_attention  # noqa: E402  (sets up the interpreter if no GPU)

import qsa  # noqa: E402

NO_CUDA_MESSAGE = "cuda_graph.py: no CUDA device, nothing to capture (CUDA graphs need a GPU); skipped"


class Step:
    """The fixed-shape buffers a captured step reads, and how to fill them for each new step.

    Rows are this step's tokens: ``step_lens[0]`` of request 0 then ``step_lens[1]`` of request 1, every
    step (a CUDA graph replays fixed shapes). Every request gets the pages of its final length up front,
    so the block table keeps its width and slots follow from the table itself.
    """

    def __init__(self, size: Size, num_steps: int, device: torch.device, seed: int):
        self.size, self.device = size, device
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.starts = [total - new for total, new in zip(size.prompt_lens, size.step_lens)]  # step 0's first token
        finals = [start + num_steps * new for start, new in zip(self.starts, size.step_lens)]
        num_reqs = len(finals)

        allocator = qsa.BlockAllocator(size.num_blocks, size.block_size, generator=seed)
        for req, length in enumerate(finals):
            allocator.allocate(req, length)
        self.cache = qsa.allocate_kv_cache(size.num_blocks, size.block_size, size.num_kv_heads, size.head_dim,
                                           dtype=DTYPE, fill="nan", device=device)
        self.kc = qsa.CompressedKeyCache(size.num_blocks, size.block_size, num_reqs, dim=size.index_dim,
                                         dtype=DTYPE, device=device)

        # The captured input buffers. Each step's data is copied into these same tensors.
        rows = sum(size.step_lens)
        self.block_table = allocator.block_table(range(num_reqs), device=device)
        self.token_to_req = torch.cat([torch.full((n,), req, dtype=torch.int32, device=device)
                                       for req, n in enumerate(size.step_lens)])
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=device)
        self.indices = torch.zeros(rows, 4 * size.k + 3, dtype=torch.int32, device=device)
        self.q = torch.zeros(rows, size.num_q_heads, size.head_dim, dtype=DTYPE, device=device)
        self.gate = torch.zeros_like(self.q)

        # The requests' context before step 0, written in one batch.
        self.write_tokens([(0, start) for start in self.starts])

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(DTYPE).to(self.device)

    def write_tokens(self, spans) -> tuple:
        """Store K/V and fold the raw index keys of tokens ``[start, end)`` of each request; returns the
        batch's token_to_req and positions."""
        req = torch.cat([torch.full((end - start,), r, dtype=torch.int32) for r, (start, end) in enumerate(spans)])
        pos = torch.cat([torch.arange(start, end, dtype=torch.int64) for start, end in spans])
        req, pos = req.to(self.device), pos.to(self.device)
        bs = self.size.block_size
        slots = self.block_table[req.long(), pos // bs].long() * bs + pos % bs   # through the current table
        n = req.shape[0]
        qsa.write_kv(self.cache.k, self.cache.v, self.randn(n, self.size.num_kv_heads, self.size.head_dim),
                     self.randn(n, self.size.num_kv_heads, self.size.head_dim), slots)
        qsa.update_compressed_keys(self.randn(n, self.size.index_dim), req, pos, self.kc.kc_cache,
                                   self.block_table, self.kc.partial, block_size=bs)
        return req, pos

    def load(self, step: int) -> None:
        """Step ``step``: write its tokens, then fill the captured buffers (positions, lengths, a new
        selection straight into ``indices``, q and gate)."""
        spans = [(start + step * new, start + (step + 1) * new) for start, new in zip(self.starts, self.size.step_lens)]
        _, pos = self.write_tokens(spans)
        self.positions.copy_(pos)
        self.seq_lens.copy_(torch.tensor([end for _, end in spans], dtype=torch.int32))
        self.index_q = self.randn(self.q.shape[0], self.size.index_heads, self.size.index_dim)
        self.select()
        self.q.copy_(self.randn(*self.q.shape))
        self.gate.copy_(self.randn(*self.gate.shape))

    def select(self) -> None:
        """This step's selection, written into the captured ``indices`` buffer."""
        qsa.select_tokens(self.index_q, self.kc.kc_cache, self.block_table, self.token_to_req, self.positions,
                          self.seq_lens, k=self.size.k, block_size=self.size.block_size, out=self.indices)

    def relocate(self, seed: int) -> None:
        """Move every physical page (K/V and compressed keys alike) and rewrite the block table, all into
        the captured buffers; then select again through the new table."""
        mapping = qsa.random_mapping(self.size.num_blocks, generator=torch.Generator().manual_seed(seed))
        storage, table = qsa.relocate(self.cache.storage, self.block_table, mapping)
        kc_cache, _ = qsa.relocate(self.kc.kc_cache, self.block_table, mapping)
        self.cache.storage.copy_(storage)
        self.kc.kc_cache.copy_(kc_cache)
        self.block_table.copy_(table)
        self.select()

    def batch(self) -> tuple:
        return self.indices, self.block_table, self.token_to_req, self.positions, self.seq_lens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="reference")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    device = torch.device("cuda")
    size = SIZES[args.size]
    print(f"qsa {qsa.__version__} on {torch.cuda.get_device_name(device)}, size {args.size}: "
          f"{size.num_q_heads}/{size.num_kv_heads} heads x {size.head_dim}, top-{size.k} blocks, "
          f"{sum(size.step_lens)} rows per step ({size.step_lens[0]} prefill rows + {size.step_lens[1]} decode row)")

    s = Step(size, num_steps=3, device=device, seed=args.seed)
    s.load(0)
    k_cache, v_cache = s.cache.k, s.cache.v
    max_query_len = max(size.step_lens)
    shape = dict(block_size=size.block_size, num_blocks=size.num_blocks, num_q_heads=size.num_q_heads,
                 num_kv_heads=size.num_kv_heads, head_dim=size.head_dim, max_query_len=max_query_len,
                 rows_sorted=True)
    # The grouped planner's scratch, reused by every replay.
    workspace = qsa.PlanWorkspace.for_plan(s.block_table, block_size=size.block_size,
                                           num_groups=-(-s.q.shape[0] // 8))
    out = torch.empty_like(s.q)

    def plan_and_run(plan):
        """What the graph holds: refill the plan from the buffers, then the attention into ``out``."""
        plan = qsa.plan_attention(*s.batch(), **shape, out=plan, workspace=workspace)
        qsa.run_attention(plan, s.q, k_cache, v_cache, gate=s.gate, out=out)
        return plan

    # Warm up outside the capture (kernels compile, the plan's buffers are allocated), on a side stream as
    # torch recommends before a capture, then capture.
    plan = plan_and_run(None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan_and_run(plan)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_and_run(plan)
    r = plan.routes
    xqa_rows = plan.num_rows - r.grouped_rows
    print(f"captured plan + attention: route {r.route}, {r.grouped_rows} grouped rows, {xqa_rows} single-row xqa "
          f"row{'s' * (xqa_rows != 1)} ({'direct' if r.direct else 'planned'})")

    ok = True

    def replay(what: str) -> torch.Tensor:
        nonlocal ok
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = qsa.sparse_paged_attention(s.q, k_cache, v_cache, *s.batch(), gate=s.gate,
                                           max_query_len=max_query_len, rows_sorted=True)
        same = torch.equal(out, eager)
        ref, _ = qsa.reference_attention(s.q, k_cache, v_cache, *s.batch(), gate=s.gate, compute_dtype=torch.float64)
        ref_lowp, _ = qsa.reference_attention(s.q, k_cache, v_cache, *s.batch(), gate=s.gate, compute_dtype=DTYPE)
        c = check_attention(out, ref, ref_lowp)
        print(f"replay, {what}: bitwise equal to eager: {same}; max |err| vs fp64 {c.err:.3e} "
              f"(bound {c.bound:.3e}): {'ok' if c.ok else 'MISMATCH'}")
        ok &= same and c.ok
        return out.clone()

    replay("step 0 (the captured step's data)")
    s.load(1)
    before = replay("step 1 (new tokens' K/V, new selection, positions, lengths, q, gate)")
    indices_before, table_before = s.indices.clone(), s.block_table.clone()

    s.relocate(seed=args.seed + 1)
    moved = not torch.equal(table_before, s.block_table)
    same_selection = torch.equal(indices_before, s.indices)
    after = replay("step 1 after every page moved (new block table, selection made again)")
    same_out = torch.equal(before, after)
    print(f"pages moved: {moved}; selection unchanged: {same_selection}; output bitwise unchanged: {same_out}")
    ok &= moved and same_selection and same_out

    s.load(2)
    replay("step 2 (new tokens written through the moved pages)")
    print("cuda_graph: all checks passed" if ok else "cuda_graph: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
