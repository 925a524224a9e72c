"""`target` stage: pretrain a tiny Qwen3.5-style hybrid target from scratch on the offline corpus.

The result is a transformers checkpoint (config.json + model.safetensors + tokenizer), so both our
loader and `AutoModelForCausalLM` read it.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase, Qwen3_5TextConfig

from weaver.errors import WeaverError
from weaver.generate import generate
from weaver.models.checkpoint import save_hf_checkpoint
from weaver.models.config import from_hf
from weaver.models.layers import init_weights
from weaver.models.target import TargetModel
from weaver.train.common import fit, make_accelerator, write_artifact


def scratch_hf_config(model_cfg: DictConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    kwargs = OmegaConf.to_container(model_cfg.hf_config, resolve=True)
    try:
        return Qwen3_5TextConfig(
            **kwargs, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    except Exception as err:  # transformers validates fields strictly, with its own error types
        raise WeaverError(f"invalid model.hf_config: {' '.join(str(err).split())}") from None


def next_token_loss(model: TargetModel, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()), {}


@torch.no_grad()
def validation_loss(model: TargetModel, rows: datasets.Dataset, batch_size: int = 8) -> float:
    total, count = 0.0, 0
    device = model.embed.weight.device
    for start in range(0, len(rows), batch_size):
        batch = torch.as_tensor(rows[start : start + batch_size]["input_ids"], dtype=torch.long, device=device)
        loss, _ = next_token_loss(model, batch)
        total, count = total + loss.item() * len(batch), count + len(batch)
    return total / max(count, 1)


def train_target(cfg: DictConfig, corpus_dir: Path, out_dir: Path, work_dir: Path) -> dict:
    """Pretrain the scratch target described by cfg.model on corpus_dir; write an HF checkpoint to out_dir."""
    train = cfg.model.train
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(corpus_dir / "tokenizer")
    hf_config = scratch_hf_config(cfg.model, tokenizer)
    model = TargetModel(from_hf(hf_config))
    init_weights(model, train.init_std)
    splits = datasets.load_from_disk(str(corpus_dir / "dataset")).with_format("torch")
    val_rows = splits["validation"].select(range(min(64, len(splits["validation"]))))
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train.lr, betas=(0.9, 0.95),
    )
    accelerator = make_accelerator(cfg, f"{cfg.experiment}-target", train.precision)
    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(f"target: {n_params / 1e6:.2f}M parameters, {len(splits['train'])} training rows")
    metrics = fit(
        accelerator, model, optimizer, splits["train"],
        collate=lambda rows: torch.stack([r["input_ids"] for r in rows]).long(),
        loss_fn=next_token_loss, train=train, work_dir=work_dir, seed=cfg.seed,
        evaluate=lambda m: {"val_loss": validation_loss(m, val_rows)}, desc="target",
    )
    model = model.float().cpu().eval()
    metrics["val_loss"] = validation_loss(model, val_rows)
    sample = greedy_sample(model, tokenizer)
    summary = {"params": n_params, **metrics, "sample_prompt": SAMPLE_PROMPT, "sample": sample}
    write_artifact(accelerator, lambda out: save_hf_checkpoint(model, hf_config, out, tokenizer), out_dir, summary,
                   f"target: final train loss {metrics['loss']:.3f}, val loss {metrics['val_loss']:.3f}\n"
                   f"greedy sample:\n{SAMPLE_PROMPT}{sample}")
    return summary


SAMPLE_PROMPT = "def read_config(path):\n"


def greedy_sample(model: TargetModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int = 64) -> str:
    prompt = tokenizer(SAMPLE_PROMPT)["input_ids"]
    new = generate(model, [prompt], max_new_tokens, eos_token_id=tokenizer.eos_token_id)[0]
    return tokenizer.decode(new)
