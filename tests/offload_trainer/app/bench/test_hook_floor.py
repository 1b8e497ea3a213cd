"""EngineHooksOnly: the engine's hooks with empty callbacks leave plain PyTorch's training unchanged."""

from __future__ import annotations

import copy

import torch

from offload_trainer.app.bench.hook_floor import EngineHooksOnly
from offload_trainer.models import DecoderConfig, DecoderLM


def test_training_under_the_empty_hooks_is_plain_pytorch_bitwise() -> None:
    torch.manual_seed(0)
    plain = DecoderLM(DecoderConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, n_kv_heads=2, ffn_dim=32, max_seq_len=16))
    hooked = copy.deepcopy(plain)
    hooks = EngineHooksOnly(hooked)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (plain, hooked)]
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)
        _, loss = plain(x, y)
        loss.backward()
        with hooks.forward_context():
            _, hooked_loss = hooked(x, y)
        hooked_loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    hooks.remove()
    for (name, a), b in zip(plain.named_parameters(), hooked.parameters()):
        assert torch.equal(a, b), name
