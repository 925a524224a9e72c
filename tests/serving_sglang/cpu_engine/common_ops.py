"""A pure-torch stand-in for the CUDA build of sgl_kernel, for SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1).

`sgl_kernel` falls back to `import common_ops` when no compiled library loads (no libcuda here), so this
folder on PYTHONPATH is imported in every SGLang process. It registers, as `torch.ops.sgl_kernel.*`, the
CPU ops that SGLang's plain decode and NGRAM (tree) speculative decode call, with the argument order of
`sgl_kernel/speculative.py` and `sgl_kernel/kvcacheio.py`, and semantics read off SGLang's Triton kernels
(`sglang/kernels/ops/speculative/*.py`, `kvcache/cache_move.py`). Each is a plain loop or a few tensor ops:
correctness over speed, batches here are tiny.

It also installs the tree-masked TARGET_VERIFY attention (tree_verify_backend.py) into SGLang's
`torch_native` backend, which otherwise attends verify tokens causally whatever the tree.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable

import torch

NAMESPACE = "sgl_kernel"
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # FRAGMENT: other code may own the namespace too


def _register(schema: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Define `sgl_kernel::<schema>` with the decorated function as its CPU kernel (once per process)."""

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        name = schema.split("(", 1)[0]
        if not hasattr(getattr(torch.ops, NAMESPACE), name):  # loaded twice (tests import it by path)
            _lib.define(schema)
            _lib.impl(name, fn, "CPU")
        return fn

    return decorate


@_register("copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()")
def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For each buffer (raw address, bytes per slot), copy slot src_loc[i] to tgt_loc[i]; all reads happen
    before any write (safe in place, as the tiled Triton kernel). The pool moves accepted drafts' KV so."""
    if tgt_loc.numel() == 0:
        return
    slots = int(torch.maximum(tgt_loc.max(), src_loc.max())) + 1
    tgt, src = tgt_loc.long(), src_loc.long()
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (slots * stride)).from_address(address)
        buffer = torch.frombuffer(raw, dtype=torch.uint8).view(slots, stride)
        buffer[tgt] = buffer[src]  # the gather on the right is a copy, so overlaps are fine


@_register(
    "assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
    "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()"
)
def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Pack each request's KV slots req_to_token[row, start:end] one after another into out_cache_loc."""
    rows = req_to_token.reshape(-1, pool_len)
    for row, span, packed in _packed_spans(req_pool_indices, start_offset, end_offset):
        out_cache_loc[packed] = rows[row, span]


@_register(
    "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
    "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()"
)
def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """The inverse of assign_extend_cache_locs_cpu: write the packed new slots into req_to_token[row, start:end]."""
    rows = req_to_token.view(-1, pool_len)
    for row, span, packed in _packed_spans(req_pool_indices, start_offset, end_offset):
        rows[row, span] = out_cache_loc[packed]


def _packed_spans(req_pool_indices: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor):
    """Per request: its pool row, its slots start:end, and where they sit in the requests' packed list."""
    packed = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        yield row, slice(start, end), slice(packed, packed + end - start)
        packed += end - start


@_register(
    "fill_accept_out_cache_loc_cpu(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()"
)
def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """The KV slots of the accepted verify tokens (accept_index without its -1 padding), packed in order."""
    accepted = accept_index.reshape(-1)
    accepted = accepted[accepted != -1].long()
    accept_out_cache_loc[: accepted.numel()] = out_cache_loc[accepted]


@_register(
    "reconstruct_indices_from_tree_mask_cpu(Tensor tree_mask, Tensor verified_seq_len, Tensor(a!) positions, "
    "Tensor(b!) retrive_index, Tensor(c!) retrive_next_token, Tensor(d!) retrive_next_sibling, int batch_size, "
    "int draft_token_num) -> ()"
)
def reconstruct_indices_from_tree_mask_cpu(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """NGRAM's verify metadata from its [bs, n, n] ancestor mask (row i: the nodes i sees), as
    reconstruct_tree.py documents: position = prefix length + depth, first child, next sibling."""
    bs, n = batch_size, draft_token_num
    if bs == 0:
        return
    node = torch.arange(n)
    ancestors = tree_mask[: bs * n * n].view(bs, n, n).bool() & (node[None, :] < node[:, None])  # [b, i, j]: j < i
    positions.view(-1)[: bs * n].copy_((ancestors.sum(-1) + verified_seq_len[:bs, None].long()).view(-1))
    retrive_index.view(-1)[: bs * n].copy_(torch.arange(bs * n))
    # parent: the deepest (largest-index) strict ancestor
    parent = torch.where(ancestors.any(-1), torch.where(ancestors, node, -1).amax(-1), -1)  # [b, i]
    first_child = torch.where(ancestors, node[:, None], n).amin(1)  # [b, j]: smallest i having j as ancestor
    retrive_next_token.view(-1)[: bs * n].copy_(torch.where(first_child < n, first_child, -1).view(-1))
    later_sibling = (parent[:, :, None] == parent[:, None, :]) & (node[:, None] > node[None, :])  # [b, k, t]
    first_sibling = torch.where(later_sibling, node[:, None], n).amin(1)  # [b, t]
    next_sibling = torch.where((parent >= 0) & (first_sibling < n), first_sibling, -1)
    retrive_next_sibling.view(-1)[: bs * n].copy_(next_sibling.view(-1))


@_register(
    "verify_tree_greedy_cpu(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
    "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
    "Tensor target_predict) -> ()"
)
def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree walk (spec_tree.py's verify_tree_greedy kernel): from the root, descend to the child whose
    draft token equals the target's argmax at the current node; record the accepted nodes' flat indices in
    accept_index, how many drafts matched in accept_token_num, and the target's token at every accepted node
    (the last one's is the bonus token) in predicts (flat, indexed like target_predict)."""
    bs, n = candidates.shape
    target = target_predict.reshape(-1).tolist()
    for b in range(bs):
        tokens, index = candidates[b].tolist(), retrive_index[b].tolist()
        next_token, next_sibling = retrive_next_token[b].tolist(), retrive_next_sibling[b].tolist()
        last, node, accepted = index[0], 0, 0
        accept_index[b, 0] = last
        for _ in range(1, accept_index.shape[1]):
            node = next_token[node]
            while node != -1 and tokens[node] != target[last]:
                node = next_sibling[node]
            if node == -1:
                break
            predicts.view(-1)[last] = target[last]
            accepted += 1
            last = index[node]
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts.view(-1)[last] = target[last]


# --- the tree-masked verify attention, installed into `torch_native` wherever SGLang imports it ----------

_BACKEND_MODULE = "sglang.srt.layers.attention.torch_native_backend"


def _install_tree_verify_backend(module: object) -> None:
    """Swap the module's TorchNativeAttnBackend for the tree-masking subclass; the registry's factory
    (`attention_registry.create_torch_native_backend`) imports the class by name at call time. This
    folder is on sys.path: that is how sgl_kernel found `common_ops`."""
    from tree_verify_backend import TreeVerifyTorchNativeAttnBackend

    module.TorchNativeAttnBackend = TreeVerifyTorchNativeAttnBackend  # type: ignore[attr-defined]


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs the install right after SGLang's torch_native backend module executes (it cannot be imported
    from here: sgl_kernel, hence this module, loads while sglang itself is still importing)."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != _BACKEND_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: object) -> None:
            run_module(module)  # type: ignore[arg-type]
            _install_tree_verify_backend(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


# Only in SGLang's CPU engine: a test process that loads this file to check the ops keeps SGLang untouched.
if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    if _BACKEND_MODULE in sys.modules:
        _install_tree_verify_backend(sys.modules[_BACKEND_MODULE])
    elif not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
