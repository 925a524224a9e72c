"""Hybrid GDN targets (Qwen3.5 / Qwen3-Next style) in SGLang: tree verification through our kernels on
SGLang's own state pools, and the rollback-free commit.

SGLang verifies a draft tree in its GDN layers only when `speculative_eagle_topk > 1` (otherwise it runs the
nodes as a chain in index order), by storing every node's conv window and recurrent state in scratch buffers
and copying the accepted node's into the request's pool slot afterwards. Our worker runs as topk 1 and brings
its own trees, so for its TARGET_VERIFY forward the GDN backend's `forward_extend` is replaced: the short conv
runs through `weaver.kernels.tree_conv` and the recurrence through `weaver.kernels.gdn_tree`, each node continuing its own
root-to-node path from the committed state read from the pool slot (SGLang's V-first "vk" layout), with nothing
written; the commit then writes the accepted leaf's conv window and state into each request's slot
(`gdn_tree_commit_`: S_leaf from the path's keys and values, no per-node states kept). Every other forward
(prefill, decode) stays SGLang's. The kernels are imported by the functions that run them, so that serving
an attention-only target never loads them.
"""

from __future__ import annotations

import torch

from weaver.errors import WeaverError


def tree_verify_class(base: type) -> type:
    """SGLang's GDN backend class `base` with TARGET_VERIFY over our trees (single inheritance: the instance's
    class is swapped in place, which Python allows only for the same layout)."""

    class TreeGDN(base):
        # set by `install_tree_gdn` / `begin_verify`: tree_parents (bs * n,) node-local parents of the batch's padded
        # trees; tree_mask, their ancestor bitmask built once per verify forward (Triton path); pending, layer id ->
        # (conv pending, GDN pending) until the commit
        def forward_extend(self, layer, forward_batch, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           **kwargs):
            if not forward_batch.forward_mode.is_target_verify():
                return super().forward_extend(layer=layer, forward_batch=forward_batch, mixed_qkv=mixed_qkv, a=a, b=b,
                                              **kwargs)
            if self.tree_parents is None:
                raise WeaverError("a TARGET_VERIFY forward of the GDN layers without the worker's trees")
            return verify_gdn_layer(self, layer, mixed_qkv, a, b)

    TreeGDN.__name__ = TreeGDN.__qualname__ = f"Tree{base.__name__}"
    return TreeGDN


def verify_gdn_layer(backend, layer, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One GDN layer over the batch's trees: (1, N, HV, V) in the inputs' dtype, as SGLang's verify returns it.

    mixed_qkv (N, 2 H K + HV V) before the conv, channels q | k | v; a, b (N, HV) raw gate projections."""
    from weaver.kernels import dispatch, gdn_tree, tree_conv, tree_mask

    if layer.bias is not None:
        raise WeaverError("GDN layers with a conv bias are not supported by the tree verify")
    metadata = backend.forward_metadata
    cu_seqlens = metadata.query_start_loc
    slots = metadata.mamba_cache_indices[: cu_seqlens.numel() - 1]
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    x, conv_pending = tree_conv.tree_conv1d(mixed_qkv[None], layer.conv_weights, cache.conv[0], backend.tree_parents,
                                            cu_seqlens=cu_seqlens, state_indices=slots)
    q, k, v = x[0].split([layer.q_dim, layer.k_dim, layer.v_dim], dim=-1)
    N = q.shape[0]
    if backend.tree_mask is None and dispatch.use_triton(v):
        backend.tree_mask = tree_mask.tree_ancestor_mask(backend.tree_parents, cu_seqlens)
    o, gdn_pending = gdn_tree.gdn_tree_verify(
        q.view(1, N, layer.num_q_heads, -1), k.view(1, N, layer.num_k_heads, -1), v.reshape(1, N, layer.num_v_heads, -1),
        a[None], b[None], layer.A_log, layer.dt_bias, cache.temporal, backend.tree_parents, cu_seqlens=cu_seqlens,
        state_indices=slots, state_layout="vk", mask=backend.tree_mask)
    backend.pending[layer.layer_id] = (conv_pending, gdn_pending)
    return o.to(mixed_qkv.dtype)


def install_tree_gdn(model_runner):
    """Give the target's GDN backend our tree verify (in place: every holder of the backend sees it); the
    backend, or None for a target without recurrent-state layers. Call it once SGLang has built its attention
    backends (after the speculative worker). Other linear layers (Mamba2, KDA, ...) and backend wrappers
    that hide the GDN backend (two-batch overlap) are refused rather than verified as chains."""
    if not hasattr(model_runner.req_to_token_pool, "mamba_pool"):
        return None  # attention only
    linear = getattr(model_runner.attn_backend, "linear_attn_backend", None)
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

    if not isinstance(linear, GDNAttnBackend):
        raise WeaverError(f"the target's linear-attention layers ({type(linear).__name__} in "
                          f"{type(model_runner.attn_backend).__name__}) have no tree verify here: only GDN hybrids "
                          "(and attention-only targets) are served, without two-batch overlap")
    if getattr(model_runner.req_to_token_pool.mamba_pool, "replayssm_cache_base", None) is not None:
        raise WeaverError("--enable-linear-replayssm-spec is not supported with the weaver plugin")
    linear.__class__ = tree_verify_class(type(linear))
    linear.tree_parents, linear.tree_mask, linear.pending = None, None, {}
    return linear


def begin_verify(backend, parents: torch.Tensor) -> None:
    """The trees of the next TARGET_VERIFY forward: parents (bs * n,) node-local, -1 at each tree's root."""
    backend.tree_parents, backend.tree_mask = parents.to(torch.int32), None
    backend.pending.clear()


def commit_gdn_states(backend, leaves: torch.Tensor) -> None:
    """Write each request's accepted path (node-local leaf per request) into its conv and recurrent slots."""
    from weaver.kernels import gdn_tree, tree_conv

    for layer_id, (conv_pending, gdn_pending) in backend.pending.items():
        cache = backend.req_to_token_pool.mamba2_layer_cache(layer_id)
        tree_conv.tree_conv_commit_(cache.conv[0], conv_pending, leaves)
        gdn_tree.gdn_tree_commit_(cache.temporal, gdn_pending, leaves)
    backend.pending.clear()
    backend.tree_parents = backend.tree_mask = None
