"""bf16 and fp16 compute over fp32 master weights train a small LM about as fp32 does.

Tolerance: over 40 AdamW steps on a fixed set of batches, a low-precision run must achieve at
least 85% of the fp32 run's loss decrease, and end within 0.15 nats of it. fp16 must skip a
step whose scaled gradients overflow and halve its loss scale.
"""

from __future__ import annotations

import pytest
import torch

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM

STEPS = 40


def train(tmp_path, dtype: str, **precision) -> list:
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "host", "optimizer": {"host": 0.5, "nvme": 0.5}, "nvme_dir": str(tmp_path)},
        optimizer={"lr": 3e-3, "grad_clip_norm": 1.0},
        precision=dict(compute_dtype=dtype, **precision),
    )
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 64, (4, 32), generator=g) for _ in range(4)]
    losses = []
    with ot.initialize(model, cfg) as engine:
        for step in range(STEPS):
            x = data[step % len(data)]
            loss = engine(x, x.roll(-1, dims=1))[1]
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
        assert all(t.dtype == torch.float32 for t in engine.full_state_dict().values())
    return losses


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory) -> list:
    return train(tmp_path_factory.mktemp("fp32"), "fp32")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_lowers_the_loss_like_fp32(tmp_path, fp32_losses, dtype: str) -> None:
    losses = train(tmp_path, dtype)
    drop32 = fp32_losses[0] - fp32_losses[-1]
    drop = losses[0] - losses[-1]
    assert drop32 > 1.0, f"fp32 did not learn: {fp32_losses[0]:.3f} -> {fp32_losses[-1]:.3f}"
    assert drop >= 0.85 * drop32, f"{dtype}: {losses[0]:.3f} -> {losses[-1]:.3f}; fp32 {fp32_losses[0]:.3f} -> {fp32_losses[-1]:.3f}"
    assert abs(losses[-1] - fp32_losses[-1]) <= 0.15


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path) -> None:
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = ot.OffloadConfig(
        tiers={"params": "host", "grads": "host", "optimizer": "host"},
        precision={"compute_dtype": "fp16", "initial_loss_scale": 2.0**40, "loss_scale_window": 1000},
    )
    x = torch.randint(0, 64, (2, 16))
    with ot.initialize(model, cfg) as engine:
        before = engine.full_state_dict()
        engine.backward(engine(x, x)[1])
        engine.step()
        stats = engine.stats()
        assert stats.skipped and stats.loss_scale == 2.0**39
        assert not stats.nonfinite, "an overflow the scaler can still answer is not a non-finite step"
        after = engine.full_state_dict()
        assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step changed parameters"
        for _ in range(30):
            engine.backward(engine(x, x)[1])
            engine.step()
            if not engine.stats().skipped:
                break
        assert not engine.stats().skipped, "the scale never came down to a usable value"
        assert engine.stats().loss_scale < 2.0**39


def test_fp16_overflow_at_the_minimum_scale_is_nonfinite(tmp_path) -> None:
    """Halving cannot go below precision.min_loss_scale: an overflow there is reported as a non-finite
    step (stats().nonfinite, which offload-train's train.on_nonfinite acts on), not skipped silently
    step after step."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = ot.OffloadConfig(
        tiers={"params": "host", "grads": "host", "optimizer": "host"},
        precision={"compute_dtype": "fp16", "initial_loss_scale": 2.0**40, "min_loss_scale": 2.0**39},
    )
    x = torch.randint(0, 64, (2, 16))
    with ot.initialize(model, cfg) as engine:
        before = engine.full_state_dict()
        seen = []
        for _ in range(2):
            engine.backward(engine(x, x)[1])
            engine.step()
            stats = engine.stats()
            seen.append((stats.skipped, stats.nonfinite, stats.loss_scale))
        after = engine.full_state_dict()
    assert seen == [(True, False, 2.0**39), (True, True, 2.0**39)]
    assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step changed parameters"


def _bf16_run(tmp_path, device: object, tiers: dict, steps: int = 3) -> tuple:
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(
        tiers=dict(tiers, nvme_dir=str(tmp_path)), optimizer={"lr": 3e-3, "grad_clip_norm": 1.0},
        precision={"compute_dtype": "bf16"},
    )
    g = torch.Generator().manual_seed(1)
    losses, h2d = [], []
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg, device=device) as engine:
        for _ in range(steps):
            x = torch.randint(0, 64, (2, 16), generator=g)
            loss = engine(x, x.roll(-1, dims=1))[1]
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            h2d.append(engine.stats().h2d_bytes)
        device_param_bytes = sum(
            grp.local_trainable_numel * 2 for grp in engine.groups if grp.param_home.tier is ot.Tier.DEVICE
        )
        return torch.stack(losses), engine.full_state_dict(), h2d, device_param_bytes


@pytest.mark.parametrize(
    "tiers",
    [
        {"params": "device", "grads": "host", "optimizer": "host"},  # bf16 on the device, fp32 master on the host
        {"params": {"device": 0.5, "nvme": 0.5}, "grads": {"device": 0.5, "host": 0.5}, "optimizer": "nvme"},
    ],
    ids=["master-on-host", "split"],
)
def test_bf16_on_the_simulated_accelerator_is_the_cpus_bit_for_bit(tmp_path, tiers: dict) -> None:
    """The same bf16 training on the CPU and on the simulated accelerator (copies late, destinations NaN
    until done): every loss and every fp32 master equal, so every copy of the low-precision path waited."""
    from offload_trainer.runtime.device.host import SimulatedAccelerator

    losses_cpu, state_cpu, _, _ = _bf16_run(tmp_path / "cpu", "cpu", tiers)
    sim = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001)
    losses_sim, state_sim, _, _ = _bf16_run(tmp_path / "sim", sim, tiers)
    assert torch.equal(losses_cpu, losses_sim)
    assert all(torch.equal(state_cpu[n], state_sim[n]) for n in state_cpu)


def test_each_updated_bf16_shard_is_written_back_to_its_device_home_once(tmp_path) -> None:
    """Parameters homed on the device (bound there as they are, one rank), fp32 master and moments on the
    host: after the recording step, the only bytes copied to the device in a step are the optimizer's
    write-backs, one bf16 copy of each trainable shard."""
    from offload_trainer.runtime.device.host import SimulatedAccelerator

    sim = SimulatedAccelerator(h2d_delay_s=0.0, d2h_delay_s=0.0)
    _, _, h2d, device_param_bytes = _bf16_run(
        tmp_path, sim, {"params": "device", "grads": "host", "optimizer": "host"}, steps=3
    )
    assert device_param_bytes > 0
    assert h2d[1:] == [device_param_bytes, device_param_bytes]


class _Branchy(torch.nn.Module):
    """A block stack whose second block runs only when told: on the other steps its group gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(3)])

    def forward(self, x: torch.Tensor, use_middle: bool) -> torch.Tensor:
        x = self.layers[0](x)
        if use_middle:
            x = self.layers[1](x)
        return self.layers[2](x)


@pytest.mark.parametrize("chunk_bytes", [None, 4096])
def test_a_bf16_group_without_gradients_keeps_its_nvme_parameters(tmp_path, chunk_bytes) -> None:
    """With an fp32 master, a group's parameter home on NVMe is only written by its update; a step
    that gives the group no gradient must leave it as it was, whole or in update chunks (the
    staging buffer it is written from is filled from the master, never left as it was taken)."""
    torch.manual_seed(0)
    model = _Branchy()
    optimizer = {"lr": 1e-2} if chunk_bytes is None else {"lr": 1e-2, "update_chunk_bytes": chunk_bytes}
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path)},
        optimizer=optimizer, precision={"compute_dtype": "bf16"}, io={"block_bytes": 4096},
    )
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    with ot.initialize(model, cfg) as engine:
        engine.backward(engine(x, True).float().square().mean())
        engine.step()
        chunks = len(engine.optimizer._chunks[engine.groups[1].index])
        assert (chunks == 1) == (chunk_bytes is None)  # cut by whole IO blocks of the bf16 parameter home
        before = {k: v.clone() for k, v in engine.full_state_dict().items() if k.startswith("layers.1.")}
        for _ in range(2):
            engine.backward(engine(x, False).float().square().mean())
            engine.step()
        after = engine.full_state_dict()
        for name, value in before.items():
            assert torch.equal(after[name], value), name
        # and the model itself, as the next forward reads it from NVMe
        engine.backward(engine(x, True).float().square().mean())
        engine.step()
        assert all(torch.isfinite(v).all() for v in engine.full_state_dict().values())
