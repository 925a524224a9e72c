"""Triton kernels for tree verification, each beside its pure-torch reference; see weaver/kernels/README.md.

`weaver.kernels.gdn_tree`, `weaver.kernels.tree_conv`, `weaver.kernels.tree_attention` and `weaver.kernels.tree_mask` each expose one
dispatching API (`weaver.kernels.dispatch`): Triton for CUDA tensors, the references otherwise.
"""
