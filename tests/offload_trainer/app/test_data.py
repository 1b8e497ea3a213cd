"""The data pipeline: byte tokens round-trip, corpora read in a fixed order with errors that name
the file and line, packing reproduces the token stream, the eval split is the seed-independent
tail, and a BatchStream resumed from its state_dict gives the batches an uninterrupted one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from offload_trainer.app.data import (
    IGNORE_INDEX,
    BatchStream,
    ByteTokenizer,
    CorpusNotFoundError,
    PackedDataset,
    TokenStream,
    default_corpus_dir,
    load_documents,
    read_documents,
)

TOKENIZER = ByteTokenizer()


def make_docs(num_docs: int = 40, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "δέλτα", "ε", "日本語", "🙂", "zeta\n"]
    return [
        " ".join(words[int(w)] for w in torch.randint(0, len(words), (int(n),), generator=g))
        for n in torch.randint(1, 30, (num_docs,), generator=g)
    ]


def random_docs(num_docs: int = 30, seed: int = 0) -> list[str]:
    """Printable ASCII noise: no two 8-token sequences of it are alike, so a row names its index."""
    g = torch.Generator().manual_seed(seed)
    return [
        "".join(map(chr, torch.randint(32, 127, (int(n),), generator=g).tolist()))
        for n in torch.randint(5, 240, (num_docs,), generator=g)
    ]


def expected_stream(docs: list[str]) -> list[int]:
    out: list[int] = []
    for i, doc in enumerate(docs):
        if i:
            out.append(0)
        out.extend(doc.encode("utf-8"))
    return out


def make_dataset(seq_len: int = 7, eval_fraction: float = 0.1, **kw) -> PackedDataset:
    return PackedDataset(random_docs(), TOKENIZER, seq_len=seq_len, eval_fraction=eval_fraction, **kw)


def take(stream: BatchStream, num_batches: int) -> list:
    return [stream.next_batch() for _ in range(num_batches)]


def same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y, _), (u, v, _) in zip(a, b))


# --- tokenizer ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_non_ascii() -> None:
    text = "plain ascii, é, 日本語, 🙂, tab\t and newline\n"
    ids = TOKENIZER.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert len(ids) > len(text)  # multi-byte characters really are several tokens
    assert TOKENIZER.decode(ids) == text
    assert TOKENIZER.decode(torch.tensor(ids)) == text
    assert TOKENIZER.vocab_size == 256


def test_byte_tokenizer_replaces_instead_of_raising() -> None:
    assert TOKENIZER.decode([0xFF, ord("a")]) == "\ufffda"
    assert TOKENIZER.decode(TOKENIZER.encode("\ud800x")) == "?x"
    with pytest.raises(ValueError, match="256"):
        TOKENIZER.decode([300])


# --- reading -----------------------------------------------------------------------------------


def test_read_documents_in_sorted_order_over_nested_dirs(tmp_path: Path) -> None:
    (tmp_path / "b" / "deep").mkdir(parents=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "deep" / "z.txt").write_text("deep z")
    (tmp_path / "b" / "c.md").write_text("# c\n")
    (tmp_path / "a" / "m.py").write_text("print('m')\n")
    (tmp_path / "a" / "rows.jsonl").write_text(
        json.dumps({"text": "row one", "id": 1}) + "\n\n" + json.dumps({"text": "row two ü"}) + "\n"
    )
    (tmp_path / "top.txt").write_bytes("bad \xff byte in UTF-8 text: ü".encode("latin-1").replace(b"\xfc", "ü".encode()))
    (tmp_path / "ignored.csv").write_text("x,y\n")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "h.txt").write_text("hidden")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "pkg.py").write_text("installed")

    assert read_documents(tmp_path) == ["print('m')\n", "row one", "row two ü", "# c\n", "deep z", "bad \ufffd byte in UTF-8 text: ü"]
    assert read_documents(str(tmp_path / "a" / "rows.jsonl")) == ["row one", "row two ü"]
    assert [(d.path.name, d.line) for d in load_documents(tmp_path)][:3] == [
        ("m.py", None),
        ("rows.jsonl", 1),
        ("rows.jsonl", 3),
    ]


@pytest.mark.parametrize(
    "bad_line, why",
    [
        ("{not json", "bad JSON"),
        ('{"title": "x"}', 'no "text" field'),
        ('{"text": 3}', "not a string"),
        ("[1]", 'no "text" field'),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path: Path, bad_line: str, why: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "also fine"}) + "\n" + bad_line + "\n")
    with pytest.raises(ValueError, match=rf"data\.jsonl:3: .*{why}.*Each line must be one JSON object") as info:
        read_documents(tmp_path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_file_in_another_encoding_is_refused_not_replaced(tmp_path: Path, suffix: str) -> None:
    """A Latin-1 file became U+FFFD wherever it had an accented letter, silently; a stray byte in UTF-8 text
    (as many characters beyond ASCII that are UTF-8 as bytes that are not) is still replaced."""
    text = json.dumps({"text": "Noël à l'école"}, ensure_ascii=False) if suffix == ".jsonl" else "Noël à l'école"
    (tmp_path / f"fr{suffix}").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"fr\{suffix} is not UTF-8 text: byte 0xeb at offset \d+ is not UTF-8, nor are "
                       r"2 more, against 0 characters .*iconv -f latin1 -t utf-8"):
        read_documents(tmp_path)
    (tmp_path / f"fr{suffix}").write_bytes(text.encode("latin-1").replace(b"\xe0", "à".encode()).replace(b"\xe9", "é".encode()))
    assert read_documents(tmp_path) == ["No\ufffdl à l'école"]


def test_the_default_corpus_keeps_replacing_its_encoding_fixtures() -> None:
    """The standard library holds files in other encodings on purpose (test/encoded_modules): the default
    corpus reads them as it always has, replaced."""
    root = default_corpus_dir()
    fixture = root / "test" / "encoded_modules" / "module_iso_8859_1.py"
    if not fixture.is_file():
        pytest.skip("this Python's standard library has no test/encoded_modules")
    with pytest.raises(ValueError, match="module_iso_8859_1.py is not UTF-8 text"):
        load_documents(fixture)  # not the default corpus: refused
    texts = {d.path: d.text for d in load_documents(root) if d.path.parent == fixture.parent}
    assert "\ufffd" in texts[fixture]


def test_missing_path_is_a_value_error_and_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(CorpusNotFoundError, match="nowhere.*expected a directory") as info:
        read_documents(missing)
    assert isinstance(info.value, ValueError) and isinstance(info.value, FileNotFoundError)


def test_directory_without_usable_files_lists_suffixes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no usable file.*\.txt, \.md, \.py, \.jsonl"):
        read_documents(tmp_path)
    (tmp_path / "notes.csv").write_text("a,b")
    with pytest.raises(ValueError, match="no usable file"):
        read_documents(tmp_path)
    with pytest.raises(ValueError, match=r"suffix '\.csv'"):
        read_documents(tmp_path / "notes.csv")


def test_default_corpus_is_the_standard_library() -> None:
    root = default_corpus_dir()
    assert root.is_dir() and (root / "os.py").is_file()
    documents = load_documents(root)
    assert len(documents) > 100
    assert all("site-packages" not in d.path.relative_to(root).parts for d in documents)
    assert any(d.path == root / "os.py" and "def makedirs" in d.text for d in documents)
    data = PackedDataset([d.text for d in documents], TOKENIZER, seq_len=64, max_tokens=100_000)
    assert data.num_tokens == 100_000 and data.num_train_sequences + data.num_eval_sequences == 100_000 // 65


# --- packing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_packing_reproduces_the_token_stream(seq_len: int) -> None:
    docs = make_docs()
    data = PackedDataset(docs, TOKENIZER, seq_len=seq_len, eval_fraction=0.1)
    stream = expected_stream(docs)
    length = seq_len + 1
    num_sequences = len(stream) // length
    assert data.num_tokens == len(stream) and data.dtype == torch.uint8
    assert data.num_train_sequences + data.num_eval_sequences == num_sequences
    train = [data.train_sequence(i) for i in range(data.num_train_sequences)]
    assert all(s.dtype == torch.int64 and s.shape == (length,) for s in train)
    with pytest.raises(IndexError, match="must be in"):
        data.train_sequence(data.num_train_sequences)  # the eval sequences are not training sequences
    evals = list(data.eval_batches(batch_size=3))
    for inputs, targets, _ in evals:
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape
        assert inputs.shape[1] == seq_len
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are inputs shifted by one
    eval_rows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y, _ in evals])
    packed = torch.cat([torch.stack(train), eval_rows]).flatten()
    assert packed.tolist() == stream[: num_sequences * length]


@pytest.mark.parametrize("batch_size", [1, 2])
def test_masked_targets_leave_the_inputs_whole(batch_size: int) -> None:
    """A chat prompt's targets are IGNORE_INDEX, its inputs still its tokens: with one row a batch (data.batch_size
    1, an eval set's last batch) the inputs and targets were views of one tensor, so masking the targets wrote
    -100 into the inputs too, and the embedding failed ("index out of range")."""
    tokens = torch.arange(1, 25, dtype=torch.int16)
    trained = (torch.arange(24) % 3 == 0).to(torch.uint8)
    data = PackedDataset.from_stream(TokenStream(tokens, trained), vocab_size=30, seq_len=5, eval_fraction=0.25)
    batches = [data.train_batch(torch.arange(batch_size))] + list(data.eval_batches(batch_size))
    for inputs, targets, _ in batches:
        rows = inputs.shape[0]
        assert (inputs != IGNORE_INDEX).all(), inputs
        assert torch.equal(inputs[:, 1:], torch.where(targets[:, :-1] == IGNORE_INDEX, inputs[:, 1:], targets[:, :-1]))
        assert (targets == IGNORE_INDEX).any() and rows == targets.shape[0]
    assert torch.equal(batches[0][0], tokens[: 6 * batch_size].view(batch_size, 6)[:, :-1].long())


def test_max_tokens_cuts_the_stream() -> None:
    docs = make_docs()
    data = PackedDataset(docs, TOKENIZER, seq_len=4, eval_fraction=0.0, max_tokens=103)
    assert data.num_tokens == 103 and data.num_train_sequences == 20 and data.num_eval_sequences == 0
    assert torch.stack([data.train_sequence(i) for i in range(20)]).flatten().tolist() == expected_stream(docs)[:100]
    assert list(data.eval_batches(4)) == []


def test_other_tokenizers_pack_into_a_wider_dtype() -> None:
    class WordTokenizer:
        vocab_size = 1000

        def encode(self, text: str) -> list[int]:
            return [1 + sum(map(ord, word)) % 999 for word in text.split()]

    docs = make_docs()
    data = PackedDataset(docs, WordTokenizer(), seq_len=5, eval_fraction=0.0)
    stream: list[int] = []
    for i, doc in enumerate(docs):
        stream += ([0] if i else []) + WordTokenizer().encode(doc)
    assert data.dtype == torch.int16
    rows = torch.stack([data.train_sequence(i) for i in range(data.num_train_sequences)])
    assert rows.flatten().tolist() == stream[: rows.numel()]


def test_eval_split_is_the_tail_disjoint_and_seed_independent() -> None:
    data = make_dataset(seq_len=7, eval_fraction=0.1)
    n = data.num_train_sequences + data.num_eval_sequences
    assert data.num_eval_sequences == max(1, n // 10)
    rows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y, _ in data.eval_batches(4)])
    tokens = torch.tensor(expected_stream(random_docs()))
    assert torch.equal(rows.flatten(), tokens[data.num_train_sequences * 8 : n * 8])
    held_out = {tuple(row) for row in rows.tolist()}
    for seed in (0, 1, 2):
        stream = BatchStream(data, batch_size=5, seed=seed)
        num_batches = 2 * data.num_train_sequences // 5 + 1  # two epochs and a bit
        batches = take(stream, num_batches)
        trained = {tuple(row) for x, y, _ in batches for row in torch.cat([x, y[:, -1:]], dim=1).tolist()}
        assert trained == {tuple(data.train_sequence(i).tolist()) for i in range(data.num_train_sequences)}
        assert trained.isdisjoint(held_out)
    again = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y, _ in data.eval_batches(4)])
    assert torch.equal(again, rows)  # streaming with any seed left the eval set as it was
    # Batch sizes do not change what is held out, and the last batch holds the rest.
    sizes = [x.shape[0] for x, _, _ in data.eval_batches(4)]
    assert sum(sizes) == data.num_eval_sequences and all(s == 4 for s in sizes[:-1])
    assert torch.equal(torch.cat([x for x, _, _ in data.eval_batches(1)]), rows[:, :-1])


def test_a_tiny_corpus_gets_one_eval_sequence() -> None:
    data = PackedDataset(["abcdefghijk"], TOKENIZER, seq_len=2, eval_fraction=0.05)  # 3 sequences of 3
    assert (data.num_train_sequences, data.num_eval_sequences) == (2, 1)


def test_too_little_data_says_how_many_tokens_are_needed() -> None:
    with pytest.raises(ValueError, match=r"give 11 tokens.*needs at least 12 tokens \(3 sequences"):
        PackedDataset(["abcdefghijk"], TOKENIZER, seq_len=3, eval_fraction=0.05)
    with pytest.raises(ValueError, match=r"give 5 tokens \(cut to max_tokens=5: raise it\).*at least 8 tokens"):
        PackedDataset(["abcdefghijk"], TOKENIZER, seq_len=3, eval_fraction=0.0, max_tokens=5)
    with pytest.raises(ValueError, match="give 0 tokens"):
        PackedDataset([], TOKENIZER, seq_len=3)


def test_a_corpus_of_empty_documents_is_refused_not_trained_on_its_separators() -> None:
    """A JSONL file of {"text": ""} records (the text under another key, a broken export) gave a stream of
    end-of-document tokens alone, long enough to train on: the run taught the model to repeat them."""
    with pytest.raises(ValueError, match=r"the corpus's 100 documents are all empty .* only the 99 end-of-document"):
        PackedDataset([""] * 100, TOKENIZER, seq_len=3)

    class WithBos(ByteTokenizer):
        bos_ids = (1,)

    with pytest.raises(ValueError, match="all empty"):  # a start-of-document token alone is no text either
        PackedDataset([""] * 100, WithBos(), seq_len=3)
    assert PackedDataset([""] * 100 + ["a"], TOKENIZER, seq_len=3).num_tokens == 101  # one with text: taken as is


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seq_len": 0}, "seq_len must be an int >= 1"),
        ({"seq_len": 4, "eval_fraction": 1.0}, r"eval_fraction must be a number in \[0, 1\)"),
        ({"seq_len": 4, "eval_fraction": -0.1}, "eval_fraction"),
        ({"seq_len": 4, "max_tokens": 0}, "max_tokens must be an int >= 1"),
    ],
)
def test_dataset_arguments_are_validated(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PackedDataset(make_docs(), TOKENIZER, **kwargs)


# --- batch stream ------------------------------------------------------------------------------


def test_batch_stream_is_deterministic_per_seed() -> None:
    data = make_dataset()
    first = take(BatchStream(data, batch_size=4, seed=3), 10)
    assert same(first, take(BatchStream(data, batch_size=4, seed=3), 10))
    assert not same(first, take(BatchStream(data, batch_size=4, seed=4), 10))
    x, y, _ = first[0]
    assert x.shape == y.shape == (4, 7) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.is_contiguous() and y.is_contiguous()
    assert BatchStream(data, batch_size=4, seed=3).tokens_per_batch == 28


@pytest.mark.parametrize("batch_size", [1, 3, 5, 1000])
def test_every_epoch_covers_every_sequence_once(batch_size: int) -> None:
    data = make_dataset()
    n = data.num_train_sequences
    assert n % 3 and n % 5  # so batches really do cross epoch boundaries
    stream = BatchStream(data, batch_size=batch_size, seed=0)
    lookup = {tuple(data.train_sequence(i).tolist()): i for i in range(n)}
    assert len(lookup) == n  # sequences are distinct, so a row names its index
    num_epochs = 3
    order: list[int] = []
    while len(order) < num_epochs * n:
        x, y, _ = stream.next_batch()
        assert x.shape[0] == batch_size
        order += [lookup[tuple(row)] for row in torch.cat([x, y[:, -1:]], dim=1).tolist()]
    epochs = [order[e * n : (e + 1) * n] for e in range(num_epochs)]
    assert all(sorted(epoch) == list(range(n)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # a new permutation each epoch
    assert stream.state_dict()["epoch"] >= num_epochs - 1


@pytest.mark.parametrize("num_batches_before", [0, 1, 7, 23])
def test_resume_from_state_dict_gives_the_same_batches(num_batches_before: int) -> None:
    data = make_dataset()
    original = BatchStream(data, batch_size=5, seed=11)
    take(original, num_batches_before)
    state = json.loads(json.dumps(original.state_dict()))
    assert set(state) == {"epoch", "position", "seed"} and all(type(v) is int for v in state.values())
    resumed = BatchStream(data, batch_size=5, seed=999)  # the saved seed wins: restored exactly
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    after_resume = take(resumed, 20)
    assert same(after_resume, take(original, 20))
    uninterrupted = take(BatchStream(data, batch_size=5, seed=11), num_batches_before + 20)
    assert same(after_resume, uninterrupted[num_batches_before:])


@pytest.mark.parametrize(
    "state, match",
    [
        ({"epoch": 0, "position": 0}, r"lacks \['seed'\]"),
        ({"epoch": 0, "position": 0, "seed": 0, "rng": 1}, r"unexpected \['rng'\]"),
        ({"epoch": "0", "position": 0, "seed": 0}, r"state\['epoch'\] must be an int"),
        ({"epoch": 0, "position": 1.0, "seed": 0}, r"state\['position'\] must be an int"),
        ({"epoch": 0, "position": True, "seed": 0}, r"state\['position'\] must be an int"),
        ({"epoch": -1, "position": 0, "seed": 0}, r"state\['epoch'\] must be >= 0"),
        ({"epoch": 0, "position": 10**6, "seed": 0}, "saved over different data"),
        ([0, 0, 0], "is a dict"),
    ],
)
def test_load_state_dict_refuses_bad_states_and_changes_nothing(state: object, match: str) -> None:
    stream = BatchStream(make_dataset(), batch_size=2, seed=5)
    take(stream, 3)
    before = stream.state_dict()
    with pytest.raises(ValueError, match=match):
        stream.load_state_dict(state)  # type: ignore[arg-type]
    assert stream.state_dict() == before


@pytest.mark.parametrize("batch_size", [0, -1, 2.0, True])
def test_batch_size_is_validated(batch_size: object) -> None:
    data = make_dataset()
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        BatchStream(data, batch_size=batch_size, seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        data.eval_batches(batch_size)  # type: ignore[arg-type]



def test_a_stream_counts_the_epochs_it_has_handed_out() -> None:
    """metrics.jsonl's `epoch` (as the HF Trainer logs it): passes over the training sequences so far."""
    data = PackedDataset(["some text " * 10], ByteTokenizer(), seq_len=8, eval_fraction=0.0)
    stream = BatchStream(data, batch_size=4, seed=0)
    assert stream.epochs_done == 0.0
    seen = []
    for _ in range(6):
        stream.next_batch()
        seen.append(stream.epochs_done)
    n = data.num_train_sequences
    assert n == 11 and seen == [(4 * k) // n + (4 * k) % n / n for k in range(1, 7)]  # 4/11, 8/11, 1 + 1/11 ...
