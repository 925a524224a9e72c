"""Offline corpus stage: collection, split, tokenizer, packing, atomic build."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from weaver.errors import WeaverError
from weaver.data import corpus
from weaver.data.corpus import (
    build_corpus,
    collect_documents,
    pack_sequences,
    split_documents,
    train_tokenizer,
)

MAX_BYTES = 300_000
VOCAB = 512
SKIPPED_DIRS = {"site-packages", "test", "tests", "idlelib"}

ROUND_TRIP_TEXTS = [
    "def f(x):\n\treturn x + 1\n",
    "    # héllo wörld — ünïcödé 🐍 …\n\n\n",
    "\t\t mixed  \t whitespace \r\n trailing   ",
    "s = 'ça va?' ; print(s , end='') .  ",
    "中文字符 and émojis 🎉🎉",
    "",
]


@pytest.fixture(scope="module")
def small_docs() -> list[dict]:
    return collect_documents(["python_stdlib"], max_bytes=MAX_BYTES)


@pytest.fixture(scope="module")
def tokenizer(small_docs):
    return train_tokenizer((d["text"] for d in small_docs), VOCAB)


def _size(docs: list[dict]) -> int:
    return sum(len(d["text"].encode("utf-8")) for d in docs)


# --- collection ---------------------------------------------------------------------------------


def test_stdlib_collection_is_deterministic_and_skips_tests():
    docs = collect_documents(["python_stdlib"])
    assert len(docs) > 100
    assert docs == collect_documents(["python_stdlib"])
    paths = [d["path"] for d in docs]
    assert paths == sorted(paths)
    assert all(p.endswith(".py") for p in paths)
    assert all(d["source"] == "python_stdlib" and d["text"] for d in docs)
    assert not [p for p in paths if SKIPPED_DIRS.intersection(p.split("/")[:-1])]
    assert "json/__init__.py" in paths  # package contents are collected, not just top-level files


def test_max_bytes_caps_a_deterministic_prefix(small_docs):
    assert small_docs
    assert _size(small_docs) <= MAX_BYTES
    full = collect_documents(["python_stdlib"])
    assert small_docs == full[: len(small_docs)]
    assert _size(full[: len(small_docs) + 1]) > MAX_BYTES  # stopped only because the cap was hit


def test_unknown_source_lists_valid_names():
    with pytest.raises(WeaverError, match="python_stdlib") as err:
        collect_documents(["wikipedia"])
    assert "python_docs" in str(err.value)


def test_missing_python_docs_names_paths_and_fix(monkeypatch, tmp_path):
    looked = (tmp_path / "a" / "_sources", tmp_path / "b" / "_sources")
    monkeypatch.setattr(corpus, "DOCS_DIRS", looked)
    with pytest.raises(FileNotFoundError) as err:
        collect_documents(["python_stdlib", "python_docs"], max_bytes=1000)
    message = str(err.value)
    assert all(str(p) in message for p in looked)
    assert "apt-get install python3.11-doc" in message


def test_python_docs_read_from_first_existing_dir(monkeypatch, tmp_path):
    root = tmp_path / "_sources"
    (root / "library").mkdir(parents=True)
    (root / "library" / "json.rst.txt").write_text(":mod:`json` --- JSON\n=====\n", encoding="utf-8")
    (root / "index.rst.txt").write_text("Python docs\n", encoding="utf-8")
    (root / "bad.txt").write_bytes(b"\xff\xfe not utf-8 \x80")
    (root / "image.png").write_bytes(b"png")
    monkeypatch.setattr(corpus, "DOCS_DIRS", (tmp_path / "missing", root))
    docs = collect_documents(["python_docs"])
    assert [(d["source"], d["path"]) for d in docs] == [
        ("python_docs", "index.rst.txt"),
        ("python_docs", "library/json.rst.txt"),
    ]


# --- split --------------------------------------------------------------------------------------


def test_split_is_by_document_deterministic_and_nonempty(small_docs):
    train, val = split_documents(small_docs, 0.01, seed=0)
    assert len(val) == 1  # at least one held-out document even when the fraction rounds to 0
    assert (train, val) == split_documents(small_docs, 0.01, seed=0)
    assert sorted(d["path"] for d in train + val) == sorted(d["path"] for d in small_docs)
    assert not {d["path"] for d in train} & {d["path"] for d in val}
    assert split_documents(small_docs, 0.0, seed=0) == (list(small_docs), [])
    seeds = {tuple(d["path"] for d in split_documents(small_docs, 0.3, seed=s)[1]) for s in range(5)}
    assert len(seeds) > 1


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_special_tokens(tokenizer):
    assert len(tokenizer) == VOCAB
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|pad|>", "<|mask|>"]
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 0)
    assert (tokenizer.pad_token_id, tokenizer.mask_token_id) == (1, 2)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trip_is_exact(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_learned_merges(tokenizer, small_docs):
    text = small_docs[-1]["text"]
    assert len(tokenizer.encode(text)) < len(text.encode("utf-8")) / 2


def test_tokenizer_save_load_round_trip(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in ROUND_TRIP_TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    assert (loaded.eos_token, loaded.bos_token, loaded.pad_token, loaded.mask_token) == (
        "<|endoftext|>",
        "<|endoftext|>",
        "<|pad|>",
        "<|mask|>",
    )


def test_tokenizer_rejects_vocab_below_byte_alphabet():
    with pytest.raises(WeaverError, match="at least"):
        train_tokenizer(["abc"], 100)


# --- packing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [7, 64])
def test_pack_keeps_every_token_in_order(small_docs, tokenizer, seq_len):
    ds = pack_sequences(small_docs, tokenizer, seq_len)
    eos = tokenizer.eos_token_id
    expected = [t for d in small_docs for t in tokenizer.encode(d["text"], add_special_tokens=False) + [eos]]
    rows = ds["input_ids"]
    assert len(rows) == len(expected) // seq_len  # only a tail shorter than one row is dropped
    assert all(len(r) == seq_len for r in rows)
    packed = list(itertools.chain.from_iterable(rows))
    assert packed == expected[: len(packed)]
    assert packed.count(eos) == expected[: len(packed)].count(eos) > 0


# --- build_corpus -------------------------------------------------------------------------------


def _build(out_dir: Path) -> None:
    build_corpus(["python_stdlib"], MAX_BYTES, VOCAB, 64, 0.2, 0, out_dir)


def test_build_corpus_writes_everything(tmp_path, capsys):
    out = tmp_path / "corpus"
    _build(out)
    assert len(capsys.readouterr().out.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]

    dd = datasets.load_from_disk(str(out / "dataset"))
    assert set(dd) == {"train", "validation"}
    assert len(dd["train"]) > 0 and len(dd["validation"]) > 0
    assert all(len(r) == 64 for r in dd["validation"]["input_ids"])

    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert len(tok) == VOCAB and tok.eos_token_id == 0

    splits = json.loads((out / "splits.json").read_text())
    train_paths = {d["path"] for d in splits["train"]}
    val_paths = {d["path"] for d in splits["validation"]}
    assert train_paths and val_paths and not train_paths & val_paths

    stats = json.loads((out / "stats.json").read_text())
    assert stats["n_docs"] == {"train": len(train_paths), "validation": len(val_paths)}
    assert stats["n_tokens"] == {name: len(ds) * 64 for name, ds in dd.items()}
    assert sum(stats["bytes"].values()) == _size(collect_documents(["python_stdlib"], MAX_BYTES))
    assert stats["vocab_size"] == VOCAB
    assert 1.0 < stats["bytes_per_token"] < 8.0

    with pytest.raises(FileExistsError):
        _build(out)


def test_build_corpus_crash_leaves_nothing(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while packing")

    monkeypatch.setattr(corpus, "pack_sequences", crash)
    out = tmp_path / "corpus"
    with pytest.raises(RuntimeError, match="simulated crash"):
        _build(out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no .tmp-<pid> sibling left behind
