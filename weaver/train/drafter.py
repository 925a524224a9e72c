"""`drafter` stage: distil a DFlash-style block drafter from the frozen target on its own rollouts.

Each training sequence (prompt + target response) gets `anchors_per_seq` random anchors a in the
response. All its blocks run in one drafter pass: block i's queries see the context features of
positions < a_i and the keys of block i only (block-structured mask). Labels are the target's tokens at
a + d; position d is weighted exp(-(d - 1) / gamma). With `kl_weight` > 0 the loss mixes in the KL
divergence to the target's own next-token distribution. With `draft_vocab: n` the drafter drafts from the
n most frequent tokens of the rollouts' responses and the offline corpora `draft_vocab_corpus` (equal
mixture of their frequencies): its loss is over them (labels outside are left out of the loss, the KL's
teacher is the target's distribution renormalised over them), its accuracy over all. With `text.sources`
the drafter also trains on text the target has read (`weaver.data.text`): its tokens are not the target's,
so there the loss is the KL alone and the accuracy is not counted. With `train.init: <a DFlash-format drafter>`
(ours or z-lab's) training fine-tunes that drafter: its weights, rotary base and draft vocabulary are kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase, Qwen3Config

from weaver.data.corpus import collect_documents
from weaver.data.states import ConcatStates, StoredStates, right_pad
from weaver.errors import WeaverError
from weaver.models.checkpoint import check_tokenizer, load_hf_config, resolve_checkpoint, tokenizer_fingerprint
from weaver.models.drafter import Drafter, DrafterConfig
from weaver.models.config import TargetConfig
from weaver.models.drafter_checkpoint import (DEFAULT_ROPE_THETA, drafter_config, load_drafter, new_drafter_config,
                                              save_drafter)
from weaver.models.layers import init_weights
from weaver.models.target import TargetModel
from weaver.train.common import fit, heldout_metrics, make_accelerator, split_heldout, write_artifact


def pad_sequences(rows: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids (N, L), lengths (N,), prompt lengths (N,)) of prompt + response, right-padded."""
    seqs = [r["prompt_ids"] + r["response_ids"] for r in rows]
    lengths = torch.tensor([len(s) for s in seqs])
    return right_pad(seqs, pad_id), lengths, torch.tensor([len(r["prompt_ids"]) for r in rows])


def sample_anchors(lengths: torch.Tensor, prompt_lengths: torch.Tensor, per_seq: int, generator: torch.Generator) -> torch.Tensor:
    """(N, per_seq) anchor positions in each response, the last token excluded (it has nothing to predict)."""
    low = prompt_lengths.clamp(min=1)
    span = (lengths - 1 - low).clamp(min=1)
    u = torch.rand(len(lengths), per_seq, generator=generator)
    return low[:, None] + (u * span[:, None]).long()


def anchored_batches(pad_id: int, anchors_per_seq: int, seed: int, stored: StoredStates | None = None) -> Callable[[list[dict]], tuple]:
    """Collate rollout rows into (ids, lengths, anchors, states): states are the target's stored states
    of the rows (`states` stage) or None (computed in the step). Anchors depend on the batch's rows only,
    so a resumed run draws the same ones."""

    def collate(batch: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids, lengths, prompt_lengths = pad_sequences(batch, pad_id)
        indices = [r["prompt_index"] for r in batch]
        generator = torch.Generator().manual_seed(hash(tuple(indices)) % 2**62 + seed)
        states = None if stored is None else stored.batch(indices, ids.shape[1])
        return ids, lengths, sample_anchors(lengths, prompt_lengths, anchors_per_seq, generator), states

    return collate


def taps_and_hidden(target: TargetModel, ids: torch.Tensor, tap_layers: tuple[int, ...],
                    states: torch.Tensor | None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The target's tapped states and final-norm states (N, L, H) over ids: stored ones, or computed now."""
    if states is None:
        with torch.no_grad():  # not inference_mode: the drafter's backward saves the taps as inputs
            out = target(ids, tap_layers=tap_layers, logits_to_keep=0)
        return out.taps, out.hidden
    states = states.to(target.embed.weight)
    return list(states[:, :, :-1].unbind(2)), states[:, :, -1]


def block_mask(anchors: torch.Tensor, block: int, context_len: int) -> torch.Tensor:
    """(N, 1, m*B, C + m*B) bool: block i sees context positions < a_i and its own block's keys."""
    N, m = anchors.shape
    ctx = torch.arange(context_len, device=anchors.device)
    sees_ctx = (ctx[None, None, :] < anchors[:, :, None]).repeat_interleave(block, dim=1)  # (N, m*B, C)
    block_id = torch.arange(m * block, device=anchors.device) // block
    sees_block = (block_id[:, None] == block_id[None, :]).expand(N, -1, -1)
    return torch.cat([sees_ctx, sees_block], dim=-1)[:, None]


def draft_blocks(drafter: Drafter, target: TargetModel, ids: torch.Tensor, anchors: torch.Tensor,
                 taps: list[torch.Tensor]) -> torch.Tensor:
    """Drafter states (N, m, B-1, H) of the blocks at `anchors` (N, m), all in one pass; position d
    predicts the token at anchor + d. taps: the target's tapped states over ids."""
    N, L = ids.shape
    B = drafter.cfg.block_size
    context = drafter.context(taps)
    positions = (anchors[:, :, None] + torch.arange(B, device=ids.device)).flatten(1)  # (N, m*B)
    embeds = drafter.block_inputs(target, ids.gather(1, anchors).flatten()).view(N, -1, context.shape[-1])
    hidden = drafter(embeds, positions, context, torch.arange(L, device=ids.device).expand(N, L),
                     block_mask(anchors, B, L))
    return hidden.view(N, anchors.shape[1], B, -1)[:, :, 1:]


def distillation_loss(
    drafter: Drafter, target: TargetModel, ids: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
    gamma: float, kl_weight: float, states: torch.Tensor | None = None, read: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted CE on the target's tokens mixed with KL to its distribution (`kl_weight`); rows flagged in
    `read` (N,) bool are text the target read, not wrote: KL only there."""
    N, L = ids.shape
    read = torch.zeros(N, dtype=torch.bool, device=ids.device) if read is None else read.to(ids.device)
    B = drafter.cfg.block_size
    taps, hidden = taps_and_hidden(target, ids, drafter.cfg.target_layer_ids, states)
    logits = drafter.vocab_logits(target, draft_blocks(drafter, target, ids, anchors, taps)).float()
    offsets = torch.arange(B, device=ids.device)
    label_pos = (anchors[:, :, None] + offsets[1:]).clamp(max=L - 1)
    labels = ids[:, None, :].expand(-1, anchors.shape[1], -1).gather(2, label_pos)
    valid = (anchors[:, :, None] + offsets[1:]) < lengths[:, None, None]
    vocab = drafter.draft_vocab
    in_vocab = labels if vocab is None else draft_index(vocab, target.cfg.vocab_size)[labels]  # -1: outside
    depth_weight = torch.exp(-(offsets[1:] - 1).float() / gamma)
    kl_share = torch.where(read, 1.0, kl_weight)[:, None, None]  # (N, 1, 1)
    # a read text's tokens weigh in the KL only: labels outside the draft vocabulary do not matter there
    weight = depth_weight * (valid & ((in_vocab >= 0) | read[:, None, None]))
    ce = F.cross_entropy(logits.flatten(0, 2), in_vocab.clamp(min=0).flatten(), reduction="none").view_as(weight)
    loss = (ce * weight * (1 - kl_share)).sum()
    if kl_weight or read.any():
        with torch.no_grad():  # the target at p predicts p + 1: the label at a + d
            at_labels = hidden[torch.arange(N)[:, None, None], label_pos - 1]
            teacher = drafter.vocab_logits(target, at_labels).float().log_softmax(-1)
        kl = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="none").sum(-1)
        loss = loss + (kl * weight * kl_share).sum()
    loss = loss / weight.sum().clamp(min=1e-6)
    predicted = logits.argmax(-1) if vocab is None else vocab[logits.argmax(-1)]
    counted = valid & ~read[:, None, None]  # a read text's tokens are not the target's choices
    correct = (predicted == labels) & counted
    accuracy = correct.float().sum(0).sum(0) / counted.float().sum(0).sum(0).clamp(min=1)
    # greedy chain acceptance: 1 + the leading correct positions of each written block (what a chain's τ averages)
    written = counted[:, :, 0]
    chain = 1 + correct.long().cumprod(-1).sum(-1)
    tau_chain = (chain * written).sum() / written.sum().clamp(min=1)
    return loss, {"acc_d1": accuracy[0].item(), f"acc_d{B - 1}": accuracy[-1].item(), "tau_chain": tau_chain.item()}


def draft_index(draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) the position of each target token in the draft vocabulary, -1 for tokens outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_vocab.device)
    index[draft_vocab] = torch.arange(len(draft_vocab), device=draft_vocab.device)
    return index


def token_counts(sequences: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    """(vocab_size,) how often each token id occurs in the sequences (ids past the vocabulary dropped)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in sequences:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def corpus_token_counts(sources: Sequence[str], tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                        batch: int = 256) -> torch.Tensor:
    """Token counts of the offline corpora `sources` (`weaver.data.corpus`) under the target's tokenizer."""
    docs = collect_documents(sources)
    texts = (tokenizer([d["text"] for d in docs[i : i + batch]])["input_ids"] for i in range(0, len(docs), batch))
    return token_counts(itertools.chain.from_iterable(texts), vocab_size)


def frequent_tokens(counts: list[torch.Tensor], n: int) -> torch.Tensor:
    """The n most frequent tokens under the equal mixture of the count vectors' frequencies, ascending by id
    (ties: the lower id first). A few hundred rollouts see a few thousand distinct tokens; a general corpus
    beside them covers the rest of what an evaluation prompt asks for (docs/results.md: reading text)."""
    score = sum(c.double() / c.sum().clamp(min=1) for c in counts)
    order = torch.argsort(-score, stable=True)  # stable: equal scores keep ascending ids
    return order[:n].sort().values


def with_read_text(rows: datasets.Dataset, stored: StoredStates | None, text_dir: Path,
                   tap_layers: tuple[int, ...]) -> tuple[datasets.Dataset, ConcatStates]:
    """The rollouts (all or some of those `stored` holds) followed by the text the target read (`text` stage),
    indexed on from the last stored rollout, and their stored states read as one."""
    if stored is None:
        raise WeaverError("drafter.text needs stored rollout states (rollouts.store_states: true): read text is "
                          "only ever trained on from its stored states")
    # in memory: reading an artifact never writes cache files into it
    text = datasets.load_from_disk(str(text_dir / "dataset")).cast(rows.features, keep_in_memory=True)
    text = text.map(lambda r: {"prompt_index": r["prompt_index"] + len(stored)}, keep_in_memory=True)
    return datasets.concatenate_datasets([rows, text]), ConcatStates([stored, StoredStates(text_dir / "states", tap_layers)])


def flag_read_text(collate: Callable[[list[dict]], tuple], n_rollouts: int) -> Callable[[list[dict]], tuple]:
    """`collate` with one more output, (N,) bool: which rows are read text (`with_read_text` numbers them on
    from the n_rollouts stored rollouts)."""

    def collate_with_source(batch: list[dict]) -> tuple:
        return (*collate(batch), torch.tensor([r["prompt_index"] >= n_rollouts for r in batch]))

    return collate_with_source


DRAFTER_INITS = ("random", "target")  # anything else names a drafter checkpoint to fine-tune


def init_checkpoint(init: str) -> Path:
    """The folder `drafter.train.init` names when it is neither random nor target."""
    try:
        return resolve_checkpoint(init)
    except WeaverError as err:
        raise WeaverError(f"drafter.train.init must be random, target or a DFlash-format drafter checkpoint: {err}") from None


def architecture(cfg: DrafterConfig) -> dict:
    """What a fine-tuned drafter must share with the one the config describes (its rotary base and norm epsilon
    may differ: they come with its weights)."""
    b = cfg.body
    return {"num_layers": b.num_layers, "block_size": cfg.block_size, "taps": list(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id, "intermediate_size": b.intermediate_size,
            "heads, kv heads, head dim": [b.num_heads, b.num_kv_heads, b.head_dim], "draft_vocab": cfg.draft_vocab_size}


def start_from_checkpoint(source: str, configured: Qwen3Config, target: TargetModel,
                          tokenizer: PreTrainedTokenizerBase) -> tuple[Drafter, Qwen3Config]:
    """`drafter.train.init: <checkpoint>`: the drafter there (checked against the target and its tokenizer) and
    its config, refused unless it is the drafter `configured` describes, so the config's settings (and the
    stored states' taps) say what was trained."""
    folder = init_checkpoint(source)
    hf_config = load_hf_config(folder)
    given, wanted = architecture(drafter_config(hf_config)), architecture(drafter_config(configured))
    differ = [f"{k} {given[k]} (the config: {wanted[k]})" for k in wanted if given[k] != wanted[k]]
    if differ:
        raise WeaverError(f"drafter.train.init={source} is not the drafter the config describes: it has "
                          f"{'; '.join(differ)}; set drafter.* to match it")
    drafter = load_drafter(str(folder), target, tokenizer=tokenizer)
    hf_config.tokenizer_sha256 = configured.tokenizer_sha256  # a z-lab drafter now records the tokenizer it learnt
    return drafter, hf_config


def rope_theta(cfg: TargetConfig) -> float:
    """The base of the target's rotary frequencies, read back from them (inv_freq[i] = theta^(-2i/dim)): a
    drafter started from the target's layers rotates its queries and keys as they did (exact for default
    RoPE over the whole head; for scaled or partial RoPE the nearest plain base)."""
    return float(f"{cfg.inv_freq[1].double() ** (-len(cfg.inv_freq)):.6g}")  # 10000, not 10000.0005


def init_from_target(drafter: Drafter, target: TargetModel) -> tuple[int, ...]:
    """Start the drafter's layers as copies of the target's last attention layers (norms, q/k/v/o, MLP; an
    output gate is dropped; q/k norms, which DFlash layers have and a Llama's lack, start at one) and its
    context projection as the deepest tap passed through, the input those layers saw in the target: a drafter
    trained on a CPU's few rollouts starts from the target's features instead of noise. Returns the target
    layers copied."""
    t, body = target.cfg, drafter.cfg.body
    n = len(drafter.layers)
    attention = [i for i, kind in enumerate(t.layer_types) if kind == "full_attention"][-n:]
    shape, target_shape = ((c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) for c in (body, t))
    if len(attention) < n or shape != target_shape:
        raise WeaverError(
            f"drafter.train.init=target copies {n} of the target's attention layers and needs their shape (heads, kv "
            f"heads, head dim, MLP width) {target_shape}: the target has {len(attention)} attention layers, the "
            f"drafter's shape is {shape}")
    H, Hkv, D = t.num_heads, t.num_kv_heads, t.head_dim

    with torch.no_grad():
        for layer, source in zip(drafter.layers, (target.layers[i] for i in attention)):
            attn = source.mixer
            q, kv = attn.qkv.weight.split([attn.q_width, 2 * Hkv * D])
            if t.attn_output_gate:  # per head [query | gate]: keep the query
                q = q.view(H, 2 * D, -1)[:, :D].reshape(H * D, -1)
            layer.attn.q.weight.copy_(q)
            layer.attn.kv.weight.copy_(kv)
            layer.attn.o.weight.copy_(attn.o.weight)
            if t.attention_bias:
                q_bias, kv_bias = attn.qkv.bias.split([attn.q_width, 2 * Hkv * D])
                layer.attn.q.bias.copy_(q_bias.view(H, -1)[:, :D].flatten())
                layer.attn.kv.bias.copy_(kv_bias)
                layer.attn.o.bias.copy_(attn.o.bias)
            for name in ("q_norm", "k_norm"):
                getattr(layer.attn, name).weight.copy_(getattr(attn, name).scale if t.qk_norm else 1.0)
            layer.input_norm.weight.copy_(source.input_norm.scale)
            layer.post_norm.weight.copy_(source.post_norm.scale)
            layer.mlp.load_state_dict(source.mlp.state_dict())
        taps = drafter.cfg.target_layer_ids
        deepest = taps.index(max(taps))
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, deepest * t.hidden_size : (deepest + 1) * t.hidden_size].copy_(torch.eye(t.hidden_size))
        drafter.hidden_norm.weight.copy_(target.layers[attention[0]].input_norm.scale)
    return tuple(attention)


def new_drafter(hf_config: Qwen3Config, d: DictConfig, target: TargetModel, tokenizer: PreTrainedTokenizerBase,
                rows: datasets.Dataset, from_target: bool, init_std: float) -> Drafter:
    """A fresh drafter: random weights (its layers copied from the target's with `from_target`), the target's
    final norm, and the draft vocabulary counted on the rollouts' responses and `d.draft_vocab_corpus`."""
    drafter = Drafter(drafter_config(hf_config))
    init_weights(drafter, init_std)
    if from_target:
        init_from_target(drafter, target)
    if drafter.draft_vocab is not None:
        V = target.cfg.vocab_size
        counts = [token_counts(rows["response_ids"], V)]
        if d.draft_vocab_corpus:
            counts.append(corpus_token_counts(d.draft_vocab_corpus, tokenizer, V))
        drafter.draft_vocab.copy_(frequent_tokens(counts, d.draft_vocab))
    with torch.no_grad():  # start from the target's own output scale (docs/method.md: the target's final norm)
        drafter.norm.weight.copy_(target.norm.scale)
    return drafter


def train_drafter(cfg: DictConfig, target: TargetModel, tokenizer: PreTrainedTokenizerBase, rollouts_dir: Path,
                  out_dir: Path, work_dir: Path, states_dir: Path | None = None, text_dir: Path | None = None) -> dict:
    """Train the drafter described by cfg.drafter on the rollouts (and the text the target read, `text_dir`);
    write a DFlash-format checkpoint."""
    d, train = cfg.drafter, cfg.drafter.train
    check_tokenizer(tokenizer, target.cfg.vocab_size, "the target's tokenizer")
    mask_id = tokenizer.convert_tokens_to_ids(d.mask_token)
    if mask_id is None or mask_id == tokenizer.unk_token_id:
        raise WeaverError(f"mask token '{d.mask_token}' is not in the target's vocabulary")
    if not isinstance(train.init, str) or not train.init:
        raise WeaverError(f"drafter.train.init must be random, target or a drafter checkpoint, got {train.init!r}")
    from_target = train.init == "target"
    # the tokenizer's fingerprint goes into config.json: loading checks it against the target's tokenizer
    hf_config = new_drafter_config(target, d.num_layers, d.block_size, mask_id, d.num_taps,
                                   intermediate_size=d.intermediate_size,
                                   rope_theta=rope_theta(target.cfg) if from_target else DEFAULT_ROPE_THETA,
                                   tokenizer_sha256=tokenizer_fingerprint(tokenizer), draft_vocab_size=d.draft_vocab)
    rows = datasets.load_from_disk(str(rollouts_dir / "dataset"))
    torch.manual_seed(cfg.seed)
    if train.init in DRAFTER_INITS:
        drafter = new_drafter(hf_config, d, target, tokenizer, rows, from_target, train.init_std)
    else:
        drafter, hf_config = start_from_checkpoint(train.init, hf_config, target, tokenizer)
    target.requires_grad_(False)
    accelerator = make_accelerator(cfg, f"{cfg.experiment}-drafter", train.precision)
    target.to(accelerator.device)
    stored = None if states_dir is None else StoredStates(states_dir, drafter.cfg.target_layer_ids)
    n_rollouts = len(rows)
    rows, heldout = split_heldout(rows, train.heldout_rollouts, "drafter.train.heldout_rollouts")
    n_trained = len(rows)
    if text_dir is not None:
        rows, stored = with_read_text(rows, stored, text_dir, drafter.cfg.target_layer_ids)
    collate_with_source = flag_read_text(anchored_batches(tokenizer.pad_token_id or 0, train.anchors_per_seq, cfg.seed,
                                                          stored), n_rollouts)

    def loss_fn(model, batch):
        ids, lengths, anchors, states, read = batch
        return distillation_loss(model, target, ids, lengths, anchors, train.gamma, train.kl_weight, states, read)

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=train.lr, betas=(0.9, 0.95), weight_decay=train.weight_decay)
    n_params = sum(p.numel() for p in drafter.parameters())
    read = f" + {len(rows) - n_trained} read texts" if len(rows) > n_trained else ""
    held = "" if heldout is None else f" ({len(heldout)} more held out)"
    accelerator.print(f"drafter: {n_params / 1e6:.2f}M parameters, {n_trained} rollouts{held}{read}, "
                      f"taps {drafter.cfg.target_layer_ids}")
    evaluate = None if heldout is None else heldout_metrics(heldout, collate_with_source, loss_fn, train.batch_size,
                                                            accelerator.device)
    metrics = fit(accelerator, drafter, optimizer, rows, collate_with_source, loss_fn, train, work_dir, cfg.seed,
                  evaluate=evaluate, desc="drafter")
    drafter = drafter.float().cpu().eval()
    summary = {"params": n_params, **metrics}
    write_artifact(accelerator, lambda out: save_drafter(drafter, hf_config, out), out_dir, summary,
                   f"drafter: final loss {metrics['loss']:.3f}, top-1 acc at d=1 {metrics['acc_d1']:.2f}")
    return summary
