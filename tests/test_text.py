"""The `text` stage: windows of offline text the target reads, stored with its states, trained on beside the
rollouts (`weaver.data.text`, `weaver.train.drafter.with_read_text`)."""

from __future__ import annotations

import datasets
import pytest
import torch
from omegaconf import OmegaConf

import weaver.data.text as text_module
from hf_tiny import VOCAB
from weaver.data.states import StoredStates, build_states
from weaver.data.text import build_text, text_windows
from weaver.errors import WeaverError
from weaver.train.drafter import with_read_text

_LETTERS = torch.randint(0, 26, (233,), generator=torch.Generator().manual_seed(0)).tolist()
_STARTS = [0, 5, 45, 68, 129, 141, 174, 183, 233]  # 8 documents of 5 to 61 random letters
DOCS = [{"text": "".join(chr(97 + c) for c in _LETTERS[a:b]), "source": "fake", "path": f"doc{d}"}
        for d, (a, b) in enumerate(zip(_STARTS, _STARTS[1:]))]


def tokenize(texts: list[str]) -> dict:
    """A character tokenizer (ids 3..28): what `text_windows` needs of the target's."""
    return {"input_ids": [[3 + ord(c) - 97 for c in t] for t in texts]}


@pytest.fixture(autouse=True)
def fake_corpus(monkeypatch):
    monkeypatch.setattr(text_module, "collect_documents", lambda sources: DOCS)


def test_windows_are_seeded_non_overlapping_slices_of_the_documents():
    windows = text_windows(tokenize, ["fake"], 12, 8, seed=0, batch=3)
    assert len(windows) == 12 and all(len(w) == 8 for w in windows)
    slices = {tuple(ids[s : s + 8]) for ids in tokenize([d["text"] for d in DOCS])["input_ids"]
              for s in range(0, len(ids) - 7, 8)}  # 0+5+2+7+1+4+1+6 = 26 of them
    assert {tuple(w) for w in windows} <= slices and len({tuple(w) for w in windows}) == 12
    assert text_windows(tokenize, ["fake"], 12, 8, seed=0, batch=5) == windows  # batching does not change them
    assert text_windows(tokenize, ["fake"], 12, 8, seed=1) != windows
    assert len(text_windows(tokenize, ["fake"], 26, 8, seed=0)) == 26


@pytest.mark.parametrize("sources,n,seq_len,message", [
    (["fake"], 27, 8, "hold 26 windows of 8 tokens, fewer than drafter.text.n_sequences=27"),
    ([], 4, 8, "needs sources"),
    (["fake"], 0, 8, "n_sequences >= 1"),
    (["fake"], 4, 1, "seq_len >= 2"),
])
def test_bad_text_settings_are_refused(sources, n, seq_len, message):
    with pytest.raises(WeaverError, match=message):
        text_windows(tokenize, sources, n, seq_len, seed=0)


def test_read_text_is_stored_with_the_targets_states_and_follows_the_rollouts(target, tmp_path):
    taps = (0, 1)
    settings = OmegaConf.create({"sources": ["fake"], "n_sequences": 5, "seq_len": 10})
    build_text(target, tokenize, settings, taps, shard_size=2, batch_size=2, seed=0, out_dir=tmp_path / "text",
               work_dir=tmp_path / "work")
    read = datasets.load_from_disk(str(tmp_path / "text" / "dataset"))
    assert read["prompt_index"] == list(range(5)) and all(p == [] for p in read["prompt_ids"])
    assert read["response_ids"] == text_windows(tokenize, ["fake"], 5, 10, seed=0)
    text_states = StoredStates(tmp_path / "text" / "states", taps)
    for i, window in enumerate(read["response_ids"]):
        with torch.no_grad():
            out = target(torch.tensor([window]), tap_layers=taps)
        torch.testing.assert_close(text_states[i][:, 0].float(), out.taps[0][0], atol=0.03, rtol=0.01)

    g = torch.Generator().manual_seed(0)
    rollouts = datasets.Dataset.from_list([
        {"prompt_ids": torch.randint(3, VOCAB, (4,), generator=g).tolist(),
         "response_ids": torch.randint(3, VOCAB, (9,), generator=g).tolist(), "prompt_index": i} for i in range(3)])
    build_states(target, rollouts, taps, 2, 2, tmp_path / "states", tmp_path / "states.work")
    rows, states = with_read_text(rollouts, StoredStates(tmp_path / "states", taps), tmp_path / "text", taps)
    assert rows["prompt_index"] == list(range(8)) and rows["response_ids"][3:] == read["response_ids"]
    assert not list((tmp_path / "text" / "dataset").glob("cache-*")), "reading an artifact never writes into it"
    assert torch.equal(states[1], StoredStates(tmp_path / "states", taps)[1])
    assert torch.equal(states[3 + 4], text_states[4])
    assert states.batch([0, 6], 14).shape[:2] == (2, 14)
    rows, states = with_read_text(rollouts.select(range(2)), StoredStates(tmp_path / "states", taps), tmp_path / "text", taps)
    assert rows["prompt_index"] == [0, 1, 3, 4, 5, 6, 7]  # a held-out rollout left out: the text still follows all three
    assert torch.equal(states[3], text_states[0])
    with pytest.raises(WeaverError, match="rollouts.store_states: true"):
        with_read_text(rollouts, None, tmp_path / "text", taps)
