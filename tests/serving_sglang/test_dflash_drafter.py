"""A drafter checkpoint weaver writes, read by SGLang's own DFLASH draft model (what
`--speculative-algorithm DFLASH --speculative-draft-model-path <drafter>` loads): SGLang parses our config
and loads every weight. SGLang skips weight names it does not know, leaving that parameter as initialised,
so every parameter is compared with our tensors."""

import socket

import pytest
import torch
from safetensors.torch import load_file
from sglang.srt import runtime_context
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
from sglang.srt.server_args import ServerArgs
from transformers import AutoConfig

from checkpoints import DRAFTER, TARGET, checkpoint


@pytest.fixture(scope="module")
def sglang_process():
    """What an SGLang worker process sets up before it builds a model: published server args, a (1-process,
    gloo) model-parallel group."""
    args = ServerArgs(model_path=str(checkpoint(TARGET)), device="cpu")
    args.resolve_once()
    runtime_context.publish(args, role="scheduler")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(backend="gloo")


def test_sglang_dflash_loads_every_weight_of_our_drafter(sglang_process, monkeypatch):
    import sglang.srt.layers.rotary_embedding.base as rope
    from sglang.srt.models.dflash import DFlashDraftModel

    monkeypatch.setattr(rope, "_is_cpu", True)  # its torch rotary path; off-CPU SGLang asks for vllm's kernel
    folder = checkpoint(DRAFTER)
    config = AutoConfig.from_pretrained(folder)
    ours = load_file(folder / "model.safetensors")
    model = DFlashDraftModel(config)
    model.load_weights(list(ours.items()))

    assert model.draft_config.block_size == config.block_size
    assert model.draft_config.target_layer_ids == config.dflash_config["target_layer_ids"]
    assert model.draft_config.mask_token_id == config.dflash_config["mask_token_id"]
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    params = dict(model.named_parameters())
    for name, param in params.items():
        fuses = [(fused_name, parts) for fused_name, parts in fused.items() if f".{fused_name}." in name]
        if fuses:
            fused_name, parts = fuses[0]
            expected = torch.cat([ours[name.replace(fused_name, part)] for part in parts])
        else:
            expected = ours[name]
        assert torch.equal(param.detach(), expected), name
    assert len(params) == len(ours) - sum(len(p) - 1 for p in fused.values()) * config.num_hidden_layers
