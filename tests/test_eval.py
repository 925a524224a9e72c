"""eval.py sweeps and errors at smoke size (models from the session's smoke pipeline, tests/conftest.py)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest

from conftest import ROOT, run_script

from weaver.errors import WeaverError


def test_multirun_jobs_append_to_one_results_file(smoke_outputs, tmp_path):
    done = run_script("eval.py", smoke_outputs, "-m", "+experiment=smoke", f"eval.out_dir={tmp_path}",
                      "eval.temperature=0,1", "eval.methods=[ar,chain]", "eval.budgets=[4]", "eval.max_new_tokens=16")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted((r["temperature"], r["method"]) for r in rows) == [(0.0, "ar"), (0.0, "chain"), (1.0, "ar"), (1.0, "chain")]
    sampled = [r for r in rows if r["temperature"] == 1.0]
    assert all(r["greedy_match"] is None and r["speedup_vs_ar"] > 0 for r in sampled)
    summary = (tmp_path / "summary.md").read_text()  # rebuilt from both jobs' rows
    assert "| heldout_code | chain | 7 | 0 |" in summary and "| heldout_code | chain | 7 | 1 |" in summary
    assert done.stdout.count("| dataset | method |") == 2  # each job prints its own table


def test_unreachable_hub_dataset_is_one_clear_line(smoke_outputs, tmp_path):
    done = run_script("eval.py", smoke_outputs, "+experiment=smoke", "eval.datasets=[gsm8k]", f"eval.out_dir={tmp_path}",
                      HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: hub dataset openai/gsm8k (split test) cannot be loaded")


# Inference-time settings the README shows for eval.py; none may change a trained artifact's key.
EVAL_OVERRIDES = [
    "weaver.search.children=4", "weaver.search.nodes_per_call=2", "weaver.search.pool=128", "weaver.search.rescore=4",
    "eval.budgets=[8,16]", "eval.methods=[weaver]", "eval.temperature=1", "eval.sampling=target_only",
    "eval.draft_temperature=0.8", "eval.fixed_children=2", "model.dtype=bfloat16", "model.dtype=float32", "drafter.dtype=auto",
    "drafter.dtype=bfloat16",
    "eval.datasets=[humaneval]", "eval.n_prompts=2", "eval.compile=false", "device=cpu",
]


def _artifact_keys(config_name: str, *overrides: str, experiment: str = "tiny") -> dict[str, str]:
    from hydra import compose, initialize_config_dir

    from weaver.pipeline import ROOT_CONF, STAGES, stage_key

    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose(config_name, overrides=[f"+experiment={experiment}", *overrides])
    return {name: stage_key(cfg, name) for name in STAGES}


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_composes_for_train_and_eval(experiment):
    """Each shipped experiment composes for train.py and eval.py (its settings typed by the schemas), names its
    methods and datasets right, and writes under its own name (outputs/<experiment>)."""
    from hydra import compose, initialize_config_dir

    from weaver.eval.run import check_names
    from weaver.pipeline import ROOT_CONF

    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        train, evaluate = (compose(name, overrides=[f"+experiment={experiment}"]) for name in ("train", "eval"))
    check_names(evaluate)
    assert train.experiment == evaluate.experiment == experiment


def test_a_deeper_drafter_reuses_the_data_stages():
    """`smollm2_deep` is `smollm2_scale` with a 4-layer drafter: the rollouts, stored states and read text are
    shared (their keys do not read the drafter's depth), the drafter and what reads it are new."""
    scale, deep = _artifact_keys("train", experiment="smollm2_scale"), _artifact_keys("train", experiment="smollm2_deep")
    assert [name for name in scale if scale[name] != deep[name]] == ["drafter", "weaver"]


def test_eval_time_settings_never_change_artifact_keys():
    trained = _artifact_keys("train")
    assert _artifact_keys("eval") == trained
    for override in EVAL_OVERRIDES:
        assert _artifact_keys("eval", override) == trained, override
    # and what training reads does change them (the check can fail)
    assert _artifact_keys("eval", "weaver.pool_size=32")["weaver"] != trained["weaver"]
    assert _artifact_keys("eval", "model.train.steps=10")["target"] != trained["target"]


def test_storing_states_keeps_the_rollouts_and_changes_what_trains_on_them():
    """The optional `states` stage: absent from the keys while off (existing artifacts keep theirs); turning it
    on keeps the rollouts and retrains drafter and adapter, which then read stored bf16 states."""
    off, on = _artifact_keys("train"), _artifact_keys("train", "rollouts.store_states=true")
    assert on["rollouts"] == off["rollouts"] and on["target"] == off["target"]
    assert on["drafter"] != off["drafter"] and on["weaver"] != off["weaver"]
    assert _artifact_keys("train", "rollouts.store_states=true", "drafter.num_taps=2")["states"] != on["states"]


def test_read_text_is_its_own_stage_and_retrains_the_drafter():
    """`drafter.text.sources`: the optional `text` stage, absent from the keys while empty; set, it keeps the
    rollouts and their states and retrains the drafter (and what reads it); its own key follows its settings."""
    on = ["rollouts.store_states=true", "drafter.text.sources=[python_stdlib]"]
    states, text = _artifact_keys("train", on[0]), _artifact_keys("train", *on)
    assert {k: text[k] for k in ("rollouts", "states")} == {k: states[k] for k in ("rollouts", "states")}
    assert text["drafter"] != states["drafter"] and text["weaver"] != states["weaver"]
    assert _artifact_keys("train", *on, "drafter.text.n_sequences=8")["text"] != text["text"]
    assert _artifact_keys("train", *on, "drafter.train.steps=7")["text"] == text["text"]
    assert _artifact_keys("train", *on, "rollouts.dtype=bfloat16")["text"] != text["text"]  # states stored in bf16


@pytest.mark.parametrize("fast", [True, False])
def test_auto_data_dtype_is_keyed_as_the_dtype_it_resolves_to(monkeypatch, fast):
    """`rollouts.dtype=auto`: the data stages' keys are those of the dtype this machine's probe picks, so a
    CPU without native bf16 never reuses (or resumes) bf16 data under the same key, and vice versa."""
    from weaver import precision

    monkeypatch.setattr(precision, "bf16_is_fast", lambda device_type: (fast, "pretend"))
    text = ["rollouts.store_states=true", "drafter.text.sources=[python_stdlib]"]
    auto = _artifact_keys("train", *text, "rollouts.dtype=auto")
    picked = _artifact_keys("train", *text, f"rollouts.dtype={'bfloat16' if fast else 'float32'}")
    other = _artifact_keys("train", *text, f"rollouts.dtype={'float32' if fast else 'bfloat16'}")
    for stage in ("rollouts", "states", "text", "drafter", "weaver"):
        assert auto[stage] == picked[stage] != other[stage], stage


def test_eval_overrides_run_on_trained_artifacts_without_training(smoke_outputs, tmp_path):
    done = run_script("eval.py", smoke_outputs, "+experiment=smoke", f"eval.out_dir={tmp_path}", "eval.methods=[weaver]",
                      "weaver.search.children=4", "weaver.search.nodes_per_call=2", "weaver.search.pool=48", "model.dtype=float32",
                      "weaver.search.rescore=3", "eval.budgets=[3]", "eval.datasets=[heldout_code]", "eval.n_prompts=1", "eval.max_new_tokens=8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "building" not in done.stdout
    assert [json.loads(line)["method"] for line in (tmp_path / "results.jsonl").read_text().splitlines()] == ["weaver"]


def test_settings_added_later_keep_existing_keys_at_their_old_behaviour():
    """`pipeline.ADDED_LATER`: a setting at the value that reproduces earlier artifacts leaves every key as it
    was without the setting; any other value retrains what reads it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from weaver.pipeline import ADDED_LATER, ROOT_CONF, STAGES, stage_key

    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("train", overrides=["+experiment=tiny"])
    keys = {name: stage_key(cfg, name) for name in STAGES}
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))  # untyped: a schema's fields cannot be deleted
    with open_dict(cfg):
        for group, added in sorted(ADDED_LATER.items(), key=lambda item: -item[0].count(".")):  # inner groups first
            node = cfg
            for part in group.split("."):
                node = node[part]
            for key in added:
                del node[key]
    assert {name: stage_key(cfg, name) for name in STAGES} == keys
    changed = _artifact_keys("train", "rollouts.samples_per_prompt=2", "rollouts.temperature=1")
    assert changed["rollouts"] != keys["rollouts"]
    assert _artifact_keys("train", "rollouts.dtype=auto")["rollouts"] != keys["rollouts"]
    assert _artifact_keys("train", "weaver.train.heldout_rollouts=8")["weaver"] != keys["weaver"]
    assert _artifact_keys("train", "weaver.train.calibrate=true")["weaver"] != keys["weaver"]
    assert _artifact_keys("train", "drafter.train.heldout_rollouts=8")["drafter"] != keys["drafter"]
    assert _artifact_keys("train", "drafter.train.init=target")["drafter"] != keys["drafter"]
    assert _artifact_keys("train", "drafter.text.seq_len=64")["drafter"] != keys["drafter"]


def test_stored_states_are_keyed_by_the_tapped_layers(tmp_path):
    """A given drafter that taps the layers a new one would (for the experiment's number of taps) reuses the
    stored states of the experiment's rollouts; one that taps others gets its own."""
    from hf_tiny import save_tiny_hf_model
    from weaver.models.checkpoint import load_target
    from weaver.models.drafter import Drafter, default_target_layers
    from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config, save_drafter

    save_tiny_hf_model("qwen3_5_text", tmp_path / "target")
    target = load_target(str(tmp_path / "target"))
    taps = _artifact_keys("train", "rollouts.store_states=true")
    for layers, shared in [(default_target_layers(target.cfg.num_layers, 2), True), ((0,), False)]:
        config = new_drafter_config(target, 1, 4, 3, target_layer_ids=layers)
        folder = tmp_path / f"drafter-{len(layers)}"
        save_drafter(Drafter(drafter_config(config)), config, folder)
        given = _artifact_keys("train", "rollouts.store_states=true", "drafter.num_taps=2", f"drafter.path={folder}")
        assert (given["states"] == _artifact_keys("train", "rollouts.store_states=true", "drafter.num_taps=2")["states"]) is shared
        assert given["rollouts"] == taps["rollouts"]


@pytest.mark.parametrize("script", sorted((ROOT / "scripts" / "gpu").glob("*.sh")), ids=lambda p: p.name)
def test_gpu_scripts_compose_to_evals_the_sglang_backend_accepts(script):
    """The GPU run scripts cannot be run here; their eval command must at least compose (every override names
    a setting) into a config the SGLang backend's checks accept, and the script must parse as bash."""
    from hydra import compose, initialize_config_dir

    from weaver.eval.run import check_names
    from weaver.eval.sglang_backend import check_sglang_eval
    from weaver.pipeline import ROOT_CONF

    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    command = re.search(r"^python eval\.py (.*?)\"\$@\"", script.read_text().replace("\\\n", " "), re.M | re.S)
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=shlex.split(command.group(1)))
    check_names(cfg)
    check_sglang_eval(cfg)
    assert cfg.eval.backend == "sglang" and "weaver" in cfg.eval.methods


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sglang_engines_get_the_evals_sampling_settings(temperature):
    """Our workers verify sampled requests with the eval's rule, node ranking, fixed children and draft temperature
    (the rows say so); greedy engines and SGLang's own (the chain's DFLASH, plain decoding) get none of them."""
    from hydra import compose, initialize_config_dir

    from weaver.eval.sglang_backend import check_sglang_eval, engine_spec
    from weaver.pipeline import ROOT_CONF

    overrides = ["+experiment=tiny", "eval.backend=sglang", f"eval.temperature={temperature}", "eval.sampling=rrs",
                 "eval.rrs_priority=acceptance", "eval.fixed_children=2", "eval.draft_temperature=0.8",
                 "eval.methods=[ar,chain,ddtree,weaver]"]
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=overrides)
    check_sglang_eval(cfg)
    envs = {m: engine_spec(cfg, (m, 4), ROOT, ROOT, ROOT, [], None)["env"] for m in ("ar", "chain", "ddtree", "weaver")}
    sampled = {"WEAVER_SAMPLING": "rrs", "WEAVER_RRS_PRIORITY": "acceptance", "WEAVER_FIXED_CHILDREN": "2",
               "WEAVER_DRAFT_TEMPERATURE": "0.8"}
    for method in ("ddtree", "weaver"):
        assert (sampled.items() <= envs[method].items()) is (temperature > 0), (method, envs[method])
    assert "WEAVER_ADAPTER" in envs["weaver"] and envs["ar"] == envs["chain"] == {}
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=[*overrides, "eval.sampling=target_only", "eval.fixed_children=0"])
    if temperature > 0:  # the workers draw sampled requests' trees: a rule for greedy trees would mislabel the rows
        with pytest.raises(WeaverError, match="eval.sampling must be one of \\['rrs', 'traversal'\\], got 'target_only'"):
            check_sglang_eval(cfg)
    else:
        check_sglang_eval(cfg)


@pytest.mark.parametrize("override", ["drafter.train.steps=many", "weaver.train.stepz=3", "model.train.lr=fast",
                                      "weaver.train.loss.kl=high"])
def test_training_settings_are_checked_by_their_schema(override):
    """Every stage's `train:` block is typed (weaver/train/config.py): a misspelt key or a value of the wrong
    type stops the composition; `eval_every: null` means "only at the end"."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from weaver.pipeline import ROOT_CONF

    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        with pytest.raises(ConfigCompositionException):
            compose("train", overrides=["+experiment=tiny", override])
        cfg = compose("train", overrides=["+experiment=tiny", "model.train.eval_every=null"])
    assert cfg.model.train.eval_every is None and cfg.drafter.train.eval_every is None


def test_never_evaluate_spelt_old_or_new_keeps_the_artifact_keys():
    """`eval_every: null` ("never") hashes as its old spelling 1000000 (pipeline.RESPELLED): artifacts
    trained before keep their keys; a real evaluation interval still changes them."""
    keys = _artifact_keys("train")
    assert _artifact_keys("train", "drafter.train.eval_every=1000000", "weaver.train.eval_every=1000000") == keys
    assert _artifact_keys("train", "weaver.train.eval_every=50")["weaver"] != keys["weaver"]
