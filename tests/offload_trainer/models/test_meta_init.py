"""Building on meta skips the init ops there: nothing changes (meta tensors hold no values, their
random ops draw nothing), and torch._dynamo, which a few of them imported (1.5-2.5 s at every
offload-train and offload-plan start), stays unloaded."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from torch import nn

from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.models.meta_init import on_meta


def test_building_the_decoder_does_not_import_dynamo() -> None:
    code = textwrap.dedent("""
        import sys
        from offload_trainer.models import DecoderConfig, DecoderLM
        DecoderLM(DecoderConfig.preset("tiny"))
        with __import__("torch").device("meta"):
            DecoderLM(DecoderConfig.preset("tiny"))
        assert "torch._dynamo" not in sys.modules, "building a model imported torch._dynamo"
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_skipped_init_changes_no_value_and_no_random_stream() -> None:
    torch.manual_seed(0)
    direct = DecoderLM(DecoderConfig.preset("tiny"))
    after_direct = torch.rand(3)
    torch.manual_seed(0)
    with on_meta():
        meta = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4))
        nn.init.trunc_normal_(meta[1].weight)
    assert all(p.is_meta for p in meta.parameters())
    again = DecoderLM(DecoderConfig.preset("tiny"))  # the generator is where the meta build left it: at seed 0
    assert torch.equal(torch.rand(3), after_direct)
    for (name, a), (_, b) in zip(direct.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    outside = torch.empty(3)
    nn.init.constant_(outside, 2.0)  # outside the context, init runs as ever
    assert torch.equal(outside, torch.full((3,), 2.0))
