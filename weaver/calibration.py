"""Acceptance-calibrated priorities for sampled trees (`eval.rrs_priority: acceptance`, docs/method.md §2.4).

The sampled search (`weaver.search`) ranks a node's next child by the draft mass still undrawn and a path by
its draft probability: what a walk that follows the target's own draws accepts. Recursive rejection sampling
accepts differently: once a node's first k - 1 children are rejected, it accepts the k-th with probability
h_k = sum_x min(p_k(x), q_k(x)) (p_k: the target's residual, q_k: the draft renormalised without the children
drawn), which depends on how close the draft is to the target, not on how sharp it is.

`AcceptanceTable` estimates h from the steps already verified, per cell (child depth, child rank among its
siblings, confidence of the node's draft distribution = its largest probability), and gives the search
log P(reach child k | reach its node) = sum_{i<k} log(1 - h_i) + log h_k as the child's share of the path
score. The rule reports h itself at every child it considers (the exact acceptance probability, not the 0/1
outcome: less noise per step). Cells with few observations lean on their rank's and confidence's mean over
depths, that on the rank's mean, and that on the previous rank's (the first rank's on the mean of all).

Lossless: a priority depends on earlier steps and on the node's own draft distribution only, never on the value
of the child it ranks nor on the target's current distribution, which is all RRS needs (`weaver.search`).
Within a node priorities decrease with rank (a running minimum, less a tie-break), so a node's children in the
tree are always its first k draws, in the order drawn.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weaver.search import Proposal

CONFIDENCE_EDGES = (0.1, 0.2, 0.35, 0.5, 0.7, 0.85)  # buckets of a draft distribution's largest probability
DEPTHS = 3  # child depth 1, 2, and 3 or deeper
PRIOR_WEIGHT = 4.0  # pseudo-observations of the coarser mean in each cell's estimate
FIRST_GUESS = 0.5  # h before any observation
RANK_TIE_BREAK = 1e-4  # later ranks a little lower still: a top-k must never take a node's k+1-th child before its k-th


def shrunk_mean(total: torch.Tensor, count: torch.Tensor, prior: torch.Tensor | float) -> torch.Tensor:
    return (total + PRIOR_WEIGHT * prior) / (count + PRIOR_WEIGHT)


class AcceptanceTable:
    """Running estimates of RRS's per-child acceptance h by (depth, rank, confidence), and the search's
    calibrated log-reach table built from them (`refresh` after each step's observations)."""

    def __init__(self, ranks: int = 16):
        self.edges = torch.tensor(CONFIDENCE_EDGES)
        self.total = torch.zeros(DEPTHS, ranks, len(CONFIDENCE_EDGES) + 1, dtype=torch.float64)
        self.count = torch.zeros_like(self.total)
        self.observations: list[tuple[int, int, float, float]] = []  # since the last refresh
        self._rebuild()

    @property
    def ranks(self) -> int:
        return self.total.shape[1]

    def accept_probability(self) -> torch.Tensor:
        """(DEPTHS, ranks, buckets): the estimate of h per cell."""
        total, count = self.total, self.count
        prior, by_rank = shrunk_mean(total.sum(), count.sum(), FIRST_GUESS), []
        for rank_total, rank_count in zip(total.sum((0, 2)), count.sum((0, 2))):  # a rank seen rarely leans on the one before
            prior = shrunk_mean(rank_total, rank_count, prior)
            by_rank.append(prior)
        rank = torch.stack(by_rank)[:, None]
        rank_confidence = shrunk_mean(total.sum(0), count.sum(0), rank)[None]
        return shrunk_mean(total, count, rank_confidence).clamp(1e-4, 1 - 1e-4)

    def _rebuild(self) -> None:
        self.log_reach = self._log_reach()  # (DEPTHS, ranks, buckets) float32, falling with rank
        self._on_device: torch.Tensor | None = None  # its copy where the search runs

    def _log_reach(self) -> torch.Tensor:
        h = self.accept_probability()
        rejected = torch.cat([torch.zeros_like(h[:, :1]), (-h[:, :-1]).log1p()], 1)  # log(1 - h) of the ranks before
        log_reach = (rejected.cumsum(1) + h.log()).cummin(1).values
        return (log_reach - RANK_TIE_BREAK * torch.arange(h.shape[1], dtype=h.dtype)[:, None]).float()

    def child_log_reach(self, depths: torch.Tensor, confidence: torch.Tensor, width: int) -> torch.Tensor:
        """(n, width): log P(reach the node's k-th child | reach the node), for nodes whose children are at
        `depths` (n,) and whose draft distributions' largest probabilities are `confidence` (n,)."""
        if width > self.ranks:
            self._grow(width)
        if self._on_device is None or self._on_device.device != confidence.device:
            self._on_device = self.log_reach.to(confidence.device)
        table = self._on_device
        rows = (depths - 1).clamp(0, DEPTHS - 1)
        buckets = torch.bucketize(confidence.float(), self.edges.to(confidence.device))
        return table[rows[:, None], torch.arange(width, device=rows.device), buckets[:, None]]

    def observer(self, proposal: Proposal) -> Callable[[int, int, float], None]:
        """observe(node, rank, h) for an acceptance rule walking `proposal`'s tree: RRS considered the node's
        child of that rank (0 = first drawn) and would accept it with probability h."""
        depth, probs = proposal.tree.depth, proposal.child_probs

        def observe(node: int, rank: int, accept: float) -> None:
            self.observations.append((int(depth[node]) + 1, rank, float(probs[node].max()), accept))

        return observe

    def refresh(self) -> None:
        """Fold the observations since the last refresh into the estimates and rebuild the log-reach table."""
        if not self.observations:
            return
        depth, rank, confidence, accept = zip(*self.observations)
        self.observations = []
        if max(rank) >= self.ranks:
            self._grow(max(rank) + 1)
        index = ((torch.tensor(depth) - 1).clamp(0, DEPTHS - 1), torch.tensor(rank),
                 torch.bucketize(torch.tensor(confidence, dtype=torch.float32), self.edges))
        self.total.index_put_(index, torch.tensor(accept, dtype=torch.float64), accumulate=True)
        self.count.index_put_(index, torch.ones(len(accept), dtype=torch.float64), accumulate=True)
        self._rebuild()

    def _grow(self, ranks: int) -> None:
        pad = (0, 0, 0, ranks - self.ranks)
        self.total = torch.nn.functional.pad(self.total, pad)
        self.count = torch.nn.functional.pad(self.count, pad)
        self._rebuild()


# How sampled (rrs) trees rank their nodes (`eval.rrs_priority`, WEAVER_RRS_PRIORITY): a new run's priority object.
RRS_PRIORITIES: dict[str, Callable[[], AcceptanceTable | None]] = {"draft": lambda: None, "acceptance": AcceptanceTable}
