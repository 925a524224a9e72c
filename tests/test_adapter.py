"""The Weaver adapter and its tree builder: incremental tree scoring equals scoring each path alone, an
untrained adapter is the drafter's prior (its tree is DDTree's), greedy decoding with Weaver trees is
lossless, sampling through the whole engine reproduces the target's distribution (chi-square test of the
first two emitted tokens, with a broken rule as the control), and checkpoints round-trip or fail with one
clear message."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from scipy.stats import chi2


from hf_tiny import VOCAB, draft_vocab_drafter
from test_builders import paths_of
from weaver.acceptance import SAMPLING_RULES, SamplingRule
from weaver.builders import SearchConfig, StepInputs, ddtree, weaver_tree
from weaver.engine import speculative_generate
from weaver.errors import WeaverError
from weaver.generate import generate
from weaver.models.adapter import AdapterConfig, WeaverAdapter, draft_pools, load_adapter, save_adapter, with_pool
from weaver.models.drafter import Draft, Drafter
from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config
from weaver.models.layers import init_weights

BLOCK = 6


def make_adapter(target, pool_size: int = 16, num_layers: int = 2, trained: bool = True) -> WeaverAdapter:
    cfg = AdapterConfig(target.cfg.hidden_size, target.cfg.vocab_size, BLOCK - 1, d_model=32, num_layers=num_layers,
                        num_heads=2, intermediate_size=64, rank=8, pool_size=pool_size)
    adapter = WeaverAdapter(cfg)
    init_weights(adapter, 0.2)
    if not trained:
        adapter.reset_scorer()
    return adapter.eval()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    return Drafter(drafter_config(new_drafter_config(target, 1, BLOCK, 2, 2))).eval()


def step_inputs(target, drafter, prompt: list[int]):
    """(draft logits (D, V), drafter states (D, H), target state before the anchor (H,), anchor, cache)."""
    cache, context = target.new_cache(1, 64), drafter.new_cache(1, 64)
    out = target(torch.tensor([prompt]), cache, tap_layers=drafter.cfg.target_layer_ids, logits_to_keep=1)
    drafter.extend_context(context, out.taps, torch.arange(len(prompt))[None])
    anchor = int(out.logits[0, -1].argmax())
    draft = drafter.draft(target, context, torch.tensor([anchor]), cache.next_position)
    return draft.logits[0], draft.hidden[0], out.hidden[0, -1], anchor


def as_step(target, adapter, logits, hidden, target_hidden, anchor: int) -> StepInputs:
    """`step_inputs`' values as the builders' StepInputs."""
    return StepInputs(anchor, Draft(logits[None], hidden[None]), target_hidden, target, adapter=adapter)


def path_alone_logprobs(adapter, target, logits, hidden, target_hidden, path: list[int]) -> torch.Tensor:
    """The adapter's distribution for the children of the last node of `path`, scoring the path as a chain."""
    D = len(path)
    pool_logits, pool_tokens = draft_pools(logits, adapter.cfg.pool_size)
    cache = adapter.start(adapter.prefix(target_hidden[None], hidden[None]), capacity=D)
    causal = torch.ones(D, D, dtype=torch.bool).tril()[None]
    states = adapter(adapter.node_inputs(target, torch.tensor(path))[None], torch.arange(D), cache, causal)[0, -1]
    k = D - 1
    scores = adapter.pool_scores(states, pool_logits[k], adapter.pool_candidates(target, pool_tokens[k]))
    return torch.zeros(logits.shape[-1]).scatter_(0, pool_tokens[k], scores.softmax(-1))


@pytest.mark.parametrize("per_call,budget", [(1, 12), (3, 20), (8, 9)])
@torch.inference_mode()
def test_incremental_tree_scoring_equals_each_path_alone(target, drafter, per_call, budget):
    torch.manual_seed(per_call)
    adapter = make_adapter(target)
    logits, hidden, target_hidden, anchor = step_inputs(target, drafter, [5, 9, 3, 7])
    proposal = weaver_tree(as_step(target, adapter, logits, hidden, target_hidden, anchor), SearchConfig(budget, 3, per_call))
    tree = proposal.tree
    assert len(tree) == budget + 1 and len(proposal.child_probs) > 2
    for node, probs in proposal.child_probs.items():
        path = tree.tokens[tree.path_to(node)].tolist()
        alone = path_alone_logprobs(adapter, target, logits, hidden, target_hidden, path)
        torch.testing.assert_close(probs, alone, atol=1e-5, rtol=1e-4)


def rescored_reference(adapter, target, logits, hidden, target_hidden, anchor, budget, rescore, children):
    """The rescored tree written plainly: every candidate of the drafter's DDTree of rescore x budget nodes
    scored alone as a path; the token paths of the `budget` candidates of the best adapter path scores, a
    child counting only among its parent's `children` most likely."""
    candidates = ddtree(anchor, logits[:budget], rescore * budget).tree
    scores = {(): 0.0}
    for node in range(1, len(candidates)):  # topological: a parent's path is scored before its children's
        path = candidates.tokens[candidates.path_to(node)].tolist()
        probs = path_alone_logprobs(adapter, target, logits, hidden, target_hidden, path[:-1])
        p = probs[path[-1]]
        among_best = int((probs > p).sum()) < children and p > 0
        scores[tuple(path[1:])] = scores[tuple(path[1:-1])] + (float(p.log()) if among_best else -math.inf)
    ranked = sorted((path for path in scores if path and scores[path] > -math.inf), key=scores.get, reverse=True)
    return set(ranked[:budget])


@pytest.mark.parametrize("budget,rescore,children", [(1, 4, 8), (5, 3, 2), (12, 4, 3), (9, 1, 16)])
@torch.inference_mode()
def test_rescored_tree_keeps_the_adapters_best_candidates(target, drafter, budget, rescore, children):
    """`SearchConfig.rescore` (greedy): one adapter call over the drafter's best rescore x budget nodes, the
    adapter's best `budget` of them kept; against each candidate scored alone."""
    torch.manual_seed(budget)
    adapter = make_adapter(target)
    logits, hidden, target_hidden, anchor = step_inputs(target, drafter, [5, 9, 3, 7])
    step = as_step(target, adapter, logits, hidden, target_hidden, anchor)
    proposal = weaver_tree(step, SearchConfig(budget, children, rescore=rescore))
    tree = proposal.tree
    assert int(tree.tokens[0]) == anchor and len(tree) <= budget + 1
    assert paths_of(tree) == rescored_reference(adapter, target, logits, hidden, target_hidden, anchor, budget,
                                                rescore, children)
    for node, probs in proposal.child_probs.items():  # what the acceptance rules and the NaN check read
        path = tree.tokens[tree.path_to(node)].tolist()
        torch.testing.assert_close(probs, path_alone_logprobs(adapter, target, logits, hidden, target_hidden, path),
                                   atol=1e-5, rtol=1e-4)


@torch.inference_mode()
def test_compiled_search_step_builds_the_eager_tree(target, drafter):
    """`WeaverAdapter.scorer(compiled=True)`: one torch.compile graph (dynamic shapes) for every wave size
    and budget, the same trees as the eager adapter step; and the rescored tree's whole selection as one graph
    per budget (`weaver.static_trees.rescorer`), the same trees as eager."""
    adapter = make_adapter(target)
    logits, hidden, target_hidden, anchor = step_inputs(target, drafter, [5, 9, 3, 7])
    for budget, per_call, rescore in ((6, 1, None), (13, 3, None), (7, None, 3), (2, None, 4)):
        step = as_step(target, adapter, logits, hidden, target_hidden, anchor)
        eager, compiled = (weaver_tree(step, SearchConfig(budget, 3, per_call, compiled=flag, rescore=rescore))
                           for flag in (False, True))
        assert eager.tree.tokens.tolist() == compiled.tree.tokens.tolist()
        assert eager.tree.parents.tolist() == compiled.tree.parents.tolist()
        for node, probs in eager.child_probs.items():
            torch.testing.assert_close(compiled.child_probs[node], probs, atol=1e-5, rtol=1e-4)


@torch.inference_mode()
def test_untrained_adapter_builds_the_ddtree(target, drafter):
    """Q = 0: scores are the drafter's logits; with the whole vocabulary as the pool the tree is DDTree's."""
    adapter = make_adapter(target, pool_size=VOCAB, trained=False)
    logits, hidden, target_hidden, anchor = step_inputs(target, drafter, [4, 8, 15, 16])
    for budget in (5, 17):
        step = as_step(target, adapter, logits, hidden, target_hidden, anchor)
        ours = weaver_tree(step, SearchConfig(budget, budget, 4)).tree
        reference = ddtree(anchor, logits, budget).tree
        assert ours.tokens.tolist() == reference.tokens.tolist()
        assert ours.parents.tolist() == reference.parents.tolist()
        # rescoring DDTree's own candidates by the drafter's prior keeps DDTree's best nodes
        assert paths_of(weaver_tree(step, SearchConfig(budget, budget, rescore=2)).tree) == paths_of(reference)


@pytest.mark.parametrize("budget,width,rescore", [(4, 8, None), (16, 3, None), (40, 8, None), (4, 8, 4), (16, 3, 2)])
def test_greedy_is_lossless_with_weaver_trees(target, drafter, budget, width, rescore):
    torch.manual_seed(budget)
    adapter = make_adapter(target)
    for n in (3, 11):
        prompt = torch.randint(3, VOCAB, (n,)).tolist()
        out, stats = speculative_generate(target, drafter, prompt, 32, method="weaver", budget=budget,
                                          adapter=adapter, children=width, rescore=rescore)
        assert out == generate(target, [prompt], 32)[0]


@torch.inference_mode()
def test_a_wider_search_pool_rescores_the_same_candidates_alike(target, drafter):
    """`weaver.search.pool`: the weights do not depend on the pool, so on the trained pool's candidates a
    wider pool's distribution is the trained one times a constant; greedy decoding with it stays lossless."""
    adapter = make_adapter(target, pool_size=16)
    wider = with_pool(copy.deepcopy(adapter), 48)
    assert (wider.cfg.pool_size, adapter.cfg.pool_size) == (48, 16) and with_pool(adapter, None) is adapter
    logits, hidden, target_hidden, anchor = step_inputs(target, drafter, [5, 9, 3, 7])
    for path in ([anchor], [anchor, 11, 4]):
        trained, widened = (path_alone_logprobs(a, target, logits, hidden, target_hidden, path) for a in (adapter, wider))
        on_pool = trained > 0
        assert int(on_pool.sum()) == 16 and int((widened > 0).sum()) == 48 and bool((widened[on_pool] > 0).all())
        torch.testing.assert_close(widened[on_pool] / widened[on_pool].sum(), trained[on_pool], atol=1e-6, rtol=1e-5)
    prompt = [3, 14, 15, 9]
    out, _ = speculative_generate(target, drafter, prompt, 24, method="weaver", budget=12, adapter=wider, children=24)
    assert out == generate(target, [prompt], 24)[0]
    with pytest.raises(WeaverError, match="weaver.search.pool must be a whole number >= 1 or null"):
        with_pool(adapter, 0)


def test_weaver_sampling_runs_and_is_reproducible(target, drafter):
    """... and `rescore`, a greedy search, leaves sampled trees to the wave search (same draws, same tokens)."""
    adapter = make_adapter(target)
    runs = [speculative_generate(target, drafter, [5, 6, 7], 20, temperature=1.0, method="weaver", budget=8,
                                 adapter=adapter, generator=torch.Generator().manual_seed(4), rescore=rescore)[0]
            for rescore in (None, None, 4)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 20


def test_weaver_without_adapter_is_refused(target, drafter):
    with pytest.raises(WeaverError, match="needs a trained adapter"):
        speculative_generate(target, drafter, [5, 6], 4, method="weaver", budget=4)


def test_checkpoint_round_trip_and_clear_failures(target, tmp_path):
    adapter = make_adapter(target)
    save_adapter(adapter, tmp_path / "a")
    loaded = load_adapter(tmp_path / "a", target, BLOCK - 1)
    for (name, x), y in zip(adapter.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(x, y), name
    with pytest.raises(WeaverError, match="drafter drafts 7 positions"):
        load_adapter(tmp_path / "a", target, 7)
    with pytest.raises(WeaverError, match="no Weaver adapter"):
        load_adapter(tmp_path / "missing", target, BLOCK - 1)
    (tmp_path / "a" / "model.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(WeaverError, match="not a readable Weaver adapter"):
        load_adapter(tmp_path / "a", target, BLOCK - 1)


def test_adapter_for_another_target_is_refused(target, tmp_path):
    cfg = AdapterConfig(target.cfg.hidden_size + 8, target.cfg.vocab_size, BLOCK - 1, d_model=16, num_heads=2)
    save_adapter(WeaverAdapter(cfg), tmp_path / "b")
    with pytest.raises(WeaverError, match="trained for hidden size"):
        load_adapter(tmp_path / "b", target, BLOCK - 1)


# --- sampling through the whole engine ------------------------------------------------------------
# The first emitted token comes from the prefill, the second from the first verified tree, so their joint
# law tests the builder's draws, the acceptance rule and the bonus token together. A low temperature makes
# the random models' distributions peaked, so drafts are both accepted and rejected often.

PROMPT = [5, 9, 3, 7]
TEMPERATURE = 0.1  # peaked enough for a spread of likely pairs, drafts accepted about a third of the time
TRIALS = 1000
ALPHA = 1e-3


def first_two_tokens(target, drafter, adapter, sampling: str, trials: int, method: str = "weaver",
                     draft_temperature: float | None = None, fixed_children: int = 0, budget: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    out = [speculative_generate(target, drafter, PROMPT, 2, temperature=TEMPERATURE, generator=gen, method=method,
                                budget=budget, adapter=adapter, sampling=sampling, children=3,
                                draft_temperature=draft_temperature, fixed_children=fixed_children)[0]
           for _ in range(trials)]
    return torch.tensor(out)


@torch.inference_mode()
def target_joint(target) -> torch.Tensor:
    """(V, V) exact p(x1 | prompt) p(x2 | prompt, x1) at TEMPERATURE."""
    first = target(torch.tensor([PROMPT])).logits[0, -1]
    ids = torch.cat([torch.tensor(PROMPT).expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
    second = target(ids).logits[:, -1]
    p1 = torch.softmax(first.double() / TEMPERATURE, -1)
    return p1[:, None] * torch.softmax(second.double() / TEMPERATURE, -1)


def chi_square_pvalue(samples: torch.Tensor, joint: torch.Tensor) -> float:
    """Pearson test of (x1, x2) counts; cells expecting fewer than 5 draws are pooled into one."""
    counts = torch.bincount(samples[:, 0] * VOCAB + samples[:, 1], minlength=VOCAB * VOCAB).double()
    expected = joint.flatten() * len(samples)
    small = expected < 5
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    assert len(expected) > 5, "the test needs a spread of likely token pairs"
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(expected) - 1))


def accept_every_draft(tree, logits, proposal, temperature, generator, observe=None):
    """Broken on purpose: follow the first child to a leaf, then sample the bonus from the target."""
    leaf = 0
    while tree.children(leaf):
        leaf = tree.children(leaf)[0]
    bonus = torch.multinomial(torch.softmax(logits[leaf].float() / temperature, -1), 1, generator=generator)
    return leaf, int(bonus)


@pytest.mark.parametrize("sampling", ["rrs", "traversal", "target_only"])
def test_weaver_sampling_reproduces_the_target_distribution(target, drafter, sampling):
    torch.manual_seed(3)
    adapter = make_adapter(target, pool_size=VOCAB)
    samples = first_two_tokens(target, drafter, adapter, sampling, TRIALS)
    assert chi_square_pvalue(samples, target_joint(target)) > ALPHA


@pytest.mark.parametrize("method", ["ddtree", "weaver"])
@pytest.mark.parametrize("draft_temperature", [0.03, 0.4])
def test_sampling_at_another_draft_temperature_reproduces_the_target_distribution(target, drafter, method,
                                                                                  draft_temperature):
    """Trees drawn from a sharper or flatter draft than the sampling temperature's: rejection sampling corrects
    for any draft distribution, as long as it accepts against the one the trees were drawn from."""
    torch.manual_seed(3)
    adapter = make_adapter(target, pool_size=VOCAB)
    samples = first_two_tokens(target, drafter, adapter, "rrs", TRIALS, method, draft_temperature)
    assert chi_square_pvalue(samples, target_joint(target)) > ALPHA


@pytest.mark.parametrize("method,fixed", [("chain", 1), ("ddtree", 1), ("weaver", 1), ("weaver", 2)])
def test_sampling_with_fixed_children_reproduces_the_target_distribution(target, drafter, method, fixed):
    """Each node's most probable children taken as they are, the rest drawn from what is left, through the whole
    engine: still an exact sample of the target."""
    torch.manual_seed(3)
    adapter = make_adapter(target, pool_size=VOCAB)
    samples = first_two_tokens(target, drafter, adapter, "rrs", TRIALS, method, fixed_children=fixed,
                               budget=5 if method == "chain" else 6)  # a chain holds block_size - 1 drafts
    assert chi_square_pvalue(samples, target_joint(target)) > ALPHA


def test_weaver_with_a_draft_vocabulary_is_lossless_greedy_and_sampling(target):
    """Half the pool outside the drafter's vocabulary (probability 0): greedy output is the target's, and
    sampling still reproduces the target's distribution."""
    drafter, _ = draft_vocab_drafter(target, BLOCK, VOCAB // 2, seed=8)
    torch.manual_seed(3)
    adapter = make_adapter(target, pool_size=VOCAB)
    for n in (3, 11):
        prompt = torch.randint(3, VOCAB, (n,)).tolist()
        out, _ = speculative_generate(target, drafter, prompt, 24, method="weaver", budget=12, adapter=adapter)
        assert out == generate(target, [prompt], 24)[0]
    samples = first_two_tokens(target, drafter, adapter, "rrs", TRIALS)
    assert chi_square_pvalue(samples, target_joint(target)) > ALPHA


@pytest.mark.parametrize("rescore", [None, 2])
@torch.inference_mode()
def test_weaver_reads_the_draft_vocabulary_and_builds_the_whole_rows_tree(target, rescore):
    """Given the drafter's draft vocabulary (`Draft.vocab`), the Weaver search takes its pools (and the rescored
    tree its candidates) over those columns only: the tree and child distributions of the whole rows."""
    drafter, _ = draft_vocab_drafter(target, BLOCK, VOCAB // 2, seed=8)
    torch.manual_seed(4)
    adapter = make_adapter(target)
    logits, hidden, target_hidden, anchor = step_inputs(target, drafter, [5, 9, 3, 7])
    full = as_step(target, adapter, logits, hidden, target_hidden, anchor)
    fast = StepInputs(anchor, Draft(logits[None], hidden[None], drafter.draft_vocab), target_hidden, target,
                      adapter=adapter)
    search = SearchConfig(9, 3, rescore=rescore)
    want, got = weaver_tree(full, search), weaver_tree(fast, search)
    assert torch.equal(got.tree.tokens, want.tree.tokens) and torch.equal(got.tree.parents, want.tree.parents)
    assert bool(torch.isin(got.tree.tokens[1:], drafter.draft_vocab).all())
    assert got.child_probs.keys() == want.child_probs.keys()
    for node, probs in want.child_probs.items():
        torch.testing.assert_close(got.child_probs[node], probs)


def test_an_accept_everything_rule_fails_the_same_test(target, drafter, monkeypatch):
    torch.manual_seed(3)
    adapter = make_adapter(target, pool_size=VOCAB)
    monkeypatch.setitem(SAMPLING_RULES, "rrs", SamplingRule(accept_every_draft, draws_trees=True))
    samples = first_two_tokens(target, drafter, adapter, "rrs", TRIALS // 2)
    assert chi_square_pvalue(samples, target_joint(target)) < 1e-6
