"""A model built on the meta device is materialised one module at a time straight into its homes,
bitwise equal to constructing it directly, with host memory bounded by one module."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM, init_weights

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("params", ["nvme", "host", "device"])
def test_meta_model_materialises_bitwise_like_direct_construction(tmp_path, tie, precision, params) -> None:
    mcfg = DecoderConfig.preset("tiny", tie_embeddings=tie)
    torch.manual_seed(0)
    direct = DecoderLM(mcfg)
    with torch.device("meta"):
        meta = DecoderLM(mcfg)
    cfg = ot.OffloadConfig(
        tiers={"params": params, "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path)},
        precision={"compute_dtype": precision},
    )
    torch.manual_seed(0)
    with ot.initialize(meta, cfg, init_fn=init_weights) as engine:
        state = engine.full_state_dict()
        x = torch.randint(0, 256, (2, 8))
        engine.backward(engine(x, x)[1])
        engine.step()
    bad = [n for n, p in direct.named_parameters(remove_duplicate=False) if not torch.equal(p.detach(), state[n])]
    assert not bad, bad
    assert (meta.lm_head.weight is meta.embed_tokens.weight) == tie


def test_meta_model_needs_init_fn_and_real_model_refuses_it() -> None:
    with torch.device("meta"):
        meta = DecoderLM(DecoderConfig.preset("tiny"))
    with pytest.raises(ValueError, match="init_fn"):
        ot.initialize(meta)
    with pytest.raises(ValueError, match="meta device"):
        ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), init_fn=init_weights)


def test_a_parameter_init_fn_leaves_unset_is_refused_by_name(tmp_path) -> None:
    """init_fn given a module whose kind it does not handle (the built-in init_weights and a LayerNorm)
    left that module's parameters as the temporary tensor's memory held them (torch.empty: 6.2e-01,
    4.6e-41, -3.5 in a LayerNorm's weight), trained on without a word. Now each starts as NaN and one
    init_fn leaves any of unset is refused by name ([Note: Parameters init_fn leaves unset] in
    persist/materialize.py); the model gets its meta parameters back, and an init_fn that sets them
    builds it as constructing it directly would."""

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x.sum()

    def with_norms(module: nn.Module) -> None:
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        init_weights(module)

    with torch.device("meta"):
        model = Normed()
    cfg = ot.OffloadConfig(tiers={"params": "nvme", "grads": "host", "optimizer": "host", "nvme_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=r"init_fn left 16 of 16 elements of parameter 'blocks\.0\.1\.weight' \(of a LayerNorm\) unset"):
        ot.initialize(model, cfg, init_fn=init_weights)
    assert all(p.is_meta for p in model.parameters())
    direct = Normed()
    torch.manual_seed(0)
    for module in direct.modules():
        with torch.no_grad():
            with_norms(module)
    torch.manual_seed(0)
    with ot.initialize(model, cfg, init_fn=with_norms) as engine:
        state = engine.full_state_dict()
    assert not [n for n, p in direct.named_parameters() if not torch.equal(p.detach(), state[n])]


def test_meta_buffers_are_refused() -> None:
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))

    with torch.device("meta"):
        model = WithBuffer()
    with pytest.raises(ValueError, match="buffers"):
        ot.initialize(model, init_fn=lambda m: None)


PROBE = textwrap.dedent(
    """
    import gc, json, sys
    import psutil, torch
    sys.path.insert(0, {repo!r})
    import offload_trainer as ot
    from offload_trainer.models import DecoderConfig, DecoderLM, init_weights

    torch.set_num_threads(2)
    proc = psutil.Process()
    warm = DecoderLM(DecoderConfig.preset("tiny"))
    with ot.initialize(warm, ot.OffloadConfig(tiers=dict(params="nvme", grads="nvme", optimizer="nvme", nvme_dir={nvme!r}))) as e:
        x = torch.randint(0, 256, (1, 16)); e.backward(e(x, x)[1]); e.step()
    del warm, e
    gc.collect()
    runtime_rss = proc.memory_info().rss
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    mcfg = DecoderConfig(vocab_size=256, dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816, max_seq_len=64)
    with torch.device("meta"):
        model = DecoderLM(mcfg)
    num_params = sum(p.numel() for p in model.parameters())
    layer_bytes = sum(p.numel() for p in model.layers[0].parameters()) * 4
    host_budget = (num_params * 16) // 3
    cfg = ot.OffloadConfig(
        tiers=dict(params="nvme", grads="nvme", optimizer="nvme", nvme_dir={nvme!r},
                   device_budget_bytes=3 * layer_bytes, host_budget_bytes=host_budget),
        prefetch={{"lookahead_groups": 1}},
    )
    torch.manual_seed(0)
    engine = ot.initialize(model, cfg, init_fn=init_weights)
    x = torch.randint(0, 256, (1, 64))
    engine.backward(engine(x, x)[1])
    engine.step()
    peak = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
    out = dict(runtime_rss=runtime_rss, peak_rss=peak, num_params=num_params, host_budget=host_budget,
               device_budget=cfg.tiers.device_budget_bytes, host_peak=engine.peak_bytes(ot.Tier.HOST),
               device_peak=engine.peak_bytes(ot.Tier.DEVICE), layer_bytes=layer_bytes)
    engine.close()
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_model_with_state_3x_the_host_budget_is_built_and_trained_within_it(tmp_path) -> None:
    """284 M parameters (4.5 GB of fp32 training state), host budget a third of that: built on
    meta, materialised into NVMe homes, one training step; peak RSS (reset after the warm-up)
    stays under the budgets plus the runtime, the largest module being initialised, and the
    step's working set. Measured here: peak RSS 1213 MiB, allowed 2146 MiB, runtime 310 MiB."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(repo=str(REPO), nvme=str(tmp_path))],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    state = r["num_params"] * 16
    assert state >= 3 * r["host_budget"]
    assert r["host_peak"] <= r["host_budget"] and r["device_peak"] <= r["device_budget"]
    # The largest module materialised at once, fp32 (+ its bf16/fp32 copies never exceed 2x).
    largest_module = 2 * 256 * 1024 * 4
    working_set = 256 << 20  # activations, autograd's per-parameter gradients, allocator arenas
    allowed = r["runtime_rss"] + r["host_budget"] + r["device_budget"] + largest_module + working_set
    print(json.dumps({k: v >> 20 if k != "num_params" else v for k, v in r.items()}), "allowed MiB", allowed >> 20)
    assert r["peak_rss"] <= allowed, (r, allowed)
