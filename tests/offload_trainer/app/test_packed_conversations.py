"""Chat conversations packed into one sequence train as each would alone: their position ids restart at
each conversation (packed_dataset.Batch), which transformers turns into a block-causal mask, so a
conversation attends to itself alone. Checked against plain transformers fed each conversation's part
of a row on its own: the run's first loss (before any update) and its eval loss (through the exported
model, reloaded with from_pretrained). Before, the conversations of a row attended to each other and
the first loss differed from the unpacked one by 3e-3 here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from offload_trainer.app.causal_lm import build_causal_lm  # noqa: E402
from offload_trainer.app.data import IGNORE_INDEX, Batch, BatchStream, PackedDataset, load_corpus  # noqa: E402
from offload_trainer.app.data.packed_dataset import _position_ids  # noqa: E402
from offload_trainer.app.packed_attention import restarts_attention  # noqa: E402
from offload_trainer.app.run_checks import check_micro_batch_order  # noqa: E402
from offload_trainer.app.trainer import run  # noqa: E402

from tests.offload_trainer.app.test_export_and_lora import config, tiny_llama_with_chat  # noqa: E402

WORDS = ["hi", "hello", "how are u", "a b", "yes", "no, no", "why?", "so"]


def conversations(n: int) -> List[dict]:
    """Conversations of different lengths, so that rows hold several, cut at different places."""
    return [
        {"messages": [{"role": "user", "content": WORDS[i % 8]},
                      {"role": "assistant", "content": WORDS[(5 * i + 1) % 8] * (1 + i % 2)}]}
        for i in range(n)
    ]


def chat_run(tmp_path: Path, **overrides: str):
    model_dir = tmp_path / "llama"
    tiny_llama_with_chat(model_dir)
    chats = tmp_path / "chats"
    chats.mkdir()
    (chats / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(40)))
    base = {"data.path": str(chats), "data.seq_len": "48", "train.steps": "1", "train.export_dtype": "fp32",
            "train.eval_batches": "2", "data.eval_fraction": "0.2"}
    return model_dir, config(tmp_path, model_dir, **{**base, **overrides})


def segments(batch: Batch) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Each conversation's part of each row of `batch`, (inputs, targets) [1, n]: where its positions restart."""
    assert batch.position_ids is not None
    for x, y, p in zip(*batch):
        starts = (p == 0).nonzero().flatten().tolist() + [len(p)]
        for a, b in zip(starts, starts[1:]):
            yield x[None, a:b], y[None, a:b]


def unpacked_loss(model, batch: Batch) -> Tuple[float, int]:
    """Plain transformers: the sum of the cross entropy over the trained targets of each conversation alone."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in segments(batch):
            if bool((y == IGNORE_INDEX).all()):
                continue
            logits = model(x).logits
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            total += float(loss)
            count += int((y != IGNORE_INDEX).sum())
    return total, count


def test_packed_conversations_train_as_each_alone(tmp_path: Path) -> None:
    model_dir, cfg = chat_run(tmp_path)
    summary = run(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    data = load_corpus(cfg.data, build_causal_lm(cfg).tokenizer)
    batch = BatchStream(data, cfg.data.batch_size, cfg.seed).next_batch()
    assert batch.position_ids is not None
    assert sum(1 for _ in segments(batch)) >= 2 * cfg.data.batch_size  # rows do hold several conversations
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count = unpacked_loss(base, batch)
    assert rows[0]["loss"] == pytest.approx(total / count, abs=2e-6)  # 3e-3 off when they attended to each other
    exported = transformers.AutoModelForCausalLM.from_pretrained(summary.export).eval()
    parts = [unpacked_loss(exported, b) for b, _ in zip(data.eval_batches(cfg.data.batch_size), range(2))]
    assert rows[-1]["eval_loss"] == pytest.approx(sum(t for t, _ in parts) / sum(c for _, c in parts), abs=2e-6)


def test_position_ids_restart_after_each_conversations_end(tmp_path: Path) -> None:
    """The first token of each conversation (the one after the EOS that ends the one before) is a start;
    the EOS stays with the conversation it ends, whose last token is trained to predict it."""
    _, cfg = chat_run(tmp_path)
    lm = build_causal_lm(cfg)
    stream = load_corpus(cfg.data, lm.tokenizer)
    eos = lm.tokenizer.eos_id
    rows, targets, positions = stream.train_batch(torch.arange(stream.num_train_sequences))
    for x, y, p in zip(rows, targets, positions):
        assert p[0] == 0
        for i in range(1, len(x)):
            assert int(p[i]) == (0 if x[i - 1] == eos else int(p[i - 1]) + 1)
            if x[i] == eos:
                assert y[i - 1] == eos  # the conversation's end is trained


def test_a_row_restarts_at_each_start_and_at_its_first_token() -> None:
    starts = torch.tensor([[False, False, True, False, True], [True, False, False, False, False]])
    assert _position_ids(starts).tolist() == [[0, 1, 0, 1, 0], [0, 1, 2, 3, 4]]


def test_a_text_corpus_has_no_position_ids() -> None:
    from offload_trainer.app.data import ByteTokenizer

    data = PackedDataset(["some text " * 20, "more text " * 20], ByteTokenizer(), seq_len=16, eval_fraction=0.0)
    assert not data.restarts_positions
    assert data.train_batch(torch.arange(2)).position_ids is None


class _Plain:
    """A model called as the engine calls it."""

    def __init__(self, model) -> None:
        self.model, self.device = model, torch.device("cpu")

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def test_models_whose_mask_ignores_restarting_positions_are_told_apart() -> None:
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32))
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=32, hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=32, word_embed_proj_dim=16))
    assert restarts_attention(_Plain(llama))
    assert not restarts_attention(_Plain(opt))  # OPT builds its own mask: the packed row still attends across
    assert llama.training and opt.training  # the probe's eval mode is undone
    from offload_trainer.app.causal_lm import CausalLM
    from offload_trainer.app.packed_attention import check_packed_attention

    lm = CausalLM(opt, lambda m: None, None, [], Path("opt"))  # type: ignore[arg-type]
    note = check_packed_attention(_Plain(opt), lm)  # type: ignore[arg-type]
    assert note is not None and "OPTForCausalLM" in note and not lm.restart_positions  # trains as before
    lm = CausalLM(llama, lambda m: None, None, [], Path("llama"))  # type: ignore[arg-type]
    assert check_packed_attention(_Plain(llama), lm) is None and lm.restart_positions


def test_layer_major_is_refused_for_chat_data(tmp_path: Path) -> None:
    _, cfg = chat_run(tmp_path, **{"train.micro_batch_order": "layer_major"})
    with pytest.raises(ValueError, match='micro_batch_major" for chat data'):
        check_micro_batch_order(cfg, restarts_positions=True)
    check_micro_batch_order(cfg, restarts_positions=False)


def test_a_chat_corpus_keeps_its_data_identity(tmp_path: Path) -> None:
    """The STARTS bits are not in the CRC32 a checkpoint's data position is checked against: a chat run saved
    before conversations were kept apart (marks of 0 and 1 alone) resumes over the same data, not refused
    as if its files had changed."""
    from offload_trainer.app.data.token_stream import TRAINED, crc32_of

    _, cfg = chat_run(tmp_path)
    data = load_corpus(cfg.data, build_causal_lm(cfg).tokenizer)
    assert data.restarts_positions
    before = crc32_of((data._train_marks & TRAINED).contiguous(), crc32_of(data._train))
    assert data.train_crc32() == before
