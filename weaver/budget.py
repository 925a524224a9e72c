"""`budget: auto`: each step's draft budget chosen to maximise expected committed tokens per second.

Cost: the seconds one speculative step takes at budget b (draft, search, verify, accept, commit),
measured on this machine for every candidate budget at start-up (`measure_step_costs`) and then updated
from the steps decoding actually takes, so the choice follows the hardware: a CPU whose verify cost
grows fast with the tree picks small trees, a GPU large ones.

Acceptance: the search takes nodes best first, so the tree of budget b is the first b nodes of a larger
tree (with `auto` the nodes per expansion call follow the tree's size, not the budget, so this holds for
Weaver's batched calls too), and the path the acceptance rule walks in it is the walked path's prefix of nodes with
index <= b (indices grow along a path; greedy, RRS and target-only decisions at the nodes both trees
share are the same). One step verified at budget B therefore shows what every budget <= B would have
accepted. The planner keeps running means of the accepted drafts at the smallest candidate and of the
gain from each candidate to the next (both read from the same steps, so the rarely seen larger budgets
are estimated consistently with the frequently seen smaller ones), and picks
argmax (1 + E[accepted(b)]) / cost(b). Gains above the choice are seen only on exploration steps: `explore_every`
steps after its choice last changed a step verifies at the largest candidate costing at most `explore_reach`
(1.75) times the choice (at least the next larger one), then at doubling intervals (up to 16 x explore_every) while the
choice holds. One such step refreshes every gain a move up could rest on: exploring only the next larger
candidate left the gains beyond it at the first step's value, and when that step had accepted nothing between
budgets 1 and 32, DDTree on SmolLM2 sat at budget 1 (0.91-0.94 of the best fixed budget, whose gain lay two
candidates up; docs/results.md). The doubling keeps exploration cheap as the choice settles (a fixed rate of
one step in 8 paid 2-3% of a SmolLM2 decode); the intervals grow only once the gain above the choice rests on `explore_every`
steps: sampled acceptance is noisy, and a gain read as zero from a few steps had locked sampled Weaver on SmolLM2
into budget 2. The first step uses the largest candidate.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from weaver.errors import WeaverError
from weaver.models.config import is_count

if TYPE_CHECKING:
    from weaver.search import Proposal


MAX_GAP_FACTOR = 16  # exploration intervals double up to this many times explore_every


class StepCosts:
    """What every `budget: auto` planner keeps: the candidate budgets and the seconds a step takes at each,
    measured at start-up and moved toward what decoding measures."""

    def __init__(self, costs: dict[int, float], decay: float = 0.98):
        if not costs or not all(is_count(b) for b in costs):
            raise WeaverError(f"budget: auto needs candidate budgets that are whole numbers >= 1, got {list(costs)}")
        bad = {b: c for b, c in costs.items() if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < math.inf}
        if bad:
            raise WeaverError(f"budget: auto needs finite step costs in seconds, got {bad}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise WeaverError(f"decay is the weight a running mean keeps per step, in [0, 1), got {decay!r}")
        self.costs = dict(sorted(costs.items()))
        self.candidates = list(self.costs)
        self.decay = decay
        self.step_times = dict.fromkeys(self.candidates, 0)  # measured steps behind each cost

    @property
    def largest(self) -> int:
        """The largest tree a step takes."""
        return self.candidates[-1]

    def cut(self, proposal: Proposal) -> Proposal:
        """The part of the step's tree to verify (all of it: a budget is chosen before the tree is built)."""
        return proposal

    def observe(self, budget: int, path: Sequence[int], seconds: float | None = None) -> None:
        """A verified step at `budget` whose accepted path holds tree nodes `path` (anchor excluded), and what the
        step cost: the start-up cost of `budget` moves toward what decoding measures (a probe on a fixed prompt
        can misjudge a budget whose trees grow differently on real text)."""
        if seconds is not None and budget in self.costs:
            self.step_times[budget] += 1
            weight = max(1 / (self.step_times[budget] + 1), 1 - self.decay)
            self.costs[budget] = (1 - weight) * self.costs[budget] + weight * seconds


class BudgetPlanner(StepCosts):
    def __init__(self, costs: dict[int, float], explore_every: int = 8, decay: float = 0.98, explore_reach: float = 1.75):
        super().__init__(costs, decay)
        if not is_count(explore_every, 2):
            raise WeaverError(f"explore_every must be at least 2, got {explore_every}")
        if isinstance(explore_reach, bool) or not isinstance(explore_reach, (int, float)) or not 1 <= explore_reach < math.inf:
            raise WeaverError(f"explore_reach is a step-cost ratio >= 1, got {explore_reach!r}")
        self.explore_every, self.explore_reach = explore_every, explore_reach
        # running means: accepted drafts at the smallest candidate, and the gain from each candidate to the
        # next (read from the same steps, so estimates stay consistent when larger budgets are seen rarely)
        self.base: float | None = None
        self.gains: list[float | None] = [None] * (len(self.candidates) - 1)
        self.counts = [0] * len(self.candidates)  # observations behind base, gains[0], gains[1], ...
        self.updated = [0] * len(self.candidates)  # the step each of them was last updated at
        self.steps = 0
        self.choice: int | None = None  # the budget chosen last (exploration steps aside)
        self.gap = self.next_explore = explore_every  # steps between explorations; the next one's step

    @property
    def accepted(self) -> dict[int, float]:
        """Expected accepted drafts per candidate, as far as the observed gains reach."""
        if self.base is None:
            return {}
        out, total = {self.candidates[0]: self.base}, self.base
        for b, gain in zip(self.candidates[1:], self.gains):
            if gain is None:
                break
            total += gain
            out[b] = total
        return out

    def best(self) -> int:
        """The candidate with the highest expected tokens per second (the largest before any step)."""
        accepted = self.accepted
        if not accepted:
            return self.largest
        return max(accepted, key=lambda b: (1 + accepted[b]) / self.costs[b])

    def next_budget(self) -> int:
        self.steps += 1
        best = self.best()
        if best != self.choice:  # a new choice: explore above it at the starting rate again
            self.choice, self.gap, self.next_explore = best, self.explore_every, self.steps + self.explore_every
        if self.steps >= self.next_explore:
            if self._seen_above(best) >= self.explore_every:  # back off only once the gain above is measured
                self.gap = min(2 * self.gap, MAX_GAP_FACTOR * self.explore_every)
            self.next_explore = self.steps + self.gap
            return self._explored_from(best)
        return best

    def _explored_from(self, budget: int) -> int:
        """The budget an exploration step above `budget` verifies: the largest candidate whose step costs at most
        explore_reach times `budget`'s, at least the next larger one (`budget` itself when it is the largest)."""
        above = [b for b in self.candidates if b > budget]
        if not above:
            return budget
        within = [b for b in above if self.costs[b] <= self.explore_reach * self.costs[budget]]
        return within[-1] if within else above[0]

    def _seen_above(self, budget: int) -> int:
        """Steps behind the estimated gain from `budget` to the next larger candidate."""
        i = self.candidates.index(budget)
        return self.counts[i + 1] if i + 1 < len(self.candidates) else 0

    def observe(self, budget: int, path: Sequence[int], seconds: float | None = None) -> None:
        """The step's cost, then the running means of the accepted drafts at every budget <= `budget`."""
        super().observe(budget, path, seconds)
        seen = [sum(1 for node in path if node <= b) for b in self.candidates if b <= budget]
        if not seen:
            return
        self.base = self._mean(0, self.base, seen[0])
        for i in range(len(seen) - 1):
            self.gains[i] = self._mean(i + 1, self.gains[i], seen[i + 1] - seen[i])

    def _mean(self, slot: int, mean: float | None, value: float) -> float:
        """The plain mean of the first observations, then an exponential one in steps, not observations: a value
        last read n steps ago keeps decay ** n of its weight, so a gain seen only on exploration steps follows
        each fresh reading instead of staying near a low one read before the choice moved below it (replayed at
        reach 1.5, median of 50 prompt orders against the best fixed budget: tiny-target DDTree 0.88 against 0.82
        with 10% per reading, SmolLM2 DDTree 0.963 against 0.957; docs/results.md)."""
        self.counts[slot] += 1
        elapsed, self.updated[slot] = max(1, self.steps - self.updated[slot]), self.steps
        weight = max(1 / self.counts[slot], 1 - self.decay ** elapsed)
        return value if mean is None else (1 - weight) * mean + weight * value


class StepwisePlanner(StepCosts):
    """`budget: auto` chosen at every step from the step's own tree, for greedy trees of calibrated drafter
    marginals that cost little more to build large than small (the chain, DDTree). Each step builds the largest
    candidate's tree and verifies its first b nodes, b the candidate maximising (1 + the sum of those nodes'
    path probabilities) / cost(b): the product of a node's edge probabilities is the chance that greedy
    acceptance walks through it when the drafter is calibrated (KL-distilled marginals are: docs/results.md,
    calibration), so the sum is the step's expected accepted drafts at b. A confident step verifies a long
    chain, an unsure one a few nodes. Nothing is estimated across steps but the costs, so there is no
    exploration and no warm-up. Opt-in (`eval.auto_budget.stepwise`): replayed over recorded steps at the
    probe's fixed-budget costs it led the best fixed budget (tiny DDTree 1.22x, SmolLM2 1.02x), but building
    the largest tree every step costs what it saves, and decoding on our CPUs measured it at or below the
    running-means planner (docs/results.md: per-step budgets). `build`: the budget of the tree each step builds
    (default the largest candidate; the start-up probe times one candidate at a time as these steps take it)."""

    def __init__(self, costs: dict[int, float], decay: float = 0.98, build: int | None = None):
        super().__init__(costs, decay)
        if build is not None and not is_count(build):
            raise WeaverError(f"a stepwise planner builds trees of a whole number of draft nodes >= 1, got {build!r}")
        self.build = max(self.candidates[-1], build or 0)

    @property
    def largest(self) -> int:
        """The largest tree a step takes: the one every step builds."""
        return self.build

    def next_budget(self) -> int:
        return self.build

    def cut(self, proposal: Proposal) -> Proposal:
        if len(proposal.tree) - 1 <= self.candidates[0]:  # a tree that stopped short (a shallow block): nothing to choose
            return proposal
        return proposal.first(self.choose(proposal.path_probs()[1:].cumsum(0).tolist()))

    def choose(self, expected: Sequence[float]) -> int:
        """The budget to verify, given expected[i]: the expected accepted drafts within the tree's first i + 1
        nodes (candidates past the tree's size are out)."""
        fits = [b for b in self.candidates if b <= len(expected)] or [len(expected)]
        return max(fits, key=lambda b: (1 + expected[b - 1]) / self.costs.get(b, math.inf))


def measure_step_costs(
    step_seconds: Callable[[int], Sequence[float]], candidates: Sequence[int], repeats: int = 3
) -> dict[int, float]:
    """Median seconds per step at each candidate budget; step_seconds(b) runs a short decode at budget b
    and returns its steps' times. Candidates are timed in interleaved rounds, so a drift in machine load
    hits all alike."""
    check_candidates(candidates)
    if not is_count(repeats):
        raise WeaverError(f"eval.auto_budget.repeats must be a whole number >= 1, got {repeats!r}")
    times: dict[int, list[float]] = {b: [] for b in candidates}
    for _ in range(repeats):
        for b in candidates:
            times[b] += list(step_seconds(b))
    return {b: statistics.median(t) for b, t in times.items() if t}


def check_budgets(budgets: Sequence[int | str]) -> None:
    """Config budgets are numbers of draft nodes (at least 1) or `auto`."""
    bad = [b for b in budgets if b != "auto" and not is_count(b)]
    if bad:
        raise WeaverError(f"eval.budgets entries are numbers of draft nodes (>= 1) or 'auto', got {bad}")


def check_candidates(candidates: Sequence[int]) -> None:
    """`budget: auto` candidates (eval.auto_budget.candidates): at least one, each a number of draft nodes >= 1."""
    if not candidates or not all(is_count(b) for b in candidates):
        raise WeaverError(f"eval.auto_budget.candidates must be numbers of draft nodes (>= 1) that fit the method's "
                          f"tree, got {list(candidates)}")
