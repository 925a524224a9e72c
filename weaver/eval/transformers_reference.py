"""The reference every greedy method must reproduce token for token: transformers' own `generate` on the
same weights (eval.check_transformers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from weaver.artifacts import target_folder
from weaver.generate import until_eos

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.inference_mode()
def transformers_greedy(model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int,
                        eos: int | None) -> list[list[int]]:
    """transformers' own greedy decoding of each prompt (batch 1, no padding): the reference every greedy
    method must reproduce token for token."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos or 0)
    outputs = []
    for prompt in tqdm(prompts, desc="transformers", leave=False):
        ids = torch.tensor([prompt], device=device)
        new = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):]
        outputs.append(until_eos(new.tolist(), eos))
    return outputs


def load_transformers_target(cfg: DictConfig, dtype: torch.dtype, device: torch.device | str) -> PreTrainedModel:
    """The experiment's target as transformers' own model class, in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(target_folder(cfg), dtype=dtype, use_safetensors=True)
    model = model.to(device).eval()
    model.generation_config = GenerationConfig()  # plain greedy: no repetition penalty etc. from the checkpoint
    return model
