"""The plugin's tree inputs against SGLang's own tree builder and greedy tree verify.

Runs in the SGLang environment (`bash scripts/install.sh --serve`; tests/test_serving.py starts it).
SGLang's builder and verify take their XPU branch here: its Triton kernels, which TRITON_INTERPRET=1 runs on
CPU tensors (the CUDA kernels implement the same contract).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # SGLang compiles its EAGLE top-k step; eager is enough here

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.kernels.ops.speculative import spec_tree  # noqa: E402
from sglang.srt.speculative.eagle_utils import build_tree_kernel_efficient, organize_draft_results  # noqa: E402
from sglang.srt.speculative.spec_utils import select_top_k_tokens  # noqa: E402

from weaver.acceptance import greedy_tree  # noqa: E402
from weaver.errors import WeaverError  # noqa: E402
from weaver.serving.sglang.tree_inputs import accept_outputs, accepted_leaves, tree_verify_inputs  # noqa: E402
from weaver.tree import Tree  # noqa: E402

FULL, QLEN = spec_tree.TreeMaskMode.FULL_MASK, spec_tree.TreeMaskMode.QLEN_ONLY


@pytest.fixture(autouse=True)
def sglang_triton_kernels(monkeypatch):
    monkeypatch.setattr(spec_tree, "_is_xpu", True)


def random_tree(size: int, vocab: int, gen: torch.Generator) -> Tree:
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, size)]
    return Tree(torch.randint(0, vocab, (size,), generator=gen), torch.tensor(parents))


def sglang_greedy_verify(inputs, target_predict: torch.Tensor):
    bs, n = inputs.retrieve_index.shape
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accept_token_num = torch.zeros(bs, dtype=torch.int32)
    return spec_tree.verify_tree_greedy_func(
        predicts, accept_index, accept_token_num, inputs.draft_token.view(bs, n), inputs.retrieve_index,
        inputs.retrieve_next_token, inputs.retrieve_next_sibling, target_predict)


@pytest.mark.parametrize("full_mask", [True, False])
def test_sglang_greedy_verify_accepts_what_the_reference_engine_accepts(full_mask):
    """Random trees (a 3-token vocabulary: repeated sibling tokens, long accepted paths), random sizes padded to
    one n per batch: SGLang's verify on our inputs gives the leaf and bonus of `weaver.acceptance.greedy_tree`, and
    `accept_outputs` of those gives SGLang's outputs back, tensor for tensor."""
    gen = torch.Generator().manual_seed(0)
    depths = []
    for _ in range(24):
        bs = int(torch.randint(1, 4, (), generator=gen))
        trees = [random_tree(int(torch.randint(1, 13, (), generator=gen)), 3, gen) for _ in range(bs)]
        n = max(map(len, trees)) + int(torch.randint(0, 3, (), generator=gen))
        logits = torch.randn(bs, n, 3, generator=gen)
        inputs = tree_verify_inputs(trees, torch.randint(1, 9, (bs,), generator=gen), n, full_mask)
        predicts, accept_index, accept_token_num = sglang_greedy_verify(inputs, logits.argmax(-1))
        expected = [greedy_tree(tree, logits[b, :len(tree)]) for b, tree in enumerate(trees)]
        assert accepted_leaves(accept_index, accept_token_num, predicts) == expected
        for ours, theirs in zip(accept_outputs(trees, expected, n), (predicts, accept_index, accept_token_num)):
            assert torch.equal(ours, theirs)  # what a sampling rule's result must look like to SGLang's commit
        depths += accept_token_num.tolist()
    assert max(depths) >= 3 and min(depths) == 0  # the cases reach deep paths and immediate rejections


def eagle_tree(bs: int, topk: int, steps: int, n: int, vocab: int, gen: torch.Generator):
    """SGLang's own EAGLE draft bookkeeping on random draft probabilities: its (parent_list,
    top_scores_index, draft_tokens) for `build_tree_kernel_efficient`."""
    topk_p, topk_index = torch.softmax(torch.randn(bs, vocab, generator=gen), -1).topk(topk)
    scores, lists = None, ([], [], [])
    for i in range(steps):
        _, _, scores, tree_info = select_top_k_tokens(i, topk_p, topk_index, None, scores, topk)
        for found, kept in zip(tree_info, lists):
            kept.append(found)
        topk_p, topk_index = torch.softmax(torch.randn(bs * topk, vocab, generator=gen), -1).topk(topk)
    return organize_draft_results(*lists, n)


def tree_from_sglang(tokens: torch.Tensor, next_token: torch.Tensor, next_sibling: torch.Tensor) -> Tree:
    """Our Tree read back from SGLang's first-child / next-sibling lists."""
    parents = [-1] * len(tokens)
    for node in range(len(tokens)):
        child = int(next_token[node])
        while child != -1:
            parents[child] = node
            child = int(next_sibling[child])
    assert all(p >= 0 for p in parents[1:]), f"SGLang left a node without a parent: {parents}"
    return Tree(tokens, torch.tensor(parents))


@pytest.mark.parametrize("mode", [FULL, QLEN])
@pytest.mark.parametrize("topk,steps", [(1, 4), (2, 3), (3, 3), (4, 2)])
def test_tree_inputs_equal_sglangs_for_eagle_trees(mode, topk, steps):
    """SGLang builds EAGLE's trees itself; the same trees through our conversion give the same mask, positions,
    retrieve lists and tokens, element for element."""
    gen = torch.Generator().manual_seed(topk * 10 + steps)
    candidates, bs = topk + (steps - 1) * topk * topk, 3
    for n in sorted({2, (candidates + 3) // 2, candidates + 1}):
        parent_list, top_scores_index, drafts = eagle_tree(bs, topk, steps, n, 50, gen)
        seq_lens = torch.randint(1, 20, (bs,), generator=gen)
        bonus = torch.randint(0, 50, (bs,), generator=gen)
        mask, positions, index, next_token, next_sibling, tokens = build_tree_kernel_efficient(
            bonus, parent_list, top_scores_index, drafts, seq_lens, int(seq_lens.sum()), topk, steps, n, mode)
        trees = [tree_from_sglang(tokens.view(bs, n)[b], next_token[b], next_sibling[b]) for b in range(bs)]
        ours = tree_verify_inputs(trees, seq_lens, n, full_mask=mode == FULL)
        assert torch.equal(ours.draft_token, tokens)
        assert torch.equal(ours.positions, positions)
        assert torch.equal(ours.retrieve_index, index)
        assert torch.equal(ours.retrieve_next_token, next_token)
        assert torch.equal(ours.retrieve_next_sibling, next_sibling)
        assert torch.equal(ours.custom_mask, mask.bool())


def test_padding_nodes_are_never_visited_even_when_their_token_matches():
    """Padding copies the root token under the root; a target that predicts exactly that token must still find
    no child (the padding sits in no retrieve list)."""
    tree = Tree(torch.tensor([4, 1]), torch.tensor([-1, 0]))
    inputs = tree_verify_inputs([tree], torch.tensor([5]), draft_token_num=4)
    predicts, accept_index, accept_token_num = sglang_greedy_verify(inputs, torch.tensor([[4, 0, 0, 0]]))
    assert accepted_leaves(accept_index, accept_token_num, predicts) == [(0, 4)]


def test_trees_sglang_cannot_verify_are_refused():
    chain = Tree.chain(torch.tensor([1, 2, 3]))
    with pytest.raises(WeaverError, match="one root"):
        tree_verify_inputs([Tree(torch.tensor([1, 2]), torch.tensor([-1, -1]))], torch.tensor([3]))
    with pytest.raises(WeaverError, match="smaller than a tree of 3 nodes"):
        tree_verify_inputs([chain], torch.tensor([3]), draft_token_num=2)
    with pytest.raises(WeaverError, match="one tree per request"):
        tree_verify_inputs([chain], torch.tensor([3, 4]))
