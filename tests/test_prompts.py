"""Prompt sets (weaver.data.prompts): offline sets, hub configs, chat templates, truncation, clear errors."""

from __future__ import annotations

import json

import datasets
import pytest
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from weaver.data.prompts import encode_prompts, encode_text, field_text, load_prompt_set
from weaver.errors import WeaverError
from weaver.pipeline import ROOT_CONF

TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def cfg_with(**extra_sets):
    """The shipped prompt-set configs (conf/prompt_sets/default.yaml), plus test sets."""
    sets = OmegaConf.merge(OmegaConf.load(ROOT_CONF / "prompt_sets" / "default.yaml"), extra_sets)
    return OmegaConf.create({"prompt_sets": sets, "model": {"source": "hf"}})


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no chat template (like the tiny target's BPE): one token per byte."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("name,size", [("humaneval", 164), ("mtbench", 80), ("gsm_symbolic", 100),
                                       ("train_logic", 1000)])
def test_offline_sets_load_with_their_fixed_size_and_order(name, size):
    rows = load_prompt_set(cfg_with(), name)
    assert len(rows) == size and all(isinstance(p, str) and p.strip() for p in rows["prompt"])
    assert load_prompt_set(cfg_with(), name)["prompt"] == rows["prompt"]  # the seed fixes the sample


def test_mtbench_takes_first_turns():
    rows = load_prompt_set(cfg_with(mtbench={"seed": None}), "mtbench")
    assert rows["prompt"][0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def test_rollout_prompts_leave_out_the_evaluation_prompts(byte_tokenizer):
    from weaver.data.rollouts import set_prompts

    cfg = cfg_with()
    evaluation = set(load_prompt_set(cfg, "gsm_symbolic")["prompt"])
    generated = load_prompt_set(cfg, "train_math")["prompt"]
    assert evaluation & set(generated), "another seed of the same generator repeats a few problems"
    cfg.model.chat_template_kwargs = {}
    cfg.rollouts = {"prompts": ["train_math", "train_code"], "exclude": ["gsm_symbolic"], "n_prompts": 2001,
                    "prompt_tokens": 100_000}
    prompts = set_prompts(cfg, byte_tokenizer)
    texts = {byte_tokenizer.decode(p) for p in prompts}
    assert len(prompts) == 2001 and not texts & evaluation
    assert sum(t.startswith("Implement `") for t in texts) == 1000  # spread evenly: 1001 + 1000


def test_sets_that_run_short_give_their_share_to_the_others():
    from weaver.data.rollouts import spread

    assert spread(10, [5, 5, 5]) == [4, 3, 3]  # even, the first sets take the remainder
    assert spread(7000, [2000, 1000, 1000, 1000, 2200, 615]) == [1693, 1000, 1000, 1000, 1692, 615]
    assert spread(9, [1, 10, 3]) == [1, 5, 3]
    assert spread(2, [4, 4, 4]) == [1, 1, 0]
    with pytest.raises(WeaverError, match="hold 6 prompts in all .* fewer than rollouts.n_prompts=7"):
        spread(7, [3, 3])
    for bad in (0, -3, 2.5):
        with pytest.raises(WeaverError, match="n_prompts must be a whole number"):
            spread(bad, [3, 3])


def test_rollout_prompts_take_all_of_a_short_set(byte_tokenizer):
    from weaver.data.rollouts import set_prompts

    cfg = cfg_with(train_math={"size": 30})
    cfg.model.chat_template_kwargs = {}
    cfg.rollouts = {"prompts": ["train_math", "train_code"], "exclude": [], "n_prompts": 100, "prompt_tokens": 100_000}
    texts = [byte_tokenizer.decode(p) for p in set_prompts(cfg, byte_tokenizer)]
    assert len(texts) == 100 and sum(t.startswith("Implement `") for t in texts) == 70


def test_stdlib_functions_are_implement_requests():
    rows = load_prompt_set(cfg_with(train_code={"size": 50}), "train_code")
    assert len(rows) == 50 and all(p.startswith("Implement `") and " module: " in p for p in rows["prompt"])


def test_prose_requests_are_chat_requests_on_running_prose():
    from weaver.data.prompts import PROSE_REQUESTS

    rows = load_prompt_set(cfg_with(), "train_prose")["prompt"]
    assert len(rows) > 300 and rows == load_prompt_set(cfg_with(), "train_prose")["prompt"]
    passages = [p.removeprefix("Here is a passage:\n\n").rsplit("\n\n", 1) for p in rows]
    assert all(request in PROSE_REQUESTS for _, request in passages)
    assert {request for _, request in passages} == set(PROSE_REQUESTS)
    assert all(25 <= len(text.split()) <= 70 and "\n" not in text and "::=" not in text for text, _ in passages)
    assert any("Fritz Napoleon Smith" in text for text, _ in passages)  # the story, without its licence header
    assert any("namespace" in text for text, _ in passages)             # the language reference
    assert not any("Gutenberg" in text for text, _ in passages)


def test_unknown_reasoning_gym_task_is_one_clear_error():
    with pytest.raises(WeaverError, match="reasoning_gym cannot make task 'no_such_task'"):
        load_prompt_set(cfg_with(bad={"kind": "reasoning_gym", "task": "no_such_task", "seed": 0, "size": 2}), "bad")


def test_chat_template_options_reach_the_template(byte_tokenizer):
    template = "{% if enable_thinking is defined and not enable_thinking %}<|nothink|>{% endif %}" + TEMPLATE
    templated = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer.backend_tokenizer, chat_template=template)
    assert templated.decode(encode_text(templated, "hi", {"enable_thinking": False})).startswith("<|nothink|>")
    assert templated.decode(encode_text(templated, "hi")) == "<|user|>hi<|assistant|>"


def test_plain_text_without_a_chat_template(byte_tokenizer):
    assert byte_tokenizer.decode(encode_text(byte_tokenizer, "def f(x):")) == "def f(x):"


def test_chat_template_wraps_the_prompt_as_a_user_turn(byte_tokenizer):
    templated = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer.backend_tokenizer, chat_template=TEMPLATE)
    assert templated.decode(encode_text(templated, "hi")) == "<|user|>hi<|assistant|>"


def test_long_prompts_are_left_truncated_or_skipped(byte_tokenizer):
    rows = datasets.Dataset.from_dict({"prompt": ["a" * 10 + "END", "short", "", "b" * 20 + "END"]})
    truncated = encode_prompts(rows, byte_tokenizer, 3, prompt_tokens=6)
    assert [byte_tokenizer.decode(p) for p in truncated] == ["aaaEND", "short", "bbbEND"]  # the empty one is dropped
    kept = encode_prompts(rows, byte_tokenizer, 1, prompt_tokens=6, long_prompts="skip")
    assert [byte_tokenizer.decode(p) for p in kept] == ["short"]
    with pytest.raises(WeaverError, match="only 1 usable prompts .* fewer than the 2 asked for"):
        encode_prompts(rows, byte_tokenizer, 2, prompt_tokens=6, long_prompts="skip")
    with pytest.raises(WeaverError, match="long_prompts must be one of"):
        encode_prompts(rows, byte_tokenizer, 1, prompt_tokens=6, long_prompts="cut")


def test_pretokenized_rows_keep_their_opening(byte_tokenizer):
    rows = datasets.Dataset.from_dict({"input_ids": [list(range(10)), list(range(5, 9))]})
    assert encode_prompts(rows, byte_tokenizer, 2, prompt_tokens=3) == [[0, 1, 2], [5, 6, 7]]


def test_field_paths_reach_nested_text():
    row = {"question": "q", "turns": ["first", "second"], "conversations": [{"from": "human", "value": "hello"}]}
    assert [field_text(row, f) for f in ("question", "turns.1", "conversations.0.value")] == ["q", "second", "hello"]
    with pytest.raises(WeaverError, match="is a list, not text"):
        field_text(row, "turns")


def test_a_hub_set_loads_from_a_local_copy(tmp_path):
    lines = [{"problem": {"text": f"problem {i}"}} for i in range(5)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    spec = {"kind": "hub", "hub_id": str(tmp_path), "config": None, "split": "test", "field": "problem.text", "seed": None, "size": 3}
    assert load_prompt_set(cfg_with(local=spec), "local")["prompt"] == ["problem 0", "problem 1", "problem 2"]
    with pytest.raises(WeaverError, match="has no field 'problem.nope'"):
        load_prompt_set(cfg_with(local={**spec, "field": "problem.nope"}), "local")


def test_an_unreachable_hub_set_is_one_clear_error(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(WeaverError, match=r"^hub dataset openai/gsm8k \(split test\) cannot be loaded: Couldn't reach") as err:
        load_prompt_set(cfg_with(), "gsm8k")
    assert "\n" not in str(err.value)


def test_every_paper_hub_set_is_configured():
    sets = cfg_with().prompt_sets
    paper = ("gsm8k", "math500", "aime25", "humaneval_hub", "mbpp", "livecodebench", "mtbench_hub", "sharechat")
    assert all(sets[name].kind == "hub" and sets[name].hub_id and sets[name].field for name in paper)


def test_unknown_set_and_kind_are_clear_errors():
    with pytest.raises(WeaverError, match="unknown dataset 'nope'; defined in conf/prompt_sets: heldout_code, humaneval"):
        load_prompt_set(cfg_with(), "nope")
    with pytest.raises(WeaverError, match="unknown kind 'csv'"):
        load_prompt_set(cfg_with(odd={"kind": "csv"}), "odd")


def test_heldout_code_needs_a_target_trained_here():
    with pytest.raises(WeaverError, match="needs a target trained here"):
        load_prompt_set(cfg_with(), "heldout_code")
