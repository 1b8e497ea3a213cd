"""A tiny Hugging Face Llama (built from a config, saved with save_pretrained: no download) is
fine-tuned by offload-train, exported, reloaded with transformers, and its logits match the
engine's (restored from the run's last checkpoint) within fp32 tolerance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import offload_trainer as ot  # noqa: E402
from offload_trainer.app.causal_lm import build_causal_lm
from offload_trainer.app.run_config import RunConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def tiny_llama(path: Path, with_tokenizer: bool) -> None:
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    if with_tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers

        chars = sorted(set("abcdefghijklmnopqrstuvwxyz_():=+ \n0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ,.#"))
        vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_hf_llama_fine_tuned_exported_and_reloaded(tmp_path, with_tokenizer) -> None:
    model_dir = tmp_path / "llama"
    tiny_llama(model_dir, with_tokenizer)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n" * 200)
    out = tmp_path / "run"
    argv = [
        "--model.hf_path", str(model_dir), "--data.path", str(corpus), "--data.seq_len", "32",
        "--data.batch_size", "4", "--train.steps", "4", "--train.checkpoint_every", "0",
        "--train.eval_batches", "2", "--train.out_dir", str(out), "--tiers.nvme_dir", str(tmp_path / "swap"),
        "--no-progress", "--json",
    ]
    done = subprocess.run([sys.executable, "-m", "offload_trainer", *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["export"] == str(out / "hf")
    if with_tokenizer:
        assert (out / "hf" / "tokenizer.json").is_file()

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    cfg = RunConfig.from_dict(json.loads((out / "config.json").read_text()))
    cfg = cfg.with_overrides({"tiers.nvme_dir": str(tmp_path / "swap2")})
    lm = build_causal_lm(cfg)
    x = torch.randint(0, 40, (2, 16))
    with ot.initialize(lm.model, cfg.engine_config(), init_fn=lm.init_fn) as engine:
        engine.load_checkpoint(out / "ckpt-000004")
        with torch.no_grad():
            ours = engine(x).logits
    with torch.no_grad():
        theirs = reloaded(input_ids=x).logits
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5), (ours - theirs).abs().max()
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        assert not torch.allclose(original(input_ids=x).logits, theirs), "fine-tuning changed nothing"
