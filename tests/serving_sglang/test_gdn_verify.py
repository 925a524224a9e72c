"""A hybrid target's GDN layers in SGLang: our tree verify and commit (`weaver.serving.sglang.gdn`) on SGLang's own
state pools, against SGLang's own tree verify of the same trees.

SGLang's pools (`HybridReqToTokenPool`) and its GDN backend's TARGET_VERIFY tree path (its Triton conv and
gated-delta-rule kernels, under TRITON_INTERPRET=1 on CPU tensors) are the reference: for random trees laid out by
`tree_inputs` (padded, one n per batch), random sizes and requests in random pool slots, our verify must give
SGLang's outputs, leave the pools untouched, and our commit must write into each request's slot exactly the
conv window and recurrent state SGLang kept for the accepted node (what its scatter copies after verify).
The backend is made without SGLang's server context (`object.__new__` and the attributes the verify reads).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape  # noqa: E402
from sglang.srt.layers.attention.linear import gdn_backend as gdn_module  # noqa: E402
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend, GDNKernelDispatcher  # noqa: E402
from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend  # noqa: E402
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.speculative.spec_utils import _verify_commit_step_indices  # noqa: E402

from weaver.errors import WeaverError  # noqa: E402
from weaver.serving.sglang.gdn import begin_verify, commit_gdn_states, install_tree_gdn  # noqa: E402
from weaver.serving.sglang.tree_inputs import accept_outputs, accepted_leaves, tree_verify_inputs  # noqa: E402
from weaver.tree import Tree  # noqa: E402

GDN_LAYERS = [1, 3]  # model layer ids of the GDN layers (the others would be attention)
SLOTS = 6


def pools(H: int, HV: int, K: int, V: int, W: int, n: int, seed: int) -> HybridReqToTokenPool:
    """SGLang's request and state pools on CPU, random committed states (the same for the same seed)."""
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=HV * V, n_groups=H, num_heads=HV, head_dim=V,
                                    state_size=K, conv_kernel=W)
    params = Mamba2CacheParams(shape=shape, layers=GDN_LAYERS,
                               dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32))
    pool = HybridReqToTokenPool(size=SLOTS, mamba_size=SLOTS, mamba_spec_state_size=SLOTS, max_context_len=64,
                                device="cpu", enable_memory_saver=False, cache_params=params, mamba_layer_ids=GDN_LAYERS,
                                enable_mamba_extra_buffer=False, speculative_num_draft_tokens=n,
                                speculative_eagle_topk=2,  # SGLang's reference runs its tree path
                                enable_overlap_schedule=False)
    cache, gen = pool.mamba_pool.mamba_cache, torch.Generator().manual_seed(seed)
    cache.conv[0].normal_(generator=gen)
    cache.temporal.normal_(generator=gen)
    return pool


@pytest.fixture(autouse=True)
def no_rank_logs(monkeypatch):
    """The backend's kernel choice logs by tensor-parallel rank, which no server published in this process."""
    monkeypatch.setattr(gdn_module, "rank0_log", lambda *args, **kwargs: None)


def gdn_backend(pool: HybridReqToTokenPool, topk: int) -> GDNAttnBackend:
    """SGLang's GDN backend as its server would make it, without the server: the attributes its verify reads."""
    backend = object.__new__(GDNAttnBackend)
    triton = LinearAttnKernelBackend.TRITON
    backend.__dict__.update(
        req_to_token_pool=pool, device="cpu", topk=topk, mis_metadata=None, requires_contiguous_prefill_state=True,
        verify_intermediate_state_indices=torch.arange(SLOTS, dtype=torch.int32), _use_strided_target_verify_qkv=False,
        kernel_dispatcher=GDNKernelDispatcher(triton, triton, triton))
    return backend


def random_tree(size: int, gen: torch.Generator) -> Tree:
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, size)]
    return Tree(torch.randint(0, 50, (size,), generator=gen), torch.tensor(parents))


def verify_batch(inputs, req_pool_indices: torch.Tensor) -> SimpleNamespace:
    bs, n = inputs.retrieve_index.shape
    spec = SimpleNamespace(ragged_verify_layout=None, draft_token_num=n, retrieve_next_token=inputs.retrieve_next_token,
                           retrieve_next_sibling=inputs.retrieve_next_sibling)
    return SimpleNamespace(batch_size=bs, logical_forward_mode=ForwardMode.TARGET_VERIFY,
                           forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=req_pool_indices,
                           mamba_track_indices=None, mamba_track_mask=None, extend_start_loc=None, extend_seq_lens=None,
                           spec_info=spec, input_ids=inputs.draft_token)


def gdn_layer(layer_id: int, H: int, HV: int, K: int, V: int, W: int, gen: torch.Generator) -> RadixLinearAttention:
    C = 2 * H * K + HV * V
    return RadixLinearAttention(layer_id=layer_id, num_q_heads=H, num_k_heads=H, num_v_heads=HV, head_q_dim=K,
                                head_k_dim=K, head_v_dim=V, conv_weights=torch.randn(C, W, generator=gen), bias=None,
                                activation="silu", A_log=torch.randn(HV, generator=gen),
                                dt_bias=torch.randn(HV, generator=gen))


@pytest.mark.parametrize("seed", range(6))
def test_our_tree_verify_and_commit_equal_sglangs_on_its_pools(seed):
    gen = torch.Generator().manual_seed(seed)
    H = int(torch.randint(1, 3, (), generator=gen))
    HV, K, V, W = H * int(torch.randint(1, 3, (), generator=gen)), 16, 8, 4
    bs = int(torch.randint(1, 4, (), generator=gen))
    trees = [random_tree(int(torch.randint(1, 9, (), generator=gen)), gen) for _ in range(bs)]
    n = max(map(len, trees)) + int(torch.randint(0, 3, (), generator=gen))
    inputs = tree_verify_inputs(trees, torch.randint(3, 20, (bs,), generator=gen), n, full_mask=False)
    sglang_pool, our_pool = pools(H, HV, K, V, W, n, seed), pools(H, HV, K, V, W, n, seed)  # the same states
    requests = torch.randperm(SLOTS - 1, generator=gen)[:bs] + 1  # request rows, in no particular order
    slots = (torch.randperm(SLOTS - 1, generator=gen)[:bs] + 1).int()  # and their state slots
    for pool in (sglang_pool, our_pool):
        pool.req_index_to_mamba_index_mapping[requests] = slots
    batch = verify_batch(inputs, requests)
    theirs, ours = gdn_backend(sglang_pool, topk=2), gdn_backend(our_pool, topk=1)
    theirs.forward_metadata, ours.forward_metadata = theirs._forward_metadata(batch), ours._forward_metadata(batch)
    runner = SimpleNamespace(attn_backend=SimpleNamespace(linear_attn_backend=ours), req_to_token_pool=our_pool)
    assert install_tree_gdn(runner) is ours and isinstance(ours, GDNAttnBackend)
    committed = [t.clone() for t in (our_pool.mamba_pool.mamba_cache.conv[0], our_pool.mamba_pool.mamba_cache.temporal)]

    begin_verify(ours, inputs.parents)
    for layer_id in GDN_LAYERS:
        layer = gdn_layer(layer_id, H, HV, K, V, W, gen)
        x, a, b = (torch.randn(bs * n, dim, generator=gen) for dim in (layer.conv_weights.shape[0], HV, HV))
        expected = theirs.forward_extend(layer=layer, forward_batch=batch, mixed_qkv=x, a=a, b=b)
        got = ours.forward_extend(layer=layer, forward_batch=batch, mixed_qkv=x, a=a, b=b, q=None, k=None, v=None,
                                  save_kv_cache=True)
        assert got.shape == expected.shape == (1, bs * n, HV, V)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    cache = our_pool.mamba_pool.mamba_cache
    assert torch.equal(cache.conv[0], committed[0]) and torch.equal(cache.temporal, committed[1]), \
        "verify wrote into the pools"

    # accepted paths in SGLang's verify outputs; the worker's leaves from them are those SGLang's commit uses
    chosen = [(int(torch.randint(0, len(tree), (), generator=gen)), 0) for tree in trees]
    predict, accept_index, accept_token_num = accept_outputs(trees, chosen, n)
    accept_lens = accept_token_num + 1
    leaves = [leaf for leaf, _ in accepted_leaves(accept_index, accept_lens - 1, predict)]  # as the worker does
    sglang_leaves, _ = _verify_commit_step_indices(batch=SimpleNamespace(mamba_track_indices=None),
                                                   accept_index=accept_index, accept_lens=accept_lens, draft_token_num=n)
    assert leaves == [leaf for leaf, _ in chosen] == sglang_leaves.tolist()
    commit_gdn_states(ours, leaves)
    assert torch.equal(ours.forward_metadata.mamba_cache_indices[:bs], slots)
    slots = slots.long()
    reference = sglang_pool.mamba_pool.mamba_cache
    for i, layer in enumerate(GDN_LAYERS):  # SGLang's scatter: slot <- the accepted node's scratch state
        for row, (slot, leaf) in enumerate(zip(slots.tolist(), leaves)):
            torch.testing.assert_close(cache.temporal[i, slot], reference.intermediate_ssm[i, row, leaf], atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(cache.conv[0][i, slot], reference.intermediate_conv_window[0][i, row, leaf])
    untouched = torch.ones(SLOTS + 1, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(cache.temporal[:, untouched], committed[1][:, untouched])
    assert torch.equal(cache.conv[0][:, untouched], committed[0][:, untouched])
    assert not ours.pending and ours.tree_parents is None


def test_other_forwards_stay_sglangs_and_other_linear_layers_are_refused(monkeypatch):
    calls = []
    monkeypatch.setattr(GDNAttnBackend, "forward_extend", lambda self, **kwargs: calls.append(kwargs["forward_batch"]))
    backend = object.__new__(GDNAttnBackend)
    runner = SimpleNamespace(attn_backend=SimpleNamespace(linear_attn_backend=backend),
                             req_to_token_pool=SimpleNamespace(mamba_pool=SimpleNamespace()))
    install_tree_gdn(runner)
    prefill = SimpleNamespace(forward_mode=ForwardMode.EXTEND)
    backend.forward_extend(layer=None, forward_batch=prefill, mixed_qkv=None, a=None, b=None)
    assert calls == [prefill]
    with pytest.raises(WeaverError, match="without the worker's trees"):
        backend.forward_extend(layer=None, forward_batch=SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY),
                               mixed_qkv=None, a=None, b=None)
    attention_only = SimpleNamespace(attn_backend=SimpleNamespace(), req_to_token_pool=SimpleNamespace())
    assert install_tree_gdn(attention_only) is None
    for hidden in (SimpleNamespace(linear_attn_backend=object()), SimpleNamespace()):  # another kind; a wrapper
        with pytest.raises(WeaverError, match="have no tree verify here: only GDN hybrids"):
            install_tree_gdn(SimpleNamespace(attn_backend=hidden, req_to_token_pool=runner.req_to_token_pool))
