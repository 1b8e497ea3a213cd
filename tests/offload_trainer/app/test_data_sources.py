"""Data beyond plain text, with a real tokenizer built offline (the `tokenizers` library, wrapped by
transformers; no download): documents joined with EOS and started with BOS where the tokenizer puts
one; JSONL with another text field, parquet and saved datasets read alike; chat conversations
rendered with the tokenizer's template and the loss blind to their prompt tokens; the token cache
makes a second start tokenize nothing and gives the same batches."""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path
from typing import List, Optional

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from offload_trainer.app.causal_lm import CausalLM  # noqa: E402
from offload_trainer.app.data import (  # noqa: E402
    IGNORE_INDEX,
    BatchStream,
    ByteTokenizer,
    Fields,
    HFTokenizer,
    PackedDataset,
    load_corpus,
    load_documents,
)
from offload_trainer.app.run_config import DataConfig  # noqa: E402

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def make_tokenizer(bos: bool = True, chat: bool = True):
    """A character-level WordLevel tokenizer with <s>/</s>; with `bos`, a post-processor that puts <s>
    before every text (as Llama's does); with `chat`, a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz ?!.,\n"))
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(chars)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=SPECIALS[3:],
    )
    if chat:
        hf.chat_template = CHAT_TEMPLATE
    return hf


def ids(hf, text: str) -> List[int]:
    return hf(text, add_special_tokens=False)["input_ids"]


class Counting(HFTokenizer):
    """An HFTokenizer that counts the texts and conversations it is asked to tokenize."""

    calls = 0

    def encode(self, text: str) -> List[int]:
        Counting.calls += 1
        return super().encode(text)

    def render_chat(self, messages):
        Counting.calls += 1
        return super().render_chat(messages)


def stream_of(data: PackedDataset) -> List[int]:
    rows = [data.train_sequence(i) for i in range(data.num_train_sequences)]
    return torch.stack(rows).flatten().tolist()


# --- EOS and BOS -------------------------------------------------------------------------------


@pytest.mark.parametrize("bos", [True, False])
def test_documents_are_joined_with_eos_and_start_with_bos_where_the_tokenizer_puts_one(bos: bool) -> None:
    hf = make_tokenizer(bos=bos)
    tok = HFTokenizer(hf)
    assert tok.eos_id == hf.eos_token_id == 2 and tok.bos_ids == ((1,) if bos else ())
    docs = ["hello there", "a second one", "and a third document."]
    data = PackedDataset(docs, tok, seq_len=3, eval_fraction=0.0)
    start = [1] if bos else []
    expected = start + ids(hf, docs[0]) + [2] + start + ids(hf, docs[1]) + [2] + start + ids(hf, docs[2])
    got = stream_of(data)
    assert got == expected[: len(got)] and len(expected) - len(got) < 4
    assert 0 not in got  # never <unk> between documents


def test_a_tokenizer_without_eos_is_refused_with_the_fix() -> None:
    hf = make_tokenizer()
    hf.eos_token = None
    with pytest.raises(ValueError, match="no eos_token.*tokenizer_config.json"):
        HFTokenizer(hf, "the tokenizer of model.hf_path='/m'")


# --- readers -----------------------------------------------------------------------------------

ROWS = [{"body": "first text", "id": 1}, {"body": "second text", "id": 2}, {"body": "third", "id": 3}]


def test_jsonl_with_another_text_field(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    cfg = DataConfig(path=str(tmp_path / "rows.jsonl"), text_field="body", seq_len=4, eval_fraction=0.0)
    docs = load_documents(cfg.path, Fields("body"))
    assert [d.text for d in docs] == ["first text", "second text", "third"]
    with pytest.raises(ValueError, match=r'rows\.jsonl:1: no "text" field.*data\.text_field'):
        load_documents(tmp_path / "rows.jsonl")


def test_parquet_and_a_saved_dataset_read_as_the_jsonl_does(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "saved_dict"))
    want = ["first text", "second text", "third"]
    for where in ("rows.parquet", "saved", "saved_dict"):
        docs = load_documents(tmp_path / where, Fields("body"))
        assert [d.text for d in docs] == want, where
        assert [d.line for d in docs] == [1, 2, 3]
    with pytest.raises(ValueError, match=r"no \"text\" column.*columns are \['body', 'id'\].*data\.text_field"):
        load_documents(tmp_path / "rows.parquet")
    # Through the trainer's entry point, tokenized like the same text given directly.
    tok = HFTokenizer(make_tokenizer())
    for where in ("rows.parquet", "saved"):
        cfg = DataConfig(path=str(tmp_path / where), text_field="body", seq_len=3, eval_fraction=0.0,
                         cache_dir=str(tmp_path / "cache"))
        assert stream_of(load_corpus(cfg, tok)) == stream_of(PackedDataset(want, tok, seq_len=3, eval_fraction=0.0))


# --- chat --------------------------------------------------------------------------------------

CHATS = [
    {"messages": [{"role": "user", "content": "hi?"}, {"role": "assistant", "content": "hello!"}]},
    {"messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b b"}, {"role": "user", "content": "c"},
                  {"role": "assistant", "content": "dd"}]},
]


def test_chat_is_rendered_with_the_template_and_only_the_assistants_tokens_are_targets(tmp_path: Path) -> None:
    hf = make_tokenizer()
    tok = HFTokenizer(hf)
    ids_, trained = tok.render_chat(CHATS[0]["messages"])
    assert ids_ == hf.apply_chat_template(CHATS[0]["messages"], tokenize=True, return_dict=False)
    reply = ids(hf, "hello!<|end|>")
    assert [i for i, t in zip(ids_, trained) if t] == reply  # the reply and its end, nothing of the prompt
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in CHATS * 20) + "\n")
    cfg = DataConfig(path=str(tmp_path / "chat.jsonl"), seq_len=16, batch_size=4, eval_fraction=0.1,
                     cache_dir=str(tmp_path / "cache"))
    data = load_corpus(cfg, tok)
    inputs, targets, _ = BatchStream(data, batch_size=4, seed=0).next_batch()
    kept = targets[targets != IGNORE_INDEX]
    assert 0 < kept.numel() < targets.numel()
    prompts = set(ids(hf, "<s><|system|>be nice<|user|>hi?ac<|assistant|>"))
    prompt_only = prompts - set(ids(hf, "hello!b bdd<|end|>")) - {tok.eos_id}
    assert {1, 3, 4, 5} <= prompt_only  # <s>, <|user|>, <|assistant|>, <|system|>
    assert not (set(kept.tolist()) & prompt_only)
    assert any((t == IGNORE_INDEX).any() for _, t, _ in data.eval_batches(4))  # eval batches are masked too


class _IdentityEngine:
    """Stands in for an engine whose model returns its input (the logits): on the CPU."""

    device = torch.device("cpu")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_the_loss_ignores_prompt_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, :3] = IGNORE_INDEX
    lm = CausalLM(torch.nn.Identity(), lambda m: None, None, [], None)  # type: ignore[arg-type]
    loss = lm.loss(_IdentityEngine(), logits, targets)  # type: ignore[arg-type]
    changed = logits.clone()
    changed[0, :3] = torch.randn(3, 11) * 10  # predictions at prompt positions do not count
    assert torch.equal(lm.loss(_IdentityEngine(), changed, targets), loss)  # type: ignore[arg-type]
    kept = targets != IGNORE_INDEX
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits[kept], targets[kept]))
    all_prompt = torch.full_like(targets, IGNORE_INDEX)
    zero = lm.loss(_IdentityEngine(), logits.requires_grad_(), all_prompt)  # type: ignore[arg-type]
    assert float(zero.detach()) == 0.0 and zero.requires_grad


def test_chat_data_with_byte_tokens_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "chat.jsonl").write_text(json.dumps(CHATS[0]) + "\n")
    with pytest.raises(ValueError, match=r"chat\.jsonl:1 is a chat conversation.*model\.hf_path"):
        load_corpus(DataConfig(path=str(tmp_path / "chat.jsonl"), cache_dir=str(tmp_path / "c")), ByteTokenizer())


@pytest.mark.parametrize("template, line, why", [
    ("{% for m in messages %}{{ m['content'] ", 1, "TemplateSyntaxError: unexpected end of template"),
    # The first conversation has no system message; the second, on line 2, is the one refused.
    ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}"
     "{{ m['content'] }}{% endfor %}", 2, "TemplateError: no system messages"),
])
def test_a_conversation_the_template_cannot_render_is_named_in_one_line(
    tmp_path: Path, template: str, line: int, why: str
) -> None:
    """jinja2's errors (a broken template, or one refusing a conversation, as Llama 2's refuses roles that do not
    alternate) came out as a traceback naming neither the file nor the fix."""
    hf = make_tokenizer()
    hf.chat_template = template
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in CHATS * 5) + "\n")
    with pytest.raises(ValueError, match=rf"chat\.jsonl:{line}: the chat template of .* cannot render this conversation "
                       rf"\({why}.*\): fix the conversation as the template asks, or the template"):
        load_corpus(DataConfig(path=str(tmp_path / "chat.jsonl"), cache_dir=str(tmp_path / "c")), HFTokenizer(hf))
    assert not list((tmp_path / "c").rglob("*.tmp-*"))


def test_a_chat_template_that_is_not_text_is_named_in_one_line(tmp_path: Path) -> None:
    """"chat_template": 5 in tokenizer_config.json loaded, and the run ended on jinja2's own words, "Can't compile
    non template nodes", naming neither the model nor the file to fix."""
    hf = make_tokenizer()
    hf.chat_template = 5
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in CHATS * 5) + "\n")
    with pytest.raises(ValueError, match=r"chat\.jsonl:1: the chat template of .* is 5, not a Jinja template's text: "
                       r"fix \"chat_template\" in its tokenizer_config\.json"):
        load_corpus(DataConfig(path=str(tmp_path / "chat.jsonl"), cache_dir=str(tmp_path / "c")), HFTokenizer(hf))


@pytest.mark.parametrize("role, meant", [("Assistant", "assistant"), ("usr", "user"), ("SYSTEM", "system")])
def test_a_miscased_or_misspelt_role_is_refused_naming_the_role_meant(tmp_path: Path, role: str, meant: str) -> None:
    """Only "assistant" turns are trained: an "Assistant" reply beside an "assistant" one was trained as prompt, and
    a "usr" turn rendered under a role the model never saw, without a word. Roles of a template's own ("ipython")
    pass as they are."""
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    conversation.insert(1, {"role": role, "content": "c"})
    odd = {"messages": [{"role": "ipython", "content": "d"}, *conversation[:1], conversation[-1]]}
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in [*CHATS * 5, odd, {"messages": conversation}]) + "\n")
    with pytest.raises(ValueError, match=rf"chat\.jsonl:12: message 1 has the role '{role}'; did you mean '{meant}'\? "
                       r"Roles are matched exactly \(only \"assistant\" messages are trained on\)"):
        load_corpus(DataConfig(path=str(tmp_path / "chat.jsonl"), cache_dir=str(tmp_path / "c")),
                    HFTokenizer(make_tokenizer()))


# --- the token cache ---------------------------------------------------------------------------


def _text_and_chat_corpus(tmp_path: Path) -> DataConfig:
    """A corpus directory of one text file and one chat file, and its DataConfig (seq_len 8, batch 4)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the first file, with some text in it.\n" * 20)
    (corpus / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in CHATS * 5) + "\n")
    return DataConfig(path=str(corpus), seq_len=8, batch_size=4)


def test_a_second_start_reads_the_cache_and_tokenizes_nothing(tmp_path: Path) -> None:
    cfg = _text_and_chat_corpus(tmp_path)
    corpus = Path(cfg.path)
    tok = Counting(make_tokenizer())
    Counting.calls = 0
    first = load_corpus(cfg, tok)
    assert Counting.calls > 0
    cache = tmp_path / ".offload-cache"  # beside the data
    assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".tokens", ".trained"]
    Counting.calls = 0
    second = load_corpus(cfg, tok)
    assert Counting.calls == 0
    assert torch.equal(second._train, first._train)
    a, b = BatchStream(first, 4, seed=3), BatchStream(second, 4, seed=3)
    for _ in range(5):
        (x1, y1, _), (x2, y2, _) = a.next_batch(), b.next_batch()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # The same as tokenizing in memory, and a changed file makes a new entry.
    direct = PackedDataset(load_documents(corpus), tok, 8, eval_fraction=cfg.eval_fraction, max_tokens=cfg.max_tokens)
    assert torch.equal(direct._train, second._train) and torch.equal(direct._train_marks, second._train_marks)
    (corpus / "a.txt").write_text("changed text\n" * 30)
    Counting.calls = 0
    load_corpus(cfg, tok)
    assert Counting.calls > 0 and len(list(cache.glob("*.json"))) == 2


def _flip(path: Path, where: float) -> None:
    data = bytearray(path.read_bytes())
    at = min(int(len(data) * where), len(data) - 1)
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _zero_tail(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] + bytes(len(data) - len(data) // 2))


def _edit_meta(path: Path, change) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


CACHE_DAMAGE = {
    "tokens-first-byte": (lambda c: _flip(next(c.glob("*.tokens")), 0.0), True),
    "tokens-middle-byte": (lambda c: _flip(next(c.glob("*.tokens")), 0.5), True),
    "tokens-last-byte": (lambda c: _flip(next(c.glob("*.tokens")), 1.0), True),
    "tokens-zeroed-tail": (lambda c: _zero_tail(next(c.glob("*.tokens"))), True),
    "marks-middle-byte": (lambda c: _flip(next(c.glob("*.trained")), 0.5), True),
    "crc-edited": (lambda c: _edit_meta(next(c.glob("*.json")), lambda m: m.update(tokens_crc32=m["tokens_crc32"] ^ 1)), True),
    "entry-without-crcs": (lambda c: _edit_meta(next(c.glob("*.json")), lambda m: [m.pop("tokens_crc32"), m.pop("trained_crc32")]), False),
}


@pytest.mark.parametrize("damage", list(CACHE_DAMAGE), ids=list(CACHE_DAMAGE))
def test_a_cache_entry_whose_bytes_changed_is_never_trained_on(tmp_path: Path, damage: str) -> None:
    """A bit flipped in a cached entry (tokens or loss marks) would train on tokens the corpus does not
    hold, silently: the entry's CRC32s are checked at load, and a damaged entry (or one from before
    entries carried them) is tokenized again and replaced, with a warning if it was damaged."""
    cfg = _text_and_chat_corpus(tmp_path)
    tok = Counting(make_tokenizer())
    first = load_corpus(cfg, tok)
    expected_train, expected_marks = first._train.clone(), first._train_marks.clone()
    del first
    gc.collect()  # the mapping (and its lock) go
    damage_entry, warned = CACHE_DAMAGE[damage]
    damage_entry(tmp_path / ".offload-cache")
    Counting.calls = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = load_corpus(cfg, tok)
    assert Counting.calls > 0, "the damaged entry was read instead of the corpus"
    assert torch.equal(second._train, expected_train) and torch.equal(second._train_marks, expected_marks)
    corrupted = [w for w in caught if "is corrupted" in str(w.message)]
    assert len(corrupted) == (1 if warned else 0), [str(w.message) for w in caught]
    del second
    gc.collect()
    Counting.calls = 0
    third = load_corpus(cfg, tok)
    assert Counting.calls == 0, "the entry was not replaced"
    assert torch.equal(third._train, expected_train)


def _word_level(vocab: dict, unk: Optional[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk) if unk else models.WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def test_a_tokenizer_that_loads_but_cannot_encode_is_refused_in_one_line() -> None:
    """A WordLevel vocabulary without its unknown token raises a bare Exception from the tokenizers
    library on the first character it lacks: a traceback, at the probe or mid-corpus."""
    hf = _word_level({"</s>": 0, "a": 1, "b": 2}, unk=None)
    with pytest.raises(ValueError, match=r"^the tokenizer cannot tokenize text \(Exception: .*fix or replace its tokenizer files"):
        HFTokenizer(hf).encode("abc")  # "a" (the probe) encodes; "c" does not


def test_the_vocab_size_of_a_tokenizer_with_sparse_ids_is_its_largest_id_plus_one(tmp_path: Path) -> None:
    """len(tokenizer) counts tokens; an id past it (a gap, an added token far out) needs embeddings up to
    it and a stream dtype that holds it, or the model check passes and the id fails (or wraps) later."""
    hf = _word_level({"<unk>": 0, "</s>": 1, "a": 2, "z": 40000}, unk="<unk>")
    tok = HFTokenizer(hf)
    assert tok.vocab_size == 40001 and len(hf) == 4
    (tmp_path / "a.txt").write_text("az" * 100)
    data = load_corpus(DataConfig(path=str(tmp_path / "a.txt"), cache_dir=str(tmp_path / "c"), seq_len=8), tok)
    assert int(data.train_sequence(0).max()) == 40000


def test_a_tokenization_is_announced_and_a_cached_corpus_is_not(tmp_path: Path) -> None:
    """A large corpus takes minutes to tokenize, silently before: load_corpus tells `say` before and
    after a tokenization, and nothing when the token cache has the entry."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 50)
    cfg = DataConfig(path=str(corpus), seq_len=8, eval_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    said: List[str] = []
    load_corpus(cfg, ByteTokenizer(), said.append)
    assert len(said) == 2 and said[0] == f"tokenizing {corpus} (3 file(s), 0.0 MiB)..."
    assert said[1].startswith("tokenized the corpus in ")
    said.clear()
    load_corpus(cfg, ByteTokenizer(), said.append)
    assert said == []


def test_long_documents_tokenize_without_transformers_warning_of_indexing_errors() -> None:
    """Documents are tokenized whole and then packed into data.seq_len-token sequences (at most the
    model's positions, checked at the start), so a document longer than the tokenizer's
    model_max_length is the normal case: transformers' 'Token indices sequence length is longer than
    the specified maximum sequence length for this model (1440 > 64). Running this sequence through the
    model will result in indexing errors' warned of an error that cannot happen (seen on stderr when
    tokenizing for a tokenizer of model_max_length 64; GPT-2's is 1024). Not for chat documents either."""
    import logging

    from transformers.utils import logging as hf_logging

    said: List[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logger, handler = hf_logging.get_logger("transformers"), Said()
    logger.addHandler(handler)
    try:
        text, chat = make_tokenizer(), make_tokenizer()  # one each: transformers says it once per tokenizer
        text.model_max_length = chat.model_max_length = 8
        assert len(HFTokenizer(text).encode("hello there, a long text. " * 4)) > 8
        reply = [{"role": "user", "content": "hi?"}, {"role": "assistant", "content": "a long reply. " * 4}]
        assert len(HFTokenizer(chat).render_chat(reply)[0]) > 8
    finally:
        logger.removeHandler(handler)
    assert not [line for line in said if "longer than the specified maximum" in line], said


def test_an_eos_token_the_vocabulary_lacks_is_refused_naming_the_one_it_has(tmp_path: Path) -> None:
    """An eos_token in tokenizer_config.json that tokenizer.json does not hold was added by transformers as a
    new id on load, silently: the run ended every document with a token whose embedding was never trained."""
    from offload_trainer.app.causal_lm import build_causal_lm
    from offload_trainer.app.run_config import RunConfig
    from tests.offload_trainer.app.test_export_and_lora import tiny_llama_with_chat

    model_dir = tmp_path / "llama"
    tiny_llama_with_chat(model_dir)
    cfg = RunConfig().with_overrides({"model.hf_path": str(model_dir), "data.seq_len": "16"})
    assert build_causal_lm(cfg).tokenizer.eos_id == 2  # "</s>", in the vocabulary
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    settings["eos_token"] = "<|eot_id|>"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=r"eos_token '<\|eot_id\|>' is not in its vocabulary .*tokenizer\.json.*"
                       r"new token \(id \d+\).*never trained.*set \"eos_token\" in tokenizer_config\.json.*"
                       r"\(it has '</s>'"):
        build_causal_lm(cfg)


@pytest.mark.parametrize("template, content", [
    (CHAT_TEMPLATE, ""),
    (CHAT_TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | trim }}"), "  \n"),
])
def test_a_reply_that_renders_to_no_tokens_is_refused_naming_its_line(tmp_path: Path, template: str, content: str) -> None:
    """An assistant message that renders to nothing trained the template's end of turn alone (the model learnt
    to answer with nothing), without a word."""
    hf = make_tokenizer()
    hf.chat_template = template
    empty = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": content}]}
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in [*CHATS * 5, empty]) + "\n")
    with pytest.raises(ValueError, match=r"chat\.jsonl:11: the assistant's message 1 renders to no tokens .*"
                       r"give the reply its text, or remove the conversation"):
        load_corpus(DataConfig(path=str(tmp_path / "chat.jsonl"), cache_dir=str(tmp_path / "c")), HFTokenizer(hf))
    # A reply of text is kept, and one the template trims to its text is still a reply.
    ids_, trained = HFTokenizer(hf).render_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": " b "}])
    assert [i for i, t in zip(ids_, trained) if t][0] in ids(hf, " b")
