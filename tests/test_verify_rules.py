"""Acceptance rules alone (weaver.verify): greedy on hand-made logits, and exact statistical tests of
speculative sampling along a chain against a synthetic Markov target over a tiny vocabulary.

The sampling test simulates what the engine does: draft a chain d_1..d_3 ~ q_i from a factorized
proposal, score [anchor, d_1, d_2, d_3] with the target, run the rule, and keep the emitted tokens
(accepted drafts, then the bonus); if a step emits one token only, the next step starts from it with
fresh drafts. The first two emitted tokens must follow p(x1 | a) p(x2 | x1) exactly (chi-square test),
and the same test must reject deliberately broken rules. A chain of one draft puts the bonus token after
a fully accepted chain among the first two tokens too.
"""

from __future__ import annotations

import pytest
import torch

from weaver.verify import greedy_chain, speculative_sampling_chain

V = 4  # vocabulary of the synthetic target
CHAIN = 3  # drafts per step
TRIALS = 20000  # for the correct rule (test power); broken rules fail by orders of magnitude with fewer
BROKEN_TRIALS = 4000
# Upper 1e-3 quantile of chi-square with V*V - 1 = 15 degrees of freedom (scipy.stats.chi2.ppf(0.999, 15)).
CHI2_CRIT_DF15 = 37.697


# --- greedy -------------------------------------------------------------------------------------


def peaked_logits(tokens: list[int], vocab: int = 11) -> torch.Tensor:
    """Row i has its argmax at tokens[i] (other entries random but lower)."""
    logits = torch.rand(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_chain_accepts_all():
    logits = peaked_logits([3, 7, 1, 9])  # target's choices after anchor, d1, d2, d3
    assert greedy_chain(logits, torch.tensor([3, 7, 1])) == (3, 9)


def test_greedy_chain_accepts_none():
    logits = peaked_logits([3, 7, 1, 9])
    assert greedy_chain(logits, torch.tensor([4, 7, 1])) == (0, 3)


@pytest.mark.parametrize("drafts,expected", [
    ([3, 2, 1], (1, 7)),
    ([3, 7, 0], (2, 1)),
    ([3, 0, 1], (1, 7)),  # a later match after a mismatch must not count
    ([5, 7, 1], (0, 3)),
])
def test_greedy_chain_partial(drafts, expected):
    logits = peaked_logits([3, 7, 1, 9])
    assert greedy_chain(logits, torch.tensor(drafts)) == expected


def test_greedy_chain_single_node():
    """A chain of the anchor alone (no drafts) emits the target's argmax."""
    assert greedy_chain(peaked_logits([6]), torch.tensor([], dtype=torch.long)) == (0, 6)


# --- sampling: broken rules the test must catch ------------------------------------------------------


def broken_resample_from_p(target_logits, draft_probs, drafts, temperature, generator=None):
    """Wrong: on rejection, sample from p_i instead of the residual max(p_i - q_i, 0)."""
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    u = torch.rand(len(drafts), generator=generator)
    for i, d in enumerate(drafts.tolist()):
        if u[i] * draft_probs[i, d] <= p[i, d]:
            continue
        return i, int(torch.multinomial(p[i], 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


def broken_inverted_ratio(target_logits, draft_probs, drafts, temperature, generator=None):
    """Wrong: accept with probability min(1, q/p) (the ratio inverted); residual as usual."""
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    u = torch.rand(len(drafts), generator=generator)
    for i, d in enumerate(drafts.tolist()):
        if u[i] * p[i, d] <= draft_probs[i, d]:
            continue
        residual = (p[i] - draft_probs[i]).clamp_min(0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


def broken_bonus_row(target_logits, draft_probs, drafts, temperature, generator=None):
    """Wrong: after accepting every draft, the bonus comes from the row before the last (off by one)."""
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    u = torch.rand(len(drafts), generator=generator)
    for i, d in enumerate(drafts.tolist()):
        if u[i] * draft_probs[i, d] <= p[i, d]:
            continue
        residual = (p[i] - draft_probs[i]).clamp_min(0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-2], 1, generator=generator))


# --- sampling: the simulation ----------------------------------------------------------------------


def synthetic_problem(seed: int, chain: int = CHAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p table (V, V): row a = log p(. | a), proposal q (V, chain, V): q_i(. | anchor a)).

    Both peaky and different from each other; p keeps every entry >= 0.05 so every chi-square cell
    has a healthy expected count.
    """
    gen = torch.Generator().manual_seed(seed)
    p = 0.8 * torch.softmax(2.5 * torch.randn(V, V, generator=gen), -1) + 0.2 / V
    q = 0.9 * torch.softmax(2.5 * torch.randn(V, chain, V, generator=gen), -1) + 0.1 / V
    return p.log(), q


def first_two_tokens(rule, log_p: torch.Tensor, q: torch.Tensor, temperature: float, anchor: int,
                     trials: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(trials, 2) first two tokens emitted by repeated verify steps from `anchor`, and how often each
    number of accepted drafts occurred (over all steps)."""
    chain = q.shape[1]
    out = torch.empty(trials, 2, dtype=torch.long)
    accepted = torch.zeros(chain + 1, dtype=torch.long)
    for t in range(trials):
        emitted, a = [], anchor
        while len(emitted) < 2:
            drafts = torch.multinomial(q[a], 1, generator=gen).squeeze(-1)  # d_i ~ q_i(. | a), fresh each step
            nodes = torch.cat([torch.tensor([a]), drafts])
            n, bonus = rule(log_p[nodes], q[a], drafts, temperature, gen)  # row i = log p(. | node i)
            assert 0 <= n <= chain and 0 <= bonus < V
            accepted[n] += 1
            emitted += drafts[:n].tolist() + [bonus]
            a = emitted[-1]
        out[t] = torch.tensor(emitted[:2])
    return out, accepted


def chi_square(samples: torch.Tensor, log_p: torch.Tensor, temperature: float, anchor: int) -> float:
    """Pearson statistic of the (x1, x2) counts against p_T(x1 | a) p_T(x2 | x1), p_T = softmax(log p / T)."""
    p = torch.softmax(log_p.double() / temperature, -1)
    expected = (p[anchor][:, None] * p) * len(samples)
    counts = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V).view(V, V).double()
    assert float(expected.min()) > 5
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature,chain,anchor", [(1.0, 3, 0), (0.7, 3, 2), (1.0, 1, 1)])
def test_speculative_sampling_chain_is_lossless(temperature, chain, anchor):
    """chain 3: the first two tokens come from accepted drafts, the residual, or the bonus after one
    accepted draft; chain 1: also from the bonus after a fully accepted chain."""
    log_p, q = synthetic_problem(seed=1, chain=chain)
    gen = torch.Generator().manual_seed(123)
    samples, accepted = first_two_tokens(speculative_sampling_chain, log_p, q, temperature, anchor, TRIALS, gen)
    assert (accepted > 0.02 * accepted.sum()).all(), accepted  # every branch of the rule is exercised
    stat = chi_square(samples, log_p, temperature, anchor)
    assert stat < CHI2_CRIT_DF15, f"chi2 = {stat:.1f}"


@pytest.mark.parametrize("rule,chain", [(broken_resample_from_p, 3), (broken_inverted_ratio, 3), (broken_bonus_row, 1)])
def test_broken_rules_are_detected(rule, chain):
    log_p, q = synthetic_problem(seed=1, chain=chain)
    gen = torch.Generator().manual_seed(123)
    samples, _ = first_two_tokens(rule, log_p, q, 1.0, 1 if chain == 1 else 0, BROKEN_TRIALS, gen)
    stat = chi_square(samples, log_p, 1.0, 1 if chain == 1 else 0)
    assert stat > CHI2_CRIT_DF15, f"broken rule passed: chi2 = {stat:.1f}"
