"""Weaver's drafting side inside SGLang's environment, as an SGLang worker will run it: the drafter loads from
the checkpoint weaver wrote, takes the target's embedding and lm_head as plain modules (what the worker
gets from SGLang's model), and reproduces the block logits and the DDTree computed in weaver's own
environment (tests/test_serving.py). It also shows that drafting never loads our tree-verification kernels
(SGLang's own attention serves an attention-only target)."""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from checkpoints import DRAFT_STEP, DRAFTER, TARGET, checkpoint
from weaver.builders import chain_tree, ddtree
from weaver.models.drafter_checkpoint import load_drafter

REPO = Path(__file__).resolve().parents[2]


class TargetHead(nn.Module):
    """The two pieces of the target a drafting step reads: its token embedding and its lm_head."""

    def __init__(self, folder):
        super().__init__()
        weights = load_file(str(folder / "model.safetensors"))
        self.embed = nn.Embedding.from_pretrained(weights["model.embed_tokens.weight"])
        self.lm_head = nn.Linear(self.embed.embedding_dim, self.embed.num_embeddings, bias=False)
        self.lm_head.weight = nn.Parameter(weights.get("lm_head.weight", self.embed.weight))


@torch.inference_mode()
def test_a_drafting_step_matches_weavers_own_environment():
    step = load_file(str(checkpoint(DRAFT_STEP)))
    drafter = load_drafter(str(checkpoint(DRAFTER)))
    target = TargetHead(checkpoint(TARGET))
    taps = list(step["taps"])
    context = taps[0].shape[1]
    cache = drafter.new_cache(1, context)
    drafter.extend_context(cache, taps, torch.arange(context)[None])
    logits = drafter.draft(target, cache, step["anchor"], torch.tensor([context])).logits[0]
    torch.testing.assert_close(logits, step["logits"], rtol=1e-5, atol=1e-5)
    tree = ddtree(int(step["anchor"]), logits, len(step["tree_tokens"]) - 1).tree  # budget: nodes besides the root
    assert torch.equal(tree.tokens, step["tree_tokens"]) and torch.equal(tree.parents, step["tree_parents"])
    chain = chain_tree(int(step["anchor"]), logits, 4).tree
    assert torch.equal(chain.tokens[1:], logits[:4].argmax(-1))
    ours = [name for name, module in sys.modules.items()
            if Path(getattr(module, "__file__", None) or "/").is_relative_to(REPO / "weaver" / "kernels")]
    assert not ours, f"drafting imported our weaver/kernels/: {ours}"
