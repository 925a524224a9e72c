"""One GDN layer's tree verification on a GPU: the fused Triton kernel vs per-branch recurrence.

    python benchmarks/gdn_tree_kernels.py                 # Qwen3.6-27B GDN: H=16, HV=48, K=V=128, T 16..128,
                                                          # batch 1 and 8, bf16 and fp32 (CUDA machine)
    python benchmarks/gdn_tree_kernels.py --keys correlated   # real-checkpoint-like keys: the numerics check
    TRITON_INTERPRET=1 python benchmarks/gdn_tree_kernels.py --smoke   # CPU, interpreter, toy size (CI)

Fused: `weaver.kernels.gdn_tree.gdn_tree_verify` (gates, q/k norm, path decay, ancestor-masked solve and outputs
in one kernel; the tree's ancestor bitmask is built, and the tree checked, once per step for all layers,
so both are excluded).
Per-branch: one recurrence step per node from its parent's state, keeping a state per node: fla's
`fused_recurrent_gated_delta_rule` chained node by node when fla is importable, else our torch reference
(`per_branch_tree_gated_delta_rule`); its gates come from `gdn_gates` (included in its time). Trees are
random (parent uniform among earlier nodes or the context), shared by the batch rows. Keys are random, or
with `--keys correlated` one shared direction plus 0.1 noise with beta ~ 0.993 (where an unstable
triangular solve in the autotuned config would show in the last column). Times are medians
(`triton.testing.do_bench` on CUDA, wall clock on CPU); every row also checks the fused outputs against
the per-branch ones. The paper's fused/per-branch ratios (B200, batch 1): 1.5x, 2.7x, 4.6x, 7.1x at
T = 16, 32, 64, 128.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch

from weaver.kernels.gdn_tree import gdn_tree_verify
from weaver.kernels.gdn_tree.reference import gdn_gates
from weaver.kernels.tree_mask import tree_ancestor_mask
from timing import print_table_header, timed
from weaver.models.gdn import per_branch_tree_gated_delta_rule
from weaver.tree import Tree

PAPER_RATIO = {16: 1.5, 32: 2.7, 64: 4.6, 128: 7.1}


def per_branch_fla(q, k, v, g, beta, state, parents):
    """Per-branch verification with fla's recurrent kernel: one launch per node from its parent's state."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    states, outs = [], []
    for i, p in enumerate(parents.tolist()):
        sl = slice(i, i + 1)
        o, s = fused_recurrent_gated_delta_rule(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state if p < 0 else states[p],
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=1)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=max(repeats, 1) * 10, return_mode="median")
    fn()  # warm-up (interpreter: builds the kernel wrappers)
    return 1000 * statistics.median(timed(fn)[0] for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--value-heads", type=int, default=48)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dot-precision", default="ieee", choices=["ieee", "tf32", "tf32x3"])
    parser.add_argument("--keys", default="random", choices=["random", "correlated"])
    parser.add_argument("--smoke", action="store_true", help="toy size on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.batches, args.dtypes = [16], [1], ["fp32"]
        args.heads, args.value_heads, args.dim, args.repeats = 1, 2, 16, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("WEAVER_KERNELS", "triton")  # needs TRITON_INTERPRET=1 (checked by the dispatch)
    try:
        import fla  # noqa: F401

        baseline = "fla fused_recurrent per node" if device == "cuda" else "torch per-branch reference"
    except ImportError:
        baseline = "torch per-branch reference"
    H, HV, D = args.heads, args.value_heads, args.dim
    print(f"GDN tree verify, one layer, H={H}, HV={HV}, K=V={D}, {device}, per-branch = {baseline}, "
          f"dot precision {args.dot_precision}, {args.keys} keys; GPU times are medians (ms)")
    print_table_header("T", "batch", "dtype", "fused ms", "per-branch ms", "ratio", "paper ratio", "max abs diff")
    gen = torch.Generator().manual_seed(0)
    for dtype_name in args.dtypes:
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
        for B in args.batches:
            for T in args.sizes:
                parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(T)])
                q, k = (torch.randn(B, T, H, D, generator=gen) for _ in range(2))
                v = torch.randn(B, T, HV, D, generator=gen)
                a, b = torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, generator=gen)
                if args.keys == "correlated":  # after the short conv and SiLU: near-identical keys, beta near 1
                    k, b = torch.randn(1, 1, H, D, generator=gen) + 0.1 * k, b + 5
                A_log, dt_bias = torch.rand(HV, generator=gen).log(), torch.rand(HV, generator=gen)
                state = torch.randn(B, HV, D, D, generator=gen) * 0.1
                q, k, v, a, b = (x.to(device, dtype) for x in (q, k, v, a, b))
                A_log, dt_bias, state, parents = (x.to(device) for x in (A_log, dt_bias, state, parents))
                mask = tree_ancestor_mask(parents)
                tree = Tree(torch.zeros_like(parents), parents)  # as the engine passes it: checked once per step

                def fused():
                    return gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, state, tree, mask=mask,
                                           dot_precision=args.dot_precision)[0]

                def per_branch():
                    g, beta = gdn_gates(a, b, A_log, dt_bias)
                    if baseline.startswith("fla"):
                        return per_branch_fla(q, k, v, g, beta, state, parents)
                    return per_branch_tree_gated_delta_rule(q, k, v, g, beta, state, parents)[0]

                with torch.inference_mode():
                    diff = (fused().float() - per_branch().float()).abs().max().item()
                    t_fused, t_branch = median_ms(fused, args.repeats), median_ms(per_branch, args.repeats)
                paper = f"{PAPER_RATIO[T]}x" if T in PAPER_RATIO and B == 1 else "-"
                print(f"| {T} | {B} | {dtype_name} | {t_fused:.3f} | {t_branch:.3f} | {t_branch / t_fused:.1f}x | "
                      f"{paper} | {diff:.2e} |")


if __name__ == "__main__":
    main()
