"""One GDN layer's tree verification: parallel ancestor-masked form vs per-branch recurrence (CPU, torch).

    python benchmarks/gdn_tree_verify.py                      # Qwen3.6-27B GDN heads: H=16, HV=48, K=V=128
    python benchmarks/gdn_tree_verify.py --sizes 16 32 --heads 4 --value-heads 8 --dim 32   # quick

Both compute every node's output from the committed state without writing it. Per-branch takes one
recurrence step per node from its parent's state and keeps a (HV, K, V) state for every node (what
per-branch tree verification stores); the parallel form (weaver.kernels.gdn_tree.reference.tree_gated_delta_rule) keeps
T x T matrices per head and the solved U (T x V per head), and commits with one rank-|path| update.
Trees are random (each node's parent uniform among earlier nodes or the context). Medians of --repeats
runs, both methods in the same process, interleaved. Extra memory is the size of what each method must
keep for the commit, from tensor shapes.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from weaver.kernels.gdn_tree.reference import gdn_gates, tree_gated_delta_rule
from timing import print_table_header, timed
from weaver.models.gdn import per_branch_tree_gated_delta_rule
from weaver.tree import Tree


def random_inputs(T: int, H: int, HV: int, D: int, gen: torch.Generator):
    parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(T)])
    q, k = torch.randn(1, T, H, D, generator=gen), torch.randn(1, T, H, D, generator=gen)
    v = torch.randn(1, T, HV, D, generator=gen)
    g, beta = gdn_gates(torch.randn(1, T, HV, generator=gen), torch.randn(1, T, HV, generator=gen),
                        torch.zeros(HV), torch.zeros(HV))
    return Tree(torch.zeros(T, dtype=torch.long), parents), (q, k, v, g, beta, torch.randn(1, HV, D, D, generator=gen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--value-heads", type=int, default=48)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    H, HV, D = args.heads, args.value_heads, args.dim
    print(f"GDN tree verify, one layer, batch 1, H={H}, HV={HV}, K=V={D}, fp32, CPU {args.threads} threads, "
          f"median of {args.repeats}")
    print_table_header("T", "per-branch ms", "parallel ms", "ratio", "per-branch state memory", "parallel commit memory")
    gen = torch.Generator().manual_seed(0)
    for T in args.sizes:
        tree, inputs = random_inputs(T, H, HV, D, gen)
        tree.ancestors  # built once per tree in the engine too; not part of the layer's cost
        times: dict[str, list[float]] = {"branch": [], "parallel": []}
        with torch.inference_mode():
            for _ in range(args.repeats + 1):  # first round is warm-up
                seconds, (o_branch, _) = timed(lambda: per_branch_tree_gated_delta_rule(*inputs, tree.parents))
                times["branch"].append(seconds)
                seconds, (o_parallel, pending) = timed(lambda: tree_gated_delta_rule(*inputs, tree.ancestors))
                times["parallel"].append(seconds)
        torch.testing.assert_close(o_parallel, o_branch, atol=1e-4, rtol=1e-4)
        branch, parallel = (1000 * statistics.median(t[1:]) for t in (times["branch"], times["parallel"]))
        state_mb = T * HV * D * D * 4 / 2**20
        commit_mb = sum(x.numel() * x.element_size() for x in (pending.k, pending.U, pending.G)) / 2**20
        print(f"| {T} | {branch:.2f} | {parallel:.2f} | {branch / parallel:.1f}x | {state_mb:.1f} MiB | {commit_mb:.2f} MiB |")


if __name__ == "__main__":
    main()
