"""data.max_tokens: a corpus it cuts is said to be cut (the run trains on a prefix of it), and a corpus
too small to train on is not blamed on a cut that did not happen."""

from __future__ import annotations

from pathlib import Path

import pytest

from offload_trainer.app.data import ByteTokenizer, PackedDataset, max_tokens_note
from offload_trainer.app.run_config import RunConfig


def data_config(path: "Path | None", max_tokens: "int | None") -> RunConfig:
    overrides = {"data.seq_len": "3", "data.max_tokens": "none" if max_tokens is None else str(max_tokens)}
    if path is not None:
        overrides["data.path"] = str(path)
    return RunConfig().with_overrides(overrides)


def test_too_little_data_under_max_tokens_does_not_say_to_raise_it() -> None:
    with pytest.raises(ValueError) as info:
        PackedDataset(["abcdefghijk"], ByteTokenizer(), seq_len=3, eval_fraction=0.05, max_tokens=4_000_000)
    assert "give 11 tokens, but" in str(info.value) and "max_tokens" not in str(info.value)
    with pytest.raises(ValueError, match=r"give 5 tokens \(cut to max_tokens=5: raise it\)"):
        PackedDataset(["abcdefghijk"], ByteTokenizer(), seq_len=3, eval_fraction=0.0, max_tokens=5)


def test_a_corpus_cut_by_max_tokens_is_said_to_be_and_one_it_holds_whole_is_not(tmp_path) -> None:
    text = "abcdefghij" * 10  # 100 byte tokens
    data = PackedDataset([text], ByteTokenizer(), seq_len=3, max_tokens=40)
    note = max_tokens_note(data_config(tmp_path, 40).data, data)
    assert note is not None and "data.max_tokens=40 cut the corpus" in note and str(tmp_path) in note
    assert "set it to none" in note and "\n" not in note
    whole = PackedDataset([text], ByteTokenizer(), seq_len=3, max_tokens=1000)
    assert max_tokens_note(data_config(tmp_path, 1000).data, whole) is None
    assert max_tokens_note(data_config(tmp_path, None).data, PackedDataset([text], ByteTokenizer(), seq_len=3)) is None
    assert max_tokens_note(data_config(None, 40).data, data) is None  # the default corpus is cut by design


def test_offload_train_says_the_corpus_was_cut(tiny_run_args, tmp_path, capsys) -> None:
    from offload_trainer.app.cli import main

    assert main(tiny_run_args("--data.max_tokens", "300", "--train.steps", "1", "--train.export_dtype", "none")) == 0
    err = capsys.readouterr().err
    assert "offload-train: data.max_tokens=300 cut the corpus: the run trains on the first 300 tokens of" in err
