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
candidates up; README). The doubling keeps exploration cheap as the choice settles (a fixed rate of one step in 8
paid 2-3% of a SmolLM2 decode); the intervals grow only once the gain above the choice rests on `explore_every`
steps: sampled acceptance is noisy, and a gain read as zero from a few steps had locked sampled Weaver on SmolLM2
into budget 2. The first step uses the largest candidate.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from weaver.errors import WeaverError
from weaver.models.config import is_count


MAX_GAP_FACTOR = 16  # exploration intervals double up to this many times explore_every


class BudgetPlanner:
    def __init__(self, costs: dict[int, float], explore_every: int = 8, decay: float = 0.98, explore_reach: float = 1.75):
        if not costs or not all(is_count(b) for b in costs):
            raise WeaverError(f"budget: auto needs candidate budgets that are whole numbers >= 1, got {list(costs)}")
        bad = {b: c for b, c in costs.items() if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < math.inf}
        if bad:
            raise WeaverError(f"budget: auto needs finite step costs in seconds, got {bad}")
        if not is_count(explore_every, 2):
            raise WeaverError(f"explore_every must be at least 2, got {explore_every}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise WeaverError(f"decay is the weight a running mean keeps per step, in [0, 1), got {decay!r}")
        if isinstance(explore_reach, bool) or not isinstance(explore_reach, (int, float)) or not 1 <= explore_reach < math.inf:
            raise WeaverError(f"explore_reach is a step-cost ratio >= 1, got {explore_reach!r}")
        self.costs = dict(sorted(costs.items()))
        self.candidates = list(self.costs)
        self.explore_every, self.decay, self.explore_reach = explore_every, decay, explore_reach
        # running means: accepted drafts at the smallest candidate, and the gain from each candidate to the
        # next (read from the same steps, so estimates stay consistent when larger budgets are seen rarely)
        self.base: float | None = None
        self.gains: list[float | None] = [None] * (len(self.candidates) - 1)
        self.counts = [0] * len(self.candidates)  # observations behind base, gains[0], gains[1], ...
        self.updated = [0] * len(self.candidates)  # the step each of them was last updated at
        self.step_times = dict.fromkeys(self.candidates, 0)  # measured steps behind each cost
        self.steps = 0
        self.choice: int | None = None  # the budget chosen last (exploration steps aside)
        self.gap = self.next_explore = explore_every  # steps between explorations; the next one's step

    @property
    def largest(self) -> int:
        return self.candidates[-1]

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
        """A verified step at `budget` whose accepted path holds tree nodes `path` (anchor excluded), and
        what the step cost: the start-up cost of that budget moves toward what decoding measures (a probe
        on a fixed prompt can misjudge a budget whose trees grow differently on real text)."""
        if seconds is not None and budget in self.costs:
            self.step_times[budget] += 1
            weight = max(1 / (self.step_times[budget] + 1), 1 - self.decay)
            self.costs[budget] = (1 - weight) * self.costs[budget] + weight * seconds
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
        with 10% per reading, SmolLM2 DDTree 0.963 against 0.957; README)."""
        self.counts[slot] += 1
        elapsed, self.updated[slot] = max(1, self.steps - self.updated[slot]), self.steps
        weight = max(1 / self.counts[slot], 1 - self.decay ** elapsed)
        return value if mean is None else (1 - weight) * mean + weight * value


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
