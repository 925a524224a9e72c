"""Offline training corpus for the tiny from-scratch target (docs/method.md §4).

No hub is reachable, so the corpus is built from text already on disk (the
Python standard library, Debian's python3.11-doc reST sources), a byte-level
BPE is trained on it, and documents are packed into fixed-length rows.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import datasets
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from weaver.errors import WeaverError
from weaver.io import atomic_dir

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
# Order matters: the trainer assigns ids 0, 1, 2 in this order.
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)

# Directory names never taken from the stdlib: installed third-party code, the
# regression tests (huge, repetitive, partly deliberately malformed) and IDLE.
# lib2to3/tests is covered by "tests".
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})

# Where Debian's python3.11-doc / python3-doc put the reST sources; a module
# attribute so tests can point it elsewhere.
DOCS_DIRS: tuple[Path, ...] = (
    Path("/usr/share/doc/python3.11/html/_sources"),
    Path("/usr/share/doc/python3-doc/html/_sources"),
)

_TEXT_FEATURES = datasets.Features({"text": datasets.Value("string")})
_IDS_FEATURES = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})


def _read_utf8(path: Path) -> str | None:
    """File text, or None for files that are not UTF-8 (a few stdlib fixtures)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def _documents_under(root: Path, suffix: str, source: str, skip_dirs: frozenset[str]) -> Iterator[dict]:
    """Documents under root whose name ends with suffix, sorted by relative path (reproducible).

    Skipped directories are pruned during the walk: site-packages can hold
    hundreds of thousands of files. Blank files (empty __init__.py) are left
    out: they would only add back-to-back eos tokens.
    """
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        rel_dir = Path(dirpath).relative_to(root)
        rels += [(rel_dir / f).as_posix() for f in filenames if f.endswith(suffix)]
    for rel in sorted(rels):
        text = _read_utf8(root / rel)
        if text is not None and text.strip():
            yield {"text": text, "source": source, "path": rel}


def _stdlib_documents() -> Iterator[dict]:
    """The running interpreter's stdlib .py files: real code with no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return _documents_under(root, ".py", "python_stdlib", _STDLIB_SKIP_DIRS)


def _docs_documents() -> Iterator[dict]:
    """Python's reST documentation (English prose), from the first docs directory present."""
    for root in DOCS_DIRS:
        if root.is_dir():
            return _documents_under(root, ".txt", "python_docs", frozenset())
    looked = ", ".join(str(p) for p in DOCS_DIRS)
    raise FileNotFoundError(
        f"python_docs: no reST sources found (looked in {looked}); "
        "install them with `apt-get install python3.11-doc`"
    )


_SOURCES = {"python_stdlib": _stdlib_documents, "python_docs": _docs_documents}


def collect_documents(sources: Sequence[str], max_bytes: int | None = None) -> list[dict]:
    """Documents {"text", "source", "path"} from the named offline sources, in a fixed order.

    max_bytes caps the total UTF-8 size: collection stops at the first document
    that would exceed it, so the result is a deterministic prefix.
    """
    unknown = [s for s in sources if s not in _SOURCES]
    if unknown:
        raise WeaverError(f"unknown corpus source(s) {unknown}; valid: {sorted(_SOURCES)}")
    streams = [_SOURCES[s]() for s in sources]  # fail on a missing source even if the cap hits first
    docs: list[dict] = []
    total = 0
    for doc in itertools.chain.from_iterable(streams):
        size = len(doc["text"].encode("utf-8"))
        if max_bytes is not None and total + size > max_bytes:
            break
        docs.append(doc)
        total += size
    return docs


def split_documents(docs: Sequence[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, validation) split by whole document, so validation files are truly held out.

    Deterministic for a given seed; each split keeps the input order.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise WeaverError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = max(1, round(len(docs) * val_fraction)) if val_fraction > 0 else 0
    if n_val and n_val >= len(docs):
        raise WeaverError(f"cannot hold out {n_val} of {len(docs)} documents and keep a train split")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    val_idx = set(order[:n_val])
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    return train, val


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on texts; lossless on any string (code, unicode, tabs).

    Special tokens get ids 0, 1, 2: <|endoftext|> (bos/eos), <|pad|>, <|mask|>
    (the block drafter's mask token).
    """
    min_vocab = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise WeaverError(f"vocab_size must be at least {min_vocab} (bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        # Cleanup would rewrite " ." etc. and break exact round-trips of code.
        clean_up_tokenization_spaces=False,
    )


def pack_sequences(docs: Sequence[dict], tokenizer: PreTrainedTokenizerFast, seq_len: int) -> datasets.Dataset:
    """Rows of exactly seq_len token ids: documents joined with eos, short tail dropped.

    Packing wastes no compute on padding; documents may span row boundaries.
    """
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict) -> dict:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    texts = datasets.Dataset.from_list([{"text": d["text"]} for d in docs], features=_TEXT_FEATURES)
    tokenized = texts.map(tokenize, batched=True, remove_columns=["text"], desc="tokenize")
    flat = np.fromiter(itertools.chain.from_iterable(tokenized["input_ids"]), dtype=np.int32)
    n_rows = len(flat) // seq_len
    rows = flat[: n_rows * seq_len].reshape(n_rows, seq_len)
    return datasets.Dataset.from_dict({"input_ids": rows}, features=_IDS_FEATURES)



def _bytes_per_token(docs: Sequence[dict], tokenizer: PreTrainedTokenizerFast) -> float:
    """UTF-8 bytes per token (no eos) over docs: the tokenizer's compression rate."""
    texts = [d["text"] for d in docs]
    n_tokens = sum(len(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return sum(len(t.encode("utf-8")) for t in texts) / max(n_tokens, 1)


def _write_corpus(tmp_dir: Path, sources: Sequence[str], max_bytes: int | None, vocab_size: int, seq_len: int,
                  val_fraction: float, seed: int) -> dict:
    """Build everything into tmp_dir and return the stats written to stats.json."""
    docs = collect_documents(sources, max_bytes)
    if not docs:
        raise WeaverError(f"no documents collected from {list(sources)} (max_bytes={max_bytes})")
    train, val = split_documents(docs, val_fraction, seed)
    tokenizer = train_tokenizer((d["text"] for d in train), vocab_size)
    splits = {"train": train, "validation": val}
    packed = datasets.DatasetDict({name: pack_sequences(split, tokenizer, seq_len) for name, split in splits.items()})
    tokenizer.save_pretrained(tmp_dir / "tokenizer")
    packed.save_to_disk(str(tmp_dir / "dataset"))
    stats = {
        "sources": list(sources),
        "n_docs": {name: len(split) for name, split in splits.items()},
        "bytes": {name: sum(len(d["text"].encode("utf-8")) for d in split) for name, split in splits.items()},
        "n_rows": {name: len(ds) for name, ds in packed.items()},
        "n_tokens": {name: len(ds) * seq_len for name, ds in packed.items()},
        "seq_len": seq_len,
        "vocab_size": len(tokenizer),
        # Measured on held-out documents when there are any: the honest compression rate.
        "bytes_per_token": _bytes_per_token(val or train, tokenizer),
    }
    (tmp_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    # Which files were held out, so evaluation can be traced to unseen documents.
    split_paths = {name: [{"source": d["source"], "path": d["path"]} for d in split] for name, split in splits.items()}
    (tmp_dir / "splits.json").write_text(json.dumps(split_paths, indent=1) + "\n")
    return stats


def build_corpus(sources: Sequence[str], max_bytes: int | None, vocab_size: int, seq_len: int, val_fraction: float,
                 seed: int, out_dir: Path) -> None:
    """The whole data stage: out_dir/{tokenizer/, dataset/, stats.json, splits.json}, all or nothing.

    Everything is written to a temporary sibling and renamed into place, so an
    interrupted build never leaves a half-written out_dir. An existing out_dir
    raises FileExistsError; the caller decides whether that means "skip".
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"corpus already exists: {out_dir}")
    with atomic_dir(out_dir) as tmp_dir:
        stats = _write_corpus(tmp_dir, sources, max_bytes, vocab_size, seq_len, val_fraction, seed)
    print(
        f"corpus {'+'.join(sources)}: {sum(stats['n_docs'].values())} docs, "
        f"{sum(stats['bytes'].values()) / 1e6:.1f} MB -> "
        f"{stats['n_tokens']['train']:,} train / {stats['n_tokens']['validation']:,} val tokens "
        f"(seq_len {seq_len}), vocab {stats['vocab_size']}, "
        f"{stats['bytes_per_token']:.2f} bytes/token -> {out_dir}"
    )
