"""Triton kernels for tree verification, each beside its pure-torch reference; see kernels/README.md.

`kernels.gdn_tree`, `kernels.tree_conv`, `kernels.tree_attention` and `kernels.tree_mask` each expose one
dispatching API (`kernels.dispatch`): Triton for CUDA tensors, the references otherwise.
"""
