"""Named stages over one Hydra config; each stage's artifact is content-addressed and reused.

An artifact lives in `<paths.root>/artifacts/<stage>-<key>/`, where key hashes the config slice the
stage reads plus the keys of the stages it consumes: rerunning with the same config skips the stage,
changing e.g. the model width retrains the target and everything downstream. Training state of an
unfinished stage lives beside it in `<stage>-<key>.work/` (checkpoints), so a rerun resumes. A run holds
`<paths.root>/.locks/<stage>-<key>.lock` while it builds, so a concurrent run of the same stage waits for it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from weaver.errors import WeaverError
from weaver.data.shards import wait_for
from weaver.io import atomic_write_json, exclusive, remove_stale_temporaries
from weaver.train.config import register_schemas

if TYPE_CHECKING:
    from weaver.models.target import TargetModel

register_schemas()  # the stages' training settings are typed (conf/*: `/schema/train/<stage>`)


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise WeaverError(f"package '{name}' is not installed (scripts/install.sh installs it)")
    return str(Path(spec.origin).parent)


ROOT_CONF = Path(__file__).resolve().parents[1] / "conf"  # the Hydra config tree (editable install)


def _artifact_of(experiment: str, stage: str, *, _root_: DictConfig) -> str:
    """The artifact folder a stage of another experiment built (its `artifacts.json`), so that one experiment can
    start from another's drafter: `drafter.path: ${artifact_of:smollm2_read,drafter}`."""
    record = Path(_root_.paths.root) / experiment / "artifacts.json"
    if not record.is_file():
        raise WeaverError(f"no artifacts of experiment '{experiment}' under {record.parent} (this config reads its "
                          f"{stage}): run `python train.py +experiment={experiment}` first")
    built = json.loads(record.read_text())
    if stage not in built:
        raise WeaverError(f"experiment '{experiment}' built no {stage} ({record} lists {', '.join(built) or 'none'})")
    return built[stage]


OmegaConf.register_new_resolver("pkg_dir", _package_dir, replace=True)
OmegaConf.register_new_resolver("artifact_of", _artifact_of, replace=True)


@dataclass(frozen=True)
class Stage:
    name: str
    inputs: tuple[str, ...]  # stages whose artifacts this one reads
    config: Callable[[DictConfig], list]  # the settings that determine the artifact (hashed into its key)
    run: Callable[[DictConfig, Path, Path], None]  # (cfg, out_dir, work_dir); must write out_dir atomically
    needed: Callable[[DictConfig], bool] = lambda cfg: True
    unneeded: str = "pretrained model or checkpoint given"  # why a stage that is not needed is skipped
    distributed: bool = False  # every process of `accelerate launch` takes part (training, sharded data stages)
    optional: bool = False  # when not needed it does not exist, and the keys of the stages reading it omit it


def _run_corpus(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.data.corpus import build_corpus

    d = cfg.data
    build_corpus(list(d.sources), d.max_bytes, d.vocab_size, d.seq_len, d.val_fraction, cfg.seed, out_dir)


def _run_target(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.train.target import train_target

    train_target(cfg, artifact_dir(cfg, "corpus"), out_dir, work_dir)


def _run_rollouts(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.artifacts import load_target_and_tokenizer
    from weaver.data.rollouts import corpus_prompts, generate_rollouts, set_prompts
    from weaver.models.linear import exact_bf16

    r = cfg.rollouts
    target, tokenizer = load_target_and_tokenizer(cfg, r.dtype)
    if r.prompts == "corpus":
        prompts = corpus_prompts(artifact_dir(cfg, "corpus"), r.n_prompts, r.prompt_tokens, cfg.seed)
    else:
        prompts = set_prompts(cfg, tokenizer)
    with exact_bf16(False):  # batched decoding, compared with nothing: the fast kernels
        generate_rollouts(target, prompts, r, tokenizer.eos_token_id, cfg.seed, out_dir, work_dir)


def _rollout_settings(cfg: DictConfig) -> list:
    """What the rollouts depend on besides the target: their settings, the prompt sets, the chat template's."""
    r = cfg.rollouts
    sets = [] if r.prompts == "corpus" else [OmegaConf.to_container(cfg.prompt_sets[n]) for n in r.prompts if n in cfg.prompt_sets]
    return [_with_data_dtype(cfg, _trained_on(cfg, "rollouts")), sets, OmegaConf.to_container(cfg.model.chat_template_kwargs),
            cfg.seed]


def _with_data_dtype(cfg: DictConfig, settings: dict) -> dict:
    """`dtype: auto` hashed as the dtype it resolves to on this machine (`weaver.precision.auto_data_dtype`): the same
    key never names bf16 data on one CPU and fp32 data on another, nor a build resumed on a machine that
    decides otherwise; and `auto` shares artifacts with the explicit dtype it picks."""
    from weaver.precision import auto_data_dtype, resolve_device

    if settings.get("dtype") == "auto":
        settings = {**settings, "dtype": str(auto_data_dtype(resolve_device(cfg.device))).removeprefix("torch.")}
    return settings


def _run_states(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    import datasets

    from weaver.artifacts import load_target_and_tokenizer
    from weaver.data.states import build_states
    from weaver.models.linear import exact_bf16

    r = cfg.rollouts
    target, _ = load_target_and_tokenizer(cfg, r.dtype)
    rows = datasets.load_from_disk(str(artifact_dir(cfg, "rollouts") / "dataset"))
    with exact_bf16(False):  # batched decoding, compared with nothing: the fast kernels
        build_states(target, rows, tap_layers_for(cfg, target), r.shard_size, r.batch_size, out_dir, work_dir)


def _run_text(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.artifacts import load_target_and_tokenizer
    from weaver.data.text import build_text
    from weaver.models.linear import exact_bf16

    r = cfg.rollouts
    target, tokenizer = load_target_and_tokenizer(cfg, r.dtype)
    with exact_bf16(False):  # batched reading, compared with nothing: the fast kernels
        build_text(target, tokenizer, cfg.drafter.text, tap_layers_for(cfg, target), r.shard_size, r.batch_size,
                   cfg.seed, out_dir, work_dir)


def tap_layers_for(cfg: DictConfig, target: TargetModel) -> tuple[int, ...]:
    """The target layers the experiment's drafter reads: a given checkpoint's, or those a new one will tap."""
    from weaver.models.checkpoint import load_hf_config, resolve_checkpoint
    from weaver.models.drafter import default_target_layers
    from weaver.models.drafter_checkpoint import drafter_config

    if cfg.drafter.path is not None:
        return drafter_config(load_hf_config(resolve_checkpoint(str(cfg.drafter.path)))).target_layer_ids
    return default_target_layers(target.cfg.num_layers, cfg.drafter.num_taps)


def _tapped(cfg: DictConfig) -> int | list[int]:
    """What stored states depend on besides the rollouts: the tapped layers, spelt `drafter.num_taps` when they are
    the layers a new drafter of this config taps (the key states built for a trained drafter have), else as the
    layer ids: a given drafter that taps the same layers reuses those states, and vice versa."""
    from weaver.models.checkpoint import load_hf_config, resolve_checkpoint
    from weaver.models.drafter import default_target_layers
    from weaver.models.drafter_checkpoint import drafter_config

    if cfg.drafter.path is None:
        return cfg.drafter.num_taps
    given = drafter_config(load_hf_config(resolve_checkpoint(str(cfg.drafter.path))))
    n_layers, ids = given.num_target_layers, tuple(given.target_layer_ids)
    return cfg.drafter.num_taps if n_layers and ids == default_target_layers(n_layers, cfg.drafter.num_taps) else list(ids)


def _states_dir(cfg: DictConfig) -> Path | None:
    return artifact_dir(cfg, "states") if cfg.rollouts.store_states else None


def _run_drafter(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.artifacts import load_target_and_tokenizer
    from weaver.train.drafter import train_drafter

    target, tokenizer = load_target_and_tokenizer(cfg)
    text_dir = artifact_dir(cfg, "text") if _reads_text(cfg) else None
    train_drafter(cfg, target, tokenizer, artifact_dir(cfg, "rollouts"), out_dir, work_dir, _states_dir(cfg), text_dir)


def _read_in(cfg: DictConfig) -> dict:
    """The precision the target reads text in (`rollouts.dtype`, as for the rollouts): the stored states' dtype."""
    dtype = {"dtype": OmegaConf.select(cfg, "rollouts.dtype", default="model")}  # older configs: none
    return _as_hashed(_with_data_dtype(cfg, dtype), "rollouts")


def _reads_text(cfg: DictConfig) -> bool:
    return cfg.drafter.path is None and bool(OmegaConf.select(cfg, "drafter.text.sources"))  # None: an older config


def _run_weaver(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.artifacts import load_drafter_for, load_target_and_tokenizer
    from weaver.train.adapter import train_adapter

    target, tokenizer = load_target_and_tokenizer(cfg)
    drafter = load_drafter_for(cfg, target, "model")
    text_dir = artifact_dir(cfg, "text") if _reads_text(cfg) else None
    train_adapter(cfg, target, drafter, tokenizer, artifact_dir(cfg, "rollouts"), out_dir, work_dir, _states_dir(cfg),
                  text_dir)


def _scratch(cfg: DictConfig) -> bool:
    return cfg.model.source == "scratch"


# Settings read only when decoding: they must never change an artifact's key (and so never retrain).
INFERENCE_ONLY = {"model": ("dtype", "chat_template_kwargs"), "drafter": ("dtype",), "weaver": ("search",)}
# Settings of a group that another stage hashes: `rollouts.store_states` decides whether the optional
# `states` stage exists, which enters the keys of the stages that read it, not the rollouts' key.
HASHED_ELSEWHERE = {"rollouts": ("store_states",)}


# Settings added after artifacts were built, at the value that reproduces what was built before: at that
# value they stay out of the key, so existing artifacts remain valid (any other value changes the key).
ADDED_LATER = {"rollouts": {"samples_per_prompt": 1, "dtype": "model"}, "weaver.train": {"heldout_rollouts": 0, "read_text": False, "calibrate": False},
               "drafter.train": {"heldout_rollouts": 0, "init": "random"},
               "drafter": {"draft_vocab": None, "draft_vocab_corpus": ["python_stdlib"], "text": {}},
               "drafter.text": {"sources": [], "n_sequences": 1024, "seq_len": 192}}
# Settings whose spelling of a value changed: (new, old), hashed as the old spelling so that artifacts built
# before stay valid ("never evaluate" was `eval_every: 1000000`, now `null`, for the drafter and adapter).
RESPELLED = {group: {"eval_every": (None, 1000000)} for group in ("drafter.train", "weaver.train")}


def _start(cfg: DictConfig) -> list[str]:
    """A fine-tuned drafter's start (`drafter.train.init: <checkpoint>`) as its weight files' paths, sizes and
    modification times, so that new weights under the same path train a new drafter (nothing for random/target)."""
    from weaver.train.drafter import DRAFTER_INITS, init_checkpoint

    init = OmegaConf.select(cfg, "drafter.train.init", default="random")
    if init in DRAFTER_INITS:
        return []
    files = sorted(init_checkpoint(str(init)).glob("*.safetensors"))
    if not files:
        raise WeaverError(f"drafter.train.init={init}: no .safetensors weights there (a DFlash-format drafter checkpoint)")
    stats = {f: f.stat() for f in files}
    return [f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}" for f, st in stats.items()]


def _trained_on(cfg: DictConfig, group: str) -> dict:
    """The config group `group` without its inference-only settings: what a training stage hashes."""
    node = OmegaConf.select(cfg, group)  # None: a group added later, absent from this config
    settings = {} if node is None else OmegaConf.to_container(node, resolve=True)
    skip = INFERENCE_ONLY.get(group, ()) + HASHED_ELSEWHERE.get(group, ())
    return _as_hashed({k: v for k, v in settings.items() if k not in skip}, group)


def _as_hashed(settings: dict, group: str) -> dict:
    """Settings as the key hashes them: ADDED_LATER ones at their old value left out, RESPELLED ones old-spelt."""
    for key, value in settings.items():
        if isinstance(value, dict):
            settings[key] = _as_hashed(value, f"{group}.{key}")
    added, respelled = ADDED_LATER.get(group, {}), RESPELLED.get(group, {})
    settings = {k: v for k, v in settings.items() if k not in added or v != added[k]}
    return {k: respelled[k][1] if k in respelled and v == respelled[k][0] else v for k, v in settings.items()}


STAGES: dict[str, Stage] = {
    "corpus": Stage(
        "corpus", (), lambda cfg: [_trained_on(cfg, "data"), cfg.seed], _run_corpus,
        needed=lambda cfg: _scratch(cfg) or cfg.rollouts.prompts == "corpus",
        unneeded="pretrained target, rollouts from prompt sets",
    ),
    "target": Stage(
        "target", ("corpus",), lambda cfg: [_trained_on(cfg, "model"), cfg.seed], _run_target, needed=_scratch,
        distributed=True,
    ),
    "rollouts": Stage("rollouts", ("target",), _rollout_settings, _run_rollouts, distributed=True),
    "states": Stage(
        "states", ("rollouts",), lambda cfg: [_tapped(cfg)],
        _run_states, needed=lambda cfg: cfg.rollouts.store_states, unneeded="rollouts.store_states is false",
        optional=True, distributed=True,
    ),
    "text": Stage(
        "text", ("target",), lambda cfg: [{**_trained_on(cfg, "drafter.text"), **_read_in(cfg)}, _tapped(cfg), cfg.seed],
        _run_text, needed=_reads_text, unneeded="drafter.text.sources is empty, or drafter.path given", optional=True,
        distributed=True,
    ),
    "drafter": Stage(
        "drafter", ("rollouts", "states", "text"), lambda cfg: [_trained_on(cfg, "drafter"), cfg.seed, *_start(cfg)],
        _run_drafter,
        needed=lambda cfg: cfg.drafter.path is None, distributed=True,
    ),
    "weaver": Stage(
        "weaver", ("rollouts", "states", "drafter"), lambda cfg: [_trained_on(cfg, "weaver"), cfg.seed], _run_weaver,
        needed=lambda cfg: cfg.weaver.path is None, distributed=True,
    ),
}


def stage_key(cfg: DictConfig, name: str) -> str:
    stage = STAGES[name]
    inputs = [up for up in stage.inputs if not STAGES[up].optional or STAGES[up].needed(cfg)]
    payload = {"stage": name, "config": stage.config(cfg), "inputs": [stage_key(cfg, up) for up in inputs]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:10]


def artifact_dir(cfg: DictConfig, name: str) -> Path:
    return Path(cfg.paths.root) / "artifacts" / f"{name}-{stage_key(cfg, name)}"


NOTHING_TO_TRAIN = (
    "[{experiment}] nothing to train (stages: []). `python eval.py +experiment={experiment}` measures the methods "
    "the given checkpoints allow (drafter.path, weaver.path); `stages=[rollouts,drafter,weaver]` trains a drafter "
    "and a Weaver adapter on the target's own rollouts (see +experiment=smollm2)."
)


def run_stages(cfg: DictConfig) -> dict[str, str]:
    """Run cfg.stages in order (with their inputs first); returns {stage: artifact folder}.

    Under `accelerate launch --num_processes N`, training stages run on every process (data sharded by
    accelerate), the data stages (rollouts, states, text) split their shards over the processes
    (`weaver.data.shards`) and the corpus is built by rank 0 alone; only rank 0 writes an artifact, and every
    process waits for a stage's artifact before the next stage."""
    from accelerate import PartialState

    from weaver.artifacts import gguf_as_safetensors

    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise WeaverError(f"unknown stage(s) {unknown}; available: {', '.join(STAGES)}")
    state = PartialState(cpu=cfg.device == "cpu")
    say = state.print  # rank 0 only
    if cfg.model.source == "gguf":
        with state.main_process_first():  # rank 0 dequantises once; the others then find the cached folder
            gguf_as_safetensors(cfg)
    if not cfg.stages:
        say(NOTHING_TO_TRAIN.format(experiment=cfg.experiment))
    done: dict[str, str] = {}
    for name in _with_inputs(list(cfg.stages)):
        stage = STAGES[name]
        if not stage.needed(cfg):
            say(f"[{name}] not needed with this config ({stage.unneeded})")
            continue
        out_dir = artifact_dir(cfg, name)
        with _alone_on(out_dir, name, state):
            _build_once(stage, name, cfg, out_dir, state)
        done[name] = str(out_dir)
    if state.is_main_process:
        atomic_write_json(Path(cfg.paths.root) / cfg.experiment / "artifacts.json", built_artifacts(cfg))
    state.destroy_process_group()
    return done


def built_artifacts(cfg: DictConfig) -> dict[str, str]:
    """{stage: folder} for every stage of this config whose artifact exists, those this run built or checked and
    those an earlier run did: a run of some stages (`stages=[text]`) does not drop the others from the record
    other experiments read (`artifact_of`)."""
    folders = {name: artifact_dir(cfg, name) for name, stage in STAGES.items() if stage.needed(cfg)}
    return {name: str(folder) for name, folder in folders.items() if folder.exists()}


def lock_file(artifact: Path) -> Path:
    """Where the lock of an artifact (`<root>/artifacts/<name>`) lives: `<root>/.locks/<name>.lock`, beside the
    artifacts folder so that it holds artifacts only."""
    return artifact.parent.parent / ".locks" / f"{artifact.name}.lock"


@contextmanager
def _alone_on(out_dir: Path, name: str, state) -> Iterator[None]:
    """Rank 0 holds the artifact's lock while it checks and builds it: a second run of the same stage (another
    job on the same outputs) waits, then finds the artifact built, instead of sharing its work folder."""
    if not state.is_main_process:
        yield
        return
    with exclusive(lock_file(out_dir), on_wait=lambda why: print(f"[{name}] {why}", flush=True)):
        yield


def _build_once(stage: Stage, name: str, cfg: DictConfig, out_dir: Path, state) -> None:
    say = state.print  # rank 0 only
    work_dir = out_dir.with_name(out_dir.name + ".work")
    if out_dir.exists():
        say(f"[{name}] up to date: {out_dir}")
    else:
        say(f"[{name}] building {out_dir}")
        if state.is_main_process:
            remove_stale_temporaries(out_dir)  # a killed run's half-written folder: never read, now removed
        start = time.perf_counter()
        if stage.distributed or state.is_main_process:
            stage.run(cfg, out_dir, work_dir)
        wait_for([out_dir])  # built by rank 0 alone, or merged by it from every process's shards
        say(f"[{name}] built in {time.perf_counter() - start:.1f} s")
    if state.is_main_process:  # checkpoints and shards: done with (also when a kill came right after the artifact)
        shutil.rmtree(work_dir, ignore_errors=True)


def _with_inputs(names: list[str]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        for up in STAGES[name].inputs:
            visit(up)
        if name not in order:
            order.append(name)

    for name in names:
        visit(name)
    return order
