"""SGLang's `torch_native` attention backend with tree-masked speculative verify (TARGET_VERIFY).

The stock backend runs a verify batch through its causal extend path, so draft node i attends to every
draft node before it in the flattened tree, siblings' branches included. Here node i attends to the
committed prefix and to its own ancestors (itself included) among the draft tokens, as the tree mask
says. On CPU, SGLang lays that mask out as TreeMaskMode.QLEN_ONLY: one [draft_token_num, draft_token_num]
bool block per request, row = query node, column = draft node it may see (`NgramVerifyInput.custom_mask`,
`eagle_utils.default_tree_mask_mode`). Every other mode goes to the stock backend unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def tree_verify_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    scaling: Optional[float],
    enable_gqa: bool,
) -> torch.Tensor:
    """Attention of bs * n draft queries [bs * n, heads, head_dim] over each request's prefix
    (prefix_lens[b] tokens) plus its n draft tokens, whose KV is already in the cache right after the
    prefix (req_to_token[row, prefix:prefix + n]), draft columns masked by tree_mask [bs, n, n]."""
    bs, n = tree_mask.shape[:2]
    output = query.new_empty(query.shape[0], query.shape[1], v_cache.shape[-1])
    for b in range(bs):
        prefix = int(prefix_lens[b])
        slots = req_to_token[req_pool_indices[b], : prefix + n].long()
        keys = k_cache[slots].movedim(0, 1).to(query.dtype)  # [kv_heads, prefix + n, head_dim]
        values = v_cache[slots].movedim(0, 1).to(query.dtype)
        visible = torch.cat([tree_mask.new_ones(n, prefix), tree_mask[b]], dim=1)  # [n, prefix + n]
        queries = query[b * n : (b + 1) * n].movedim(0, 1)  # [heads, n, head_dim]
        out = scaled_dot_product_attention(
            queries[None], keys[None], values[None], attn_mask=visible, scale=scaling, enable_gqa=enable_gqa
        )
        output[b * n : (b + 1) * n] = out[0].movedim(0, 1)
    return output


def verify_tree_mask(forward_batch: ForwardBatch) -> torch.Tensor:
    """The batch's draft-tree mask as [bs, n, n] bool; a chain (causal) when the drafter sent none."""
    bs, n = forward_batch.batch_size, forward_batch.spec_info.draft_token_num
    mask = getattr(forward_batch.spec_info, "custom_mask", None)
    if mask is None:
        return torch.ones(n, n, dtype=torch.bool).tril().expand(bs, n, n)
    if mask.numel() != bs * n * n:  # FULL_MASK (prefix columns included) is the GPU kernels' layout
        raise NotImplementedError(f"tree mask of {mask.numel()} cells for {bs} x {n} x {n} (QLEN_ONLY expected)")
    return mask.view(bs, n, n).bool()


class TreeVerifyTorchNativeAttnBackend(TorchNativeAttnBackend):
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if layer.is_cross_attention or (layer.sliding_window_size is not None and layer.sliding_window_size > -1):
            raise NotImplementedError("tree verify with cross or sliding-window attention")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        out = tree_verify_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,  # verify batches carry the committed lengths, drafts excluded
            verify_tree_mask(forward_batch),
            layer.scaling,
            layer.tp_q_head_num != layer.tp_k_head_num,
        )
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
