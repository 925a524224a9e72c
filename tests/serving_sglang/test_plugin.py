"""The weaver plugin inside the real SGLang: found through its entry point, registered, setting the SGLang
arguments its worker needs, and refusing a launch without a drafter with one clear message before any model
loads. (The worker itself runs in test_cpu_engine.py.)

Runs in the SGLang environment (`bash scripts/install.sh --serve`; tests/test_serving.py starts it).
"""

import importlib.metadata
import subprocess
import sys

import pytest
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from checkpoints import ADAPTER, DRAFTER, TARGET, checkpoint
from weaver.errors import WeaverError
from weaver.serving.sglang import (
    ADAPTER_ENV, ALGORITHMS, CHILDREN_ENV, DEFAULT_DRAFT_TOKENS, DRAFT_TEMPERATURE_ENV, FIXED_CHILDREN_ENV, POOL_ENV,
    RRS_PRIORITY_ENV, SAMPLING_ENV, register,
)


@pytest.fixture(scope="module")
def tiny_model():
    """A tiny random Qwen3 checkpoint: enough for SGLang to resolve its server arguments."""
    return checkpoint(TARGET)


def test_the_entry_point_registers_every_algorithm():
    entry = [e for e in importlib.metadata.entry_points(group="sglang.srt.plugins") if e.name == "weaver"]
    assert [e.value for e in entry] == ["weaver.serving.sglang:register"]
    load_plugins()  # what SGLang runs first in every process it starts
    for name in ALGORITHMS:
        algorithm = SpeculativeAlgorithm.from_string(name.lower())
        assert isinstance(algorithm, CustomSpecAlgo) and algorithm.is_speculative() and not algorithm.is_eagle()
    register()  # SGLang may load plugins again: no "already registered" error


@pytest.mark.parametrize("name", ALGORITHMS)
def test_server_args_get_what_the_worker_needs(name, tiny_model, monkeypatch):
    load_plugins()
    monkeypatch.setenv(ADAPTER_ENV, str(checkpoint(ADAPTER)))  # WEAVER's settings are checked too (test below)
    args = ServerArgs(model_path=str(tiny_model), speculative_algorithm=name, device="cpu",
                      speculative_draft_model_path=str(checkpoint(DRAFTER)))
    args.resolve_once()
    cfg = resolving_view(args)  # what resolution decided
    assert cfg.speculative_num_draft_tokens == DEFAULT_DRAFT_TOKENS
    assert (cfg.speculative_num_steps, cfg.speculative_eagle_topk) == (DEFAULT_DRAFT_TOKENS - 1, 1)
    assert cfg.disable_radix_cache and cfg.disable_overlap_schedule and cfg.disable_cuda_graph


@pytest.mark.parametrize("name", ALGORITHMS)
def test_server_args_without_a_drafter_stop_with_the_reason(name, tiny_model):
    load_plugins()
    args = ServerArgs(model_path=str(tiny_model), speculative_algorithm=name, device="cpu")
    with pytest.raises(ValueError, match=f"--speculative-algorithm {name} needs our drafter: "
                                         "--speculative-draft-model-path"):
        args.resolve_once()
    with pytest.raises(ValueError, match="Unknown speculative algorithm name: NOT_WEAVER"):
        ServerArgs(model_path=str(tiny_model), speculative_algorithm="NOT_WEAVER", device="cpu").resolve_once()


def test_weavers_settings_are_checked_before_loading(tiny_model, monkeypatch):
    """WEAVER without an adapter, an adapter folder that is not one, more children than the adapter's pool (16
    here), a malformed count, an unknown priority for sampled trees, a rule that cannot verify them, fixed children
    without recursive rejection or a draft temperature that is not a positive number: one message each from resolving the arguments, before any model loads."""
    load_plugins()

    def resolve():
        ServerArgs(model_path=str(tiny_model), speculative_algorithm="WEAVER", device="cpu",
                   speculative_draft_model_path=str(checkpoint(DRAFTER))).resolve_once()

    monkeypatch.delenv(ADAPTER_ENV, raising=False)
    with pytest.raises(ValueError, match=f"WEAVER needs a trained adapter: set {ADAPTER_ENV} to its folder"):
        resolve()
    monkeypatch.setenv(ADAPTER_ENV, str(checkpoint(DRAFTER)))
    with pytest.raises(WeaverError, match="is not a readable Weaver adapter checkpoint"):
        resolve()
    monkeypatch.setenv(ADAPTER_ENV, str(checkpoint(ADAPTER)))
    monkeypatch.setenv(CHILDREN_ENV, "17")
    with pytest.raises(WeaverError, match=f"{CHILDREN_ENV}=17 is more than the adapter's pool of 16 candidates"):
        resolve()
    monkeypatch.setenv(POOL_ENV, "32")  # a wider search pool than the adapter's own allows more children
    resolve()
    monkeypatch.setenv(POOL_ENV, "0")
    with pytest.raises(ValueError, match=f"{POOL_ENV} must be a whole number >= 1"):
        resolve()
    monkeypatch.delenv(POOL_ENV)
    monkeypatch.setenv(CHILDREN_ENV, "eight")
    with pytest.raises(ValueError, match=f"{CHILDREN_ENV} must be a whole number >= 1"):
        resolve()
    monkeypatch.setenv(CHILDREN_ENV, "16")
    resolve()  # the pool's size itself is fine
    monkeypatch.setenv(RRS_PRIORITY_ENV, "learned")
    with pytest.raises(ValueError, match=f"{RRS_PRIORITY_ENV} must be one of \\['draft', 'acceptance'\\], got 'learned'"):
        resolve()
    monkeypatch.setenv(RRS_PRIORITY_ENV, "acceptance")
    resolve()
    monkeypatch.setenv(SAMPLING_ENV, "target_only")  # a rule for greedy trees: the worker draws sampled requests'
    with pytest.raises(ValueError, match=f"{SAMPLING_ENV} must be one of \\['rrs', 'traversal'\\], got 'target_only'"):
        resolve()
    monkeypatch.setenv(SAMPLING_ENV, "traversal")
    resolve()
    monkeypatch.setenv(FIXED_CHILDREN_ENV, "1")  # fixed children have draft probability 0: traversal cannot verify them
    with pytest.raises(ValueError, match=f"{FIXED_CHILDREN_ENV} needs {SAMPLING_ENV}=rrs, got 'traversal'"):
        resolve()
    monkeypatch.setenv(SAMPLING_ENV, "rrs")
    resolve()
    monkeypatch.setenv(FIXED_CHILDREN_ENV, "-1")
    with pytest.raises(ValueError, match=f"{FIXED_CHILDREN_ENV} must be a whole number >= 0"):
        resolve()
    monkeypatch.setenv(FIXED_CHILDREN_ENV, "0")
    resolve()
    for value in ("0", "-1", "sharp", "inf", "nan"):
        monkeypatch.setenv(DRAFT_TEMPERATURE_ENV, value)
        with pytest.raises(ValueError, match=f"{DRAFT_TEMPERATURE_ENV} must be a finite number > 0, got '{value}'"):
            resolve()
    monkeypatch.setenv(DRAFT_TEMPERATURE_ENV, "0.8")
    resolve()


def test_launch_server_finds_the_plugin_and_stops_before_loading(tiny_model):
    """`python -m sglang.launch_server --speculative-algorithm WEAVER` without a drafter, as a user might type it."""
    run = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_model), "--device", "cpu",
         "--speculative-algorithm", "WEAVER", "--port", "39123"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "--speculative-algorithm WEAVER needs our drafter" in run.stderr + run.stdout
    assert "Unknown speculative algorithm" not in run.stderr + run.stdout
