"""`weaver` stage: train the Weaver adapter on target rollouts, drafter and target frozen (docs/method.md §2.3).

For random anchors a in each rollout, one target pass gives the prefix's slot 0 (its final-norm state at
a - 1) and its conditionals; one drafter pass gives the blocks' states and marginals. The adapter then
runs teacher-forced along the target's own continuation x[a], x[a+1], ... (a chain of D nodes per
anchor), and the node at depth k is trained on the candidates for depth k + 1, the drafter's top-M pool
at block position k + 1: its distribution over the pool should match the target's conditional
p(. | x[<= a+k]) restricted to the pool. The loss mixes KL, total variation (what acceptance pays for)
and, optionally, cross-entropy on the realised token. Pool coverage (how often the target's token is in
the pool) bounds what any re-scoring of the pool can accept.

With `weaver.train.read_text` the adapter also trains on the text the target read for the drafter (`text`
stage): many more paths than the rollouts give it. Their tokens are not the target's choices, so there the
cross-entropy's label is the target's own greedy token at each node (its argmax), not the text's next token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import torch
from omegaconf import DictConfig

from weaver.data.states import StoredStates
from weaver.errors import WeaverError
from weaver.models.adapter import AdapterConfig, WeaverAdapter, draft_pools, save_adapter
from weaver.models.checkpoint import check_tokenizer, check_tokenizer_fingerprint, tokenizer_fingerprint
from weaver.models.drafter import Drafter
from weaver.models.layers import init_weights
from weaver.models.target import TargetModel
from weaver.train.common import fit, heldout_batches, heldout_metrics, make_accelerator, split_heldout, write_artifact
from weaver.train.drafter import anchored_batches, draft_blocks, flag_read_text, taps_and_hidden, with_read_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def pool_losses(log_q: torch.Tensor, log_p: torch.Tensor, pool_tokens: torch.Tensor,
                labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-node KL(p_pool || q), TV(p_pool, q), CE on the label (0 when outside the pool), whether the
    label is in the pool, and `accept` = sum_x min(p(x), q(x)): the probability that rejection sampling
    accepts one draft token drawn from q, where p is the target's whole distribution (its mass outside the
    pool is never accepted); p_pool is p restricted to the pool and renormalised.

    log_q (..., M) adapter log-probs over the pool; log_p (..., M) the target's log-probs (normalised over the
    whole vocabulary) of the pool's tokens; pool_tokens (..., M); labels (...)."""
    log_p_pool = log_p - log_p.logsumexp(-1, keepdim=True)
    p_pool, q = log_p_pool.exp(), log_q.exp()
    in_pool = pool_tokens == labels[..., None]
    return {
        "kl": (p_pool * (log_p_pool - log_q)).sum(-1),
        "tv": 0.5 * (p_pool - q).abs().sum(-1),
        "ce": -(log_q * in_pool).sum(-1),
        "covered": in_pool.any(-1).float(),
        "pool_mass": log_p.exp().sum(-1),
        "accept": torch.minimum(log_p.exp(), q).sum(-1),
    }


def expected_chain_length(accept: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per anchor, 1 + sum_d prod_{k<=d} accept[k]: the expected committed tokens of one verify step of a
    one-child-per-depth tree under rejection sampling, when the accepted tokens follow the rollout (exact
    in expectation for rollouts sampled from the target at the same temperature). Depths past the rollout's
    end count as rejected. accept, valid (A, D) -> (A,)."""
    return 1 + (accept * valid).cumprod(-1).sum(-1)


@dataclass
class Chains:
    """The adapter's teacher-forced chains from a batch's anchors, scored over the drafter's pools: all that the
    loss and the metrics read (A anchors, D depths, M pool tokens). The target's distribution is kept only on the
    pool (log_p), not over its vocabulary, so that held-out chains can be kept and re-scored cheaply."""
    scores: torch.Tensor       # (A, D, M) the adapter's logits over the pool
    prior: torch.Tensor        # (A, D, M) the drafter's logits over the pool
    log_p: torch.Tensor        # (A, D, M) the target's log-probs of the pool's tokens
    pool_tokens: torch.Tensor  # (A, D, M)
    labels: torch.Tensor       # (A, D) the token each node is trained towards
    valid: torch.Tensor        # (A, D) 1 where the label lies inside the rollout

    def rescaled(self, scale: float) -> torch.Tensor:
        """The scores with the adapter's correction to the drafter's logits multiplied by `scale`."""
        return self.scores if scale == 1.0 else self.prior + scale * (self.scores - self.prior)


def score_chains(
    adapter: WeaverAdapter, drafter: Drafter, target: TargetModel, ids: torch.Tensor, lengths: torch.Tensor,
    anchors: torch.Tensor, states: torch.Tensor | None = None, read: torch.Tensor | None = None,
) -> Chains:
    """Run the adapter teacher-forced along the rollouts from `anchors`; rows flagged in `read` (N,) bool are
    read text, labelled with the target's greedy tokens."""
    N, L = ids.shape
    D = adapter.cfg.max_depth
    taps, hidden = taps_and_hidden(target, ids, drafter.cfg.target_layer_ids, states)
    with torch.no_grad():
        draft_hidden = draft_blocks(drafter, target, ids, anchors, taps)[:, :, :D].flatten(0, 1)  # (A, D, H)
        pool_logits, pool_tokens = draft_pools(drafter.logits(target, draft_hidden).float(), adapter.cfg.pool_size)
    rows = torch.arange(N, device=ids.device).repeat_interleave(anchors.shape[1])[:, None]  # (A, 1)
    a = anchors.flatten()[:, None]
    at = (a + torch.arange(D + 1, device=ids.device)).clamp(max=L - 1)  # x[a .. a+D]
    nodes, labels = ids[rows, at[:, :-1]], ids[rows, at[:, 1:]]  # node k holds x[a+k], its label is x[a+k+1]
    valid = ((a + torch.arange(1, D + 1, device=ids.device)) < lengths[rows]).float()
    cache = adapter.start(adapter.prefix(hidden[rows[:, 0], a[:, 0] - 1], draft_hidden), capacity=D)
    causal = torch.ones(D, D, dtype=torch.bool, device=ids.device).tril()[None]
    node_states = adapter(adapter.node_inputs(target, nodes), torch.arange(D, device=ids.device), cache, causal)
    scores = adapter.pool_scores(node_states, pool_logits, adapter.pool_candidates(target, pool_tokens))
    with torch.no_grad():
        teacher = target.lm_head(hidden[rows, at[:, :-1]]).float()  # the target's logits at the chain's nodes
        if read is not None and read.any():  # the argmax over the vocabulary only where a batch holds read text
            labels = torch.where(read.to(ids.device)[rows], teacher.argmax(-1), labels)
        log_p = teacher.log_softmax(-1).gather(-1, pool_tokens)
    return Chains(scores, pool_logits, log_p, pool_tokens, labels, valid)


def chain_loss(chains: Chains, mix: DictConfig, scale: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss mix of the chains and their metrics; `scale` multiplies the adapter's correction to the
    drafter's logits (`calibrate_correction`)."""
    scores, valid, labels = chains.rescaled(scale), chains.valid, chains.labels
    terms = pool_losses(scores.log_softmax(-1), chains.log_p, chains.pool_tokens, labels)
    prior = pool_losses(chains.prior.log_softmax(-1), chains.log_p, chains.pool_tokens, labels)

    def mean(x: torch.Tensor, where: torch.Tensor = valid) -> torch.Tensor:
        return (x * where).sum() / where.sum().clamp(min=1)

    loss = mix.kl * mean(terms["kl"]) + mix.tv * mean(terms["tv"]) + mix.ce * mean(terms["ce"])
    top1 = chains.pool_tokens.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1) == labels
    return loss, {
        "tv": mean(terms["tv"]).item(), "tv_prior": mean(prior["tv"]).item(),
        "acc": mean(top1.float()).item(), "acc_prior": mean((chains.pool_tokens[..., 0] == labels).float()).item(),
        "coverage": mean(terms["covered"]).item(), "pool_mass": mean(terms["pool_mass"]).item(),
        # sampling (rejection sampling at temperature 1): depth-1 acceptance and a chain's expected length
        "accept_d1": mean(terms["accept"][:, 0], valid[:, 0]).item(),
        "accept_d1_prior": mean(prior["accept"][:, 0], valid[:, 0]).item(),
        "tau_rrs": expected_chain_length(terms["accept"], valid).mean().item(),
        "tau_rrs_prior": expected_chain_length(prior["accept"], valid).mean().item(),
    }


def adapter_loss(
    adapter: WeaverAdapter, drafter: Drafter, target: TargetModel, ids: torch.Tensor, lengths: torch.Tensor,
    anchors: torch.Tensor, mix: DictConfig, states: torch.Tensor | None = None, read: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss of the adapter's teacher-forced chains from `anchors`, and its metrics."""
    return chain_loss(score_chains(adapter, drafter, target, ids, lengths, anchors, states, read), mix)


CALIBRATION_SCALES = [i / 10 for i in range(21)]  # 0 (the drafter's prior alone) to 2


@torch.no_grad()
def calibrate_correction(adapter: WeaverAdapter, heldout_loss: Callable[[float], float]) -> tuple[float, dict[float, float]]:
    """Scale the adapter's correction <P lm_head[c], Q x> by the factor of CALIBRATION_SCALES with the lowest
    held-out loss, folded into Q; returns (that factor, the loss at each).

    Trained with cross-entropy on a few thousand greedy rollouts, the adapter is overconfident on text it has not
    seen (SmolLM2: paths it scores 0.7-0.9 are accepted half the time), and the best-first search, which ranks
    paths by those scores, then goes too deep; shrinking the correction towards the drafter's prior, which
    is calibrated, buys τ (docs/results.md: calibration). Temperature scaling (Guo et al., 2017) applied to the
    correction only: the prior's own confidence is kept."""
    losses = {scale: heldout_loss(scale) for scale in CALIBRATION_SCALES}
    best = min(losses, key=losses.get)
    adapter.query.weight.mul_(best)
    return best, losses


def optimizers(adapter: WeaverAdapter, train: DictConfig) -> list[torch.optim.Optimizer]:
    """Muon for the matrices, AdamW for norms (torch's own Muon, lr matched to AdamW's update RMS)."""
    matrices = [p for p in adapter.parameters() if p.dim() == 2]
    others = [p for p in adapter.parameters() if p.dim() != 2]
    muon = torch.optim.Muon(matrices, lr=train.lr, weight_decay=train.weight_decay, adjust_lr_fn="match_rms_adamw")
    return [muon, torch.optim.AdamW(others, lr=train.lr, betas=(0.9, 0.95), weight_decay=0.0)]


def adapter_config(w: DictConfig, target: TargetModel, drafter: Drafter) -> AdapterConfig:
    """The adapter that `cfg.weaver` (w) describes, sized for this target and drafter."""
    return AdapterConfig(target.cfg.hidden_size, target.cfg.vocab_size, drafter.cfg.block_size - 1, w.d_model,
                         w.num_layers, w.num_heads, w.intermediate_size, w.rank, w.pool_size)


def train_adapter(cfg: DictConfig, target: TargetModel, drafter: Drafter, tokenizer: PreTrainedTokenizerBase,
                  rollouts_dir: Path, out_dir: Path, work_dir: Path, states_dir: Path | None = None,
                  text_dir: Path | None = None) -> dict:
    """Train the adapter described by cfg.weaver on the rollouts (and, with weaver.train.read_text, the text the
    target read, `text_dir`); write config.json + model.safetensors."""
    w, train = cfg.weaver, cfg.weaver.train
    check_tokenizer(tokenizer, target.cfg.vocab_size, "the target's tokenizer")
    check_tokenizer_fingerprint("the drafter", getattr(drafter.cfg, "tokenizer_sha256", None), target, tokenizer)
    torch.manual_seed(cfg.seed)
    adapter = WeaverAdapter(adapter_config(w, target, drafter))
    init_weights(adapter, train.init_std)
    adapter.reset_scorer()
    target.requires_grad_(False)
    drafter.requires_grad_(False)
    rows = datasets.load_from_disk(str(rollouts_dir / "dataset"))
    n_rollouts = len(rows)
    rows, heldout = split_heldout(rows, train.heldout_rollouts, "weaver.train.heldout_rollouts")
    n_trained = len(rows)
    accelerator = make_accelerator(cfg, f"{cfg.experiment}-weaver", train.precision)
    target.to(accelerator.device)
    drafter.to(accelerator.device)
    stored = None if states_dir is None else StoredStates(states_dir, drafter.cfg.target_layer_ids)
    if train.read_text:
        if text_dir is None:
            raise WeaverError("weaver.train.read_text needs the text the target read for a drafter trained here "
                              "(drafter.text.sources set, drafter.path null)")
        rows, stored = with_read_text(rows, stored, text_dir, drafter.cfg.target_layer_ids)
    collate = flag_read_text(anchored_batches(tokenizer.pad_token_id or 0, train.anchors_per_seq, cfg.seed, stored),
                             n_rollouts)

    def loss_fn(model, batch):
        ids, lengths, anchors, states, read = batch
        return adapter_loss(model, drafter, target, ids, lengths, anchors, train.loss, states, read)

    n_params = sum(p.numel() for p in adapter.parameters())
    read = f" + {len(rows) - n_trained} read texts" if len(rows) > n_trained else ""
    accelerator.print(f"weaver adapter: {n_params / 1e6:.2f}M parameters, pool {w.pool_size}, {n_trained} rollouts{read}")
    if train.calibrate and heldout is None:
        raise WeaverError("weaver.train.calibrate fits the adapter on held-out rollouts: set weaver.train.heldout_rollouts > 0")
    evaluate = None if heldout is None else heldout_metrics(heldout, collate, loss_fn, train.batch_size, accelerator.device)
    metrics = fit(accelerator, adapter, optimizers(adapter, train), rows, collate, loss_fn, train, work_dir,
                  cfg.seed, evaluate=evaluate, desc="weaver")
    summary = {"params": n_params, **metrics}
    if train.calibrate:
        summary["calibration_scale"] = calibrate_heldout(adapter, drafter, target, heldout, collate, train, accelerator)
    adapter = adapter.float().cpu().eval()
    sha = tokenizer_fingerprint(tokenizer)  # saved with the adapter: loading checks it against the target's
    write_artifact(accelerator, lambda out: save_adapter(adapter, out, sha), out_dir, summary,
                   f"weaver: final loss {metrics['loss']:.3f}; TV to the target on the pool {metrics['tv']:.3f} "
                   f"(drafter prior {metrics['tv_prior']:.3f}); top-1 {metrics['acc']:.2f} "
                   f"(prior {metrics['acc_prior']:.2f}); pool coverage {metrics['coverage']:.2f}; sampling: "
                   f"expected chain length {metrics['tau_rrs']:.2f} (prior {metrics['tau_rrs_prior']:.2f})")
    return summary


def calibrate_heldout(adapter: WeaverAdapter, drafter: Drafter, target: TargetModel, heldout: datasets.Dataset,
                      collate: Callable, train: DictConfig, accelerator) -> float:
    """`calibrate_correction` on the held-out rollouts under the training loss; prints and returns the factor.
    The chains are scored once; each candidate factor only re-weighs their pool scores."""
    adapter.eval()
    with torch.no_grad():
        chains = [score_chains(adapter, drafter, target, *batch)
                  for batch in heldout_batches(heldout, collate, train.batch_size, accelerator.device)]

    def heldout_loss(scale: float) -> float:
        return sum(chain_loss(c, train.loss, scale)[0].item() for c in chains) / len(chains)

    scale, losses = calibrate_correction(adapter, heldout_loss)
    accelerator.print(f"weaver: correction scaled by {scale:.1f} (held-out loss {losses[scale]:.4f}, "
                      f"unscaled {losses[1.0]:.4f}, the drafter's prior alone {losses[0.0]:.4f})")
    return scale
