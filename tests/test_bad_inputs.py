"""Every bad input ends in one `WeaverError` with a clear message (the CLIs print it as one `error: ...` line,
exit status 2): one table of (bad input -> message), each case at the lowest level that shows it. Also: no
file a user passes in is ever unpickled, and artifacts carry the fingerprint of the tokenizer they were
trained with."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from conftest import ROOT, run_script
from hf_tiny import VOCAB, save_tiny_hf_model, tiny_config
from weaver.acceptance import check_finite
from weaver.budget import BudgetPlanner, check_budgets, measure_step_costs
from weaver.data.prompts import encode_prompts, load_prompt_set
from weaver.engine import speculative_generate
from weaver.errors import WeaverError
from weaver.eval.run import check_names
from weaver.eval.sglang_backend import check_sglang_eval, sglang_python
from weaver.models.adapter import AdapterConfig, WeaverAdapter, load_adapter, save_adapter
from weaver.models.checkpoint import load_target, load_tokenizer, tokenizer_fingerprint
from weaver.models.config import from_hf
from weaver.models.drafter import Drafter
from weaver.models.drafter_checkpoint import drafter_config, load_drafter, new_drafter_config, save_drafter

BLOCK = 6  # drafter block: 5 draft positions
POOL = 16  # the adapter's candidates per position
PROMPT = [5, 6, 7]


def word_tokenizer(n: int, prefix: str = "t") -> PreTrainedTokenizerFast:
    """A word-level tokenizer of n ids (0 = <unk>); another prefix gives another vocabulary of the same size."""
    vocab = {"<unk>": 0, **{f"{prefix}{i}": i for i in range(1, n)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny attention-only target (max_position_embeddings 512) saved with its own tokenizer."""
    path = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    save_tiny_hf_model("qwen3", path)
    word_tokenizer(VOCAB).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(folder):
    torch.manual_seed(0)
    target = load_target(str(folder))
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, BLOCK, 2, 2))).eval()
    adapter = WeaverAdapter(AdapterConfig(target.cfg.hidden_size, VOCAB, BLOCK - 1, 32, 1, 2, 64, 8, POOL)).eval()
    return SimpleNamespace(target=target, drafter=drafter, adapter=adapter, folder=folder)


def other_target(**changes) -> SimpleNamespace:
    """The config of another tiny target (what `new_drafter_config` reads), e.g. another hidden size."""
    hf = tiny_config("qwen3")
    for key, value in changes.items():
        setattr(hf, key, value)
    return SimpleNamespace(cfg=from_hf(hf))


# --- each case: a function of (models, a scratch folder) that must raise ------------------------------


def spec(m, **kwargs):
    """speculative_generate on the shared models, with defaults a case overrides."""
    args = dict(prompt=PROMPT, max_new_tokens=8, method="chain", budget=None)
    args.update(kwargs)
    speculative_generate(m.target, args.pop("drafter", m.drafter), args.pop("prompt"), args.pop("max_new_tokens"),
                         **args)


def drafter_for(target_like, tmp: Path, **kwargs) -> Path:
    """A DFlash checkpoint made for `target_like`, saved under tmp; its folder."""
    cfg = new_drafter_config(target_like, 1, BLOCK, 2, **{"num_taps": 2, **kwargs})
    save_drafter(Drafter(drafter_config(cfg)), cfg, tmp / "drafter")
    return tmp / "drafter"


def adapter_for(tmp: Path, *, sha: str | None = None, **sizes) -> Path:
    cfg = dict(target_hidden_size=64, vocab_size=VOCAB, max_depth=BLOCK - 1, d_model=32, num_heads=2, pool_size=POOL)
    adapter = WeaverAdapter(AdapterConfig(**{**cfg, **sizes}))
    save_adapter(adapter, tmp / "adapter", sha)
    return tmp / "adapter"


def target_copy(m, tmp: Path, edit) -> Path:
    """A copy of the target folder with `edit(folder)` applied; its folder."""
    path = tmp / "copy"
    shutil.copytree(m.folder, path)
    edit(path)
    return path


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# edits of a saved folder
def set_json(name: str, **changes):
    return lambda folder: edit_json(folder / name, **changes)


def write(name: str, content: str | bytes):
    def edit(folder: Path) -> None:
        (folder / name).unlink(missing_ok=True)
        with open(folder / name, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
    return edit


def truncate(name: str):
    def edit(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])
    return edit


def adapter_sizes(**sizes):
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        edit_json(folder / "config.json", weaver_adapter={**config["weaver_adapter"], **sizes})
    return edit


def pickled_only(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle; it must never be unpickled


def _edited(path: Path, edit) -> Path:
    edit(path)
    return path


# cases: load a target copy / a fresh drafter / a fresh adapter after an edit of its folder
def broken_target(edit):
    return lambda m, t: load_target(str(target_copy(m, t, edit)))


def broken_drafter(edit):
    return lambda m, t: load_drafter(str(_edited(drafter_for(m.target, t), edit)), m.target)


def broken_adapter(edit):
    return lambda m, t: load_adapter(_edited(adapter_for(t), edit), m.target, BLOCK - 1)


def nan_in(module: torch.nn.Module, name: str) -> torch.nn.Module:
    poisoned = copy.deepcopy(module)
    with torch.no_grad():
        dict(poisoned.named_parameters())[name].fill_(math.nan)
    return poisoned


def target_inf_at_verify(m):
    """A target whose verify pass (not its prefill) returns an inf logit: the error names the step."""
    target = copy.copy(m.target)  # shares the weights; its own `verify`

    def verify(tree, cache, taps=(), compiled=False, budget=0):
        out, pending = type(m.target).verify(m.target, tree, cache, taps, compiled, budget)
        out.logits = out.logits.clone()
        out.logits[0, -1, 3] = math.inf
        return out, pending

    object.__setattr__(target, "verify", verify)
    speculative_generate(target, m.drafter, PROMPT, 8, method="ddtree", budget=4)


def drafter_made_for(target_like=None, **kwargs):
    """A case: load a drafter made for `target_like` (default: the shared target) onto the shared target."""
    return lambda m, t: load_drafter(str(drafter_for(target_like or m.target, t, **kwargs)), m.target)


OTHER_TOKENIZER = tokenizer_fingerprint(word_tokenizer(VOCAB, "w"))  # same size, other tokens


def eval_config(**changes) -> OmegaConf:
    """A config with the eval settings check_names and the SGLang backend read (defaults: a valid one)."""
    e = {"methods": ["ar"], "datasets": [], "budgets": [4], "seed": 0, "backend": "torch", "rrs_priority": "draft",
         "draft_temperature": None, "fixed_children": 0, "temperature": 1.0, "sampling": "rrs", "prepack": True,
         "sglang": {"python": None, "concurrency": [1]}}
    return OmegaConf.create({"eval": {**e, **changes, "sglang": {**e["sglang"], **changes.get("sglang", {})}},
                             "prompt_sets": {}})


def prompt_set(name: str, **set_spec):
    cfg = OmegaConf.create({"prompt_sets": {"humaneval": {"kind": "humaneval", "seed": 0, "size": 4, **set_spec}},
                            "model": {"source": "scratch"}})
    return load_prompt_set(cfg, name)


CASES = [
    # --- a drafter or adapter made for another target ---
    ("drafter for another hidden size", drafter_made_for(other_target(hidden_size=32)),
     "drafter hidden size 32 does not match the target's 64"),
    ("drafter for another vocabulary", drafter_made_for(other_target(vocab_size=50)),
     "drafter vocab 50 does not match the target's 97"),
    ("drafter tapping a layer the target lacks", drafter_made_for(target_layer_ids=(0, 5)),
     "drafter taps target layers [5], but the target has 2 layers"),
    ("drafter for a deeper target", drafter_made_for(other_target(num_hidden_layers=6), target_layer_ids=(0, 1)),
     "drafter was made for a target of 6 layers (num_target_layers), this target has 2"),
    ("drafter trained with another tokenizer", drafter_made_for(tokenizer_sha256=OTHER_TOKENIZER),
     "was trained with another tokenizer (vocabulary sha256 "),
    ("adapter for another hidden size", lambda m, t: load_adapter(adapter_for(t, target_hidden_size=72), m.target, BLOCK - 1),
     "adapter was trained for hidden size 72 / vocab 97, the target has 64 / 97"),
    ("adapter for another block size", lambda m, t: load_adapter(adapter_for(t), m.target, 7),
     "adapter covers depth 5, the drafter drafts 7 positions"),
    ("adapter trained with another tokenizer",
     lambda m, t: load_adapter(adapter_for(t, sha=OTHER_TOKENIZER), m.target, BLOCK - 1),
     "was trained with another tokenizer (vocabulary sha256 "),
    ("tokenizer larger than the target's vocabulary",
     lambda m, t: load_tokenizer(target_copy(m, t, word_tokenizer(120).save_pretrained), m.target),
     "has 120 token ids, more than the target's vocabulary of 97"),
    # --- budgets ---
    ("budget 0", lambda m, t: spec(m, method="ddtree", budget=0), "tree budget must be at least 1 draft node, got 0"),
    ("negative budget", lambda m, t: spec(m, method="ddtree", budget=-3),
     "tree budget must be at least 1 draft node, got -3"),
    ("non-integer budget", lambda m, t: spec(m, method="ddtree", budget=2.5),
     "tree budget must be a whole number of draft nodes (>= 1) or a BudgetPlanner, got 2.5"),
    ("chain budget past the block", lambda m, t: spec(m, method="chain", budget=9),
     "budget 9 is more than a chain tree can hold: at most 5 draft nodes (one node per drafted position, "
     "block_size - 1 = 5)"),
    ("weaver budget past its tree", lambda m, t: spec(m, method="weaver", budget=63, adapter=m.adapter, children=2),
     "budget 63 is more than a weaver tree can hold: at most 62 draft nodes (depth 5 x 2 children per node)"),
    ("ddtree budget past its tree",  # a block of 2: one drafted position, so at most every token of the vocabulary
     lambda m, t: spec(m, method="ddtree", budget=98, drafter=Drafter(drafter_config(new_drafter_config(m.target, 1, 2, 2))),),
     "budget 98 is more than a ddtree tree can hold: at most 97 draft nodes (depth 1 x vocabulary 97)"),
    ("budget: auto candidate past the chain",
     lambda m, t: spec(m, budget=BudgetPlanner({2: 1.0, 8: 2.0})),
     "budget 8 is more than a chain tree can hold: at most 5 draft nodes"),
    ("budget: auto candidate 0", lambda m, t: BudgetPlanner({0: 1.0, 4: 2.0}),
     "budget: auto needs candidate budgets that are whole numbers >= 1, got [0, 4]"),
    ("no budget: auto candidates", lambda m, t: measure_step_costs(lambda b: [1.0], []),
     "eval.auto_budget.candidates must be numbers of draft nodes (>= 1)"),
    ("eval.budgets entries", lambda m, t: check_budgets([4, 0, 2.5, True, "auto"]),
     "eval.budgets entries are numbers of draft nodes (>= 1) or 'auto', got [0, 2.5, True]"),
    ("eval.seed not a number", lambda m, t: check_names(eval_config(seed="x")),
     "eval.seed must be a whole number >= 0, got 'x'"),
    ("unknown eval.rrs_priority", lambda m, t: check_names(eval_config(rrs_priority="learned")),
     "eval.rrs_priority must be one of ['draft', 'acceptance'], got 'learned'"),
    ("eval.draft_temperature 0", lambda m, t: check_names(eval_config(draft_temperature=0)),
     "eval.draft_temperature must be a finite number > 0 or null, got 0"),
    ("eval.draft_temperature not a number", lambda m, t: check_names(eval_config(draft_temperature="sharp")),
     "eval.draft_temperature must be a finite number > 0 or null, got 'sharp'"),
    ("eval.fixed_children negative", lambda m, t: check_names(eval_config(fixed_children=-1)),
     "eval.fixed_children must be a whole number >= 0, got -1"),
    ("fixed children with traversal verification", lambda m, t: check_names(eval_config(fixed_children=1, sampling="traversal")),
     "eval.fixed_children needs eval.sampling=rrs, got 'traversal'"),
    ("SGLang backend asked to sample greedy trees", lambda m, t: check_sglang_eval(eval_config(sampling="target_only")),
     "eval.backend=sglang draws sampled requests' trees: eval.sampling must be one of ['rrs', 'traversal'], got 'target_only'"),
    ("fixed children for speculative_generate with traversal",
     lambda m, t: spec(m, method="ddtree", budget=4, temperature=1.0, sampling="traversal", fixed_children=1),
     "fixed_children needs sampling 'rrs' (it reaches fixed children by its residual draw), got 'traversal'"),
    ("eval.prepack not a boolean", lambda m, t: check_names(eval_config(prepack="yes")),
     "eval.prepack must be true or false, got 'yes'"),
    ("unknown eval.backend", lambda m, t: check_names(eval_config(backend="vllm")),
     "eval.backend must be one of ['torch', 'sglang'], got 'vllm'"),
    ("SGLang backend asked for the oracle", lambda m, t: check_sglang_eval(eval_config(methods=["ar", "oracle"])),
     "eval.backend=sglang measures ['ar', 'chain', 'ddtree', 'weaver'], not ['oracle']"),
    ("SGLang backend asked for budget auto", lambda m, t: check_sglang_eval(eval_config(budgets=[4, "auto"])),
     "eval.backend=sglang needs fixed budgets (whole numbers >= 1), got [4, 'auto']"),
    ("SGLang concurrency 0", lambda m, t: check_sglang_eval(eval_config(sglang={"concurrency": [1, 0]})),
     "eval.sglang.concurrency must list whole numbers >= 1, got [1, 0]"),
    ("SGLang interpreter missing", lambda m, t: sglang_python(eval_config(sglang={"python": "/no/such/python"})),
     "eval.sglang.python: no interpreter at /no/such/python"),
    # --- Weaver search settings ---
    ("more search children than the adapter's pool", lambda m, t: spec(m, method="weaver", budget=8, adapter=m.adapter, children=32),
     "weaver.search.children=32 is more than the adapter's pool of 16 candidates per position (weaver.search.pool, default its weaver.pool_size): at most 16"),
    ("zero search children", lambda m, t: spec(m, method="ddtree", budget=4, children=0),
     "weaver.search.children must be a whole number >= 1, got 0"),
    ("zero nodes per call", lambda m, t: spec(m, method="weaver", budget=4, adapter=m.adapter, nodes_per_call=0),
     "weaver.search.nodes_per_call must be a whole number >= 1 or null, got 0"),
    ("zero rescore", lambda m, t: spec(m, method="weaver", budget=4, adapter=m.adapter, rescore=0),
     "weaver.search.rescore must be a whole number >= 1 or null, got 0"),
    ("adapter pool size 0", lambda m, t: AdapterConfig(64, VOCAB, 5, pool_size=0),
     "adapter pool_size must be a whole number >= 1, got 0"),
    # --- prompts and lengths ---
    ("empty prompt", lambda m, t: spec(m, prompt=[]), "every prompt must contain at least one token"),
    ("token id outside the vocabulary", lambda m, t: spec(m, prompt=[5, VOCAB]),
     "prompt token id 97 is outside the target's vocabulary (0..96)"),
    ("prompt longer than the context", lambda m, t: spec(m, prompt=[5] * 600),
     "prompt of 600 tokens is longer than the target's context (max_position_embeddings 512)"),
    ("prompt + max_new_tokens past the context", lambda m, t: spec(m, prompt=[5] * 500, max_new_tokens=20),
     "prompt of 500 tokens + max_new_tokens 20 exceeds the target's context (max_position_embeddings 512)"),
    ("negative max_new_tokens", lambda m, t: spec(m, max_new_tokens=-1), "max_new_tokens must be a whole number >= 0, got -1"),
    ("negative temperature", lambda m, t: spec(m, temperature=-1.0),
     "temperature must be a finite number >= 0 (0: greedy), got -1.0"),
    ("infinite draft temperature", lambda m, t: spec(m, temperature=1.0, draft_temperature=float("inf")),
     "draft_temperature must be a finite number > 0 or null, got inf"),
    ("prompt_tokens 0", lambda m, t: encode_prompts(None, None, 2, 0), "prompt_tokens must be a whole number >= 1, got 0"),
    # --- NaN / inf during decoding ---
    ("NaN in the target's weights", lambda m, t: speculative_generate(nan_in(m.target, "norm.weight"), m.drafter, PROMPT, 8),
     "the target's logits contain NaN at the prefill (3 prompt tokens): the model's weights or activations are not finite"),
    ("inf in the target's verify logits", lambda m, t: target_inf_at_verify(m),
     "the target's logits contain inf at speculative step 1 (verify of 5 tree nodes)"),
    ("NaN in the drafter", lambda m, t: spec(m, drafter=nan_in(m.drafter, "norm.weight")),
     "the drafter's logits contain NaN at speculative step 1"),
    ("NaN in the adapter", lambda m, t: spec(m, method="weaver", budget=4, adapter=nan_in(m.adapter, "query.weight")),
     "the Weaver adapter's scores contain NaN at speculative step 1"),
    # --- unknown names ---
    ("unknown method", lambda m, t: spec(m, method="beam"), "unknown tree method 'beam'; available: chain, ddtree, weaver, oracle"),
    ("unknown sampling rule", lambda m, t: spec(m, temperature=1.0, sampling="nope"),
     "unknown sampling rule 'nope'; available: rrs, traversal, target_only"),
    ("weaver without an adapter", lambda m, t: spec(m, method="weaver", budget=4),
     "method 'weaver' needs a trained adapter"),
    ("unknown dataset", lambda m, t: prompt_set("nope"), "unknown dataset 'nope'; defined in conf/prompt_sets: humaneval"),
    ("unknown prompt set kind", lambda m, t: prompt_set("humaneval", kind="csv"), "prompt set 'humaneval' has unknown kind 'csv'"),
    ("model_type transformers does not know", broken_target(set_json("config.json", model_type="foobar")),
     "does not recognize this architecture"),
    ("model_type we do not support", broken_target(set_json("config.json", model_type="gpt2")),
     "unsupported model_type 'gpt2'; supported: llama, qwen3, qwen3_5_text, qwen3_5"),
    # --- broken files ---
    ("truncated safetensors", broken_target(truncate("model.safetensors")), "corrupt weights file"),
    ("safetensors that is not one", broken_target(write("model.safetensors", b"\0" * 64)), "corrupt weights file"),
    ("config.json that does not parse", broken_target(write("config.json", "{not json")), "is not a valid JSON file"),
    ("config.json field of the wrong type", broken_target(set_json("config.json", hidden_size="abc")),
     "cannot read config in"),
    ("shard index that does not parse", broken_target(write("model.safetensors.index.json", "{oops")),
     "corrupt shard index"),
    ("pickle weights only (pytorch_model.bin)", broken_target(pickled_only),
     "pytorch_model.bin is a pickle file, which is never loaded (convert it to safetensors)"),
    ("truncated drafter safetensors", broken_drafter(truncate("model.safetensors")), "corrupt weights file"),
    ("drafter config with bad tapped layers",
     broken_drafter(set_json("config.json", dflash_config={"target_layer_ids": "all", "mask_token_id": 2})),
     "drafter dflash_config.target_layer_ids must be a non-empty list of layer indices, got 'all'"),
    ("adapter config.json that does not parse", broken_adapter(write("config.json", "{")),
     "is not a readable Weaver adapter checkpoint"),
    ("adapter config with pool size 0", broken_adapter(adapter_sizes(pool_size=0)),
     "is not a valid Weaver adapter checkpoint: adapter pool_size must be a whole number >= 1, got 0"),
    ("truncated adapter safetensors", broken_adapter(truncate("model.safetensors")),
     "is not a readable Weaver adapter checkpoint"),
]


@pytest.mark.parametrize("name,case,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_one_clear_error(models, tmp_path, name, case, message):
    with pytest.raises(WeaverError) as caught:
        case(models, tmp_path)
    text = str(caught.value)
    assert message in text, text
    assert "\n" not in text, "one line"


# --- artifacts record their tokenizer; older ones and matching ones load --------------------------------


def test_matching_or_missing_tokenizer_fingerprints_load(models, tmp_path):
    sha = tokenizer_fingerprint(word_tokenizer(VOCAB))
    assert sha == tokenizer_fingerprint(load_tokenizer(models.folder, models.target))  # a saved tokenizer: the same
    for folder, given in ((drafter_for(models.target, tmp_path / "a", tokenizer_sha256=sha), sha),
                          (drafter_for(models.target, tmp_path / "b"), None)):
        assert load_drafter(str(folder), models.target).cfg.tokenizer_sha256 == given
        assert (json.loads((folder / "config.json").read_text()).get("tokenizer_sha256")) == given
    adapter = load_adapter(adapter_for(tmp_path / "c", sha=sha), models.target, BLOCK - 1)
    assert adapter.tokenizer_sha256 == sha
    assert load_adapter(adapter_for(tmp_path / "d"), models.target, BLOCK - 1).tokenizer_sha256 is None
    # a target without a saved tokenizer: nothing to compare with, the artifact loads
    bare = tmp_path / "bare"
    save_tiny_hf_model("qwen3", bare)
    other = drafter_for(models.target, tmp_path / "e", tokenizer_sha256="0" * 64)
    load_drafter(str(other), load_target(str(bare)))


def test_the_fingerprint_tells_vocabularies_apart():
    a, b = word_tokenizer(VOCAB), word_tokenizer(VOCAB, "w")
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(word_tokenizer(VOCAB)) != tokenizer_fingerprint(b)
    assert re.fullmatch(r"[0-9a-f]{64}", tokenizer_fingerprint(a))


def test_the_nan_check_raises_only_for_nan_or_inf():
    """The per-step check sums the logits first: an overflowing sum of finite values is no false alarm, and a
    bf16 model's error suggests float32."""
    check_finite(torch.full((4, 8), 3e38), "logits", "here")  # the sum overflows; every value is finite
    lowest = torch.finfo(torch.bfloat16).min  # a reduced draft vocabulary's other tokens
    check_finite(torch.tensor([[lowest] * 5 + [2.0]] * 3, dtype=torch.bfloat16), "logits", "here")
    for bad in (math.inf, -math.inf, math.nan):  # wherever it sits among the sentinels and however the sum ends
        for at in (0, 3, 5):
            row = torch.tensor([lowest] * 5 + [2.0])
            row[at] = bad
            with pytest.raises(WeaverError, match="NaN" if bad != bad else "inf"):
                check_finite(row, "logits", "here")
    check_finite(torch.tensor([-math.inf, 0.0]), "scores", "here", nan_only=True)  # -inf scores are allowed there
    with pytest.raises(WeaverError, match=r"logits contain inf here: an overflow in bfloat16 or broken weights: try "
                                          r"model.dtype=float32"):
        check_finite(torch.tensor([1.0, math.inf], dtype=torch.bfloat16), "logits", "here")
    with pytest.raises(WeaverError, match="scores contain NaN"):
        check_finite(torch.tensor([math.inf, -math.inf, math.nan]), "scores", "here", nan_only=True)
    # a bf16 drafter's logits arrive cast to an fp32 target's dtype: the hint names the drafter's setting
    with pytest.raises(WeaverError, match=r"an overflow in bfloat16 or broken weights: try drafter.dtype=float32"):
        check_finite(torch.tensor([1.0, math.inf]), "logits", "here", computed_in=torch.bfloat16, setting="drafter.dtype")


# --- no pickle ----------------------------------------------------------------------------------------------

UNPICKLING = re.compile(r"\btorch\.load\b|\bimport pickle\b|\bpickle\.loads?\b|\bdill\b|\bjoblib\b|allow_pickle\s*=\s*True"
                        r"|weights_only\s*=\s*False|\bcloudpickle\b")


def test_no_code_of_ours_unpickles_a_file():
    """Weights come from safetensors (and GGUF through transformers); nothing in weaver/ (kernels included), the entry
    points or the benchmarks calls torch.load or pickle (accelerate's resume reads its own checkpoints with
    weights_only=True)."""
    files = [p for d in ("weaver", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    files += [ROOT / "train.py", ROOT / "eval.py"]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if UNPICKLING.search(line)]
    assert not hits, hits


# --- the CLI: one line, exit status 2 -----------------------------------------------------------------------


def test_cli_prints_one_error_line(tmp_path):
    """eval.py refuses bad budgets before loading anything: no trained pipeline needed."""
    done = run_script("eval.py", tmp_path, "+experiment=smoke", "eval.budgets=[4,0,2.5]")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == "error: eval.budgets entries are numbers of draft nodes (>= 1) or 'auto', got [0, 2.5]", last
