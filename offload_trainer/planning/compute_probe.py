"""Compute probe: how long one micro-batch of a decoder's forward and backward takes on this machine.

The planner needs the model's compute time to know how much IO can hide behind it. Running the
whole model would need the whole model in memory, so the probe times the parts it is made of,
each on its own with random weights: one transformer block (the built-in DecoderBlock, the same
compute as a Llama layer of that shape) and the ends (embedding, final norm, LM head and the
cross-entropy loss). The model's time is n_layers blocks plus the ends. With activation
checkpointing a block's forward runs again in backward, so backward gains one block forward.
The parts run on the device the plan is for (a GPU computes a block many times faster than the
CPU, and the planner weighs IO against this time); under CUDA each half is timed between
synchronizations, since kernels run after the call that issues them returns.

A block too large to build comfortably here (more than `max_block_numel` parameters) is timed at
a reduced width and scaled by its matmul FLOPs, which dominate a block's compute; the result says
so. Timings are the median of a few runs after a warm-up, and are cached per machine in a JSON
cache file (json_cache.py), of the same layout as the rates of machine.py.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from offload_trainer.planning.json_cache import cache_key_id, read_cache, store_entry
from offload_trainer.models.decoder import DecoderBlock, DecoderConfig, RMSNorm, linear, rotary_cos_sin
from offload_trainer.planning.zero_memory import DecoderShape


CACHE_WHAT = "compute-time cache"


@dataclass(frozen=True)
class DecoderTimes:
    """Seconds of one micro-batch (batch_size x seq_len tokens), compute only."""

    forward_s: float
    backward_s: float
    """Includes the recomputed block forwards when activation checkpointing is on."""
    scaled_from_dim: Optional[int] = None
    """The width the block was really timed at, when it was scaled to the model's; else None."""


def _block_numel(shape: DecoderShape) -> int:
    """Weights of one block's matmuls (the norms are negligible)."""
    kv = 2 * shape.n_kv_heads * (shape.dim // shape.n_heads)
    return shape.dim * (shape.dim + kv + shape.dim) + 3 * shape.dim * shape.ffn_dim


def _block_flops(shape: DecoderShape, tokens: int, seq_len: int) -> float:
    """Forward FLOPs of one block: its matmuls plus attention's two seq x seq products (causal: half)."""
    return 2.0 * tokens * _block_numel(shape) + 2.0 * tokens * seq_len * shape.dim


def _median_times(run: Callable[[], tuple[float, float]], repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of `repeats` runs after a warm-up; each run times both.

    Timing the two halves of the same run (rather than subtracting a forward-only best from a
    forward-and-backward best) keeps one noisy run from making backward look free."""
    run()  # warm-up: first-call allocations and kernel selection
    times = sorted(run() for _ in range(repeats))
    fwd = sorted(t[0] for t in times)[len(times) // 2]
    bwd = sorted(t[1] for t in times)[len(times) // 2]
    return fwd, bwd


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """What makes the host wait for the kernels issued on `device` (nothing on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _timed_forward_backward(loss: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, float]:
    sync = _synchronizer(device)
    sync()
    start = time.perf_counter()
    out = loss()
    sync()
    mid = time.perf_counter()
    out.backward()
    sync()
    return mid - start, time.perf_counter() - mid


def _time_block(
    shape: DecoderShape, batch_size: int, seq_len: int, dtype: torch.dtype, repeats: int, device: torch.device
) -> tuple[float, float]:
    cfg = DecoderConfig(
        vocab_size=shape.vocab_size, dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads, ffn_dim=shape.ffn_dim, max_seq_len=seq_len,
    )
    block = DecoderBlock(cfg).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block.to(device)  # drawn on the CPU: the device's generator is left as it was
    cos, sin = rotary_cos_sin(seq_len, cfg.head_dim, cfg.rope_theta, device)
    x = torch.randn(batch_size, seq_len, shape.dim, dtype=dtype).to(device).requires_grad_(True)
    loss = lambda: block(x, cos, sin).float().square().mean()  # noqa: E731
    return _median_times(lambda: _timed_forward_backward(loss, device), repeats)


def _time_ends(
    shape: DecoderShape, batch_size: int, seq_len: int, dtype: torch.dtype, repeats: int, device: torch.device
) -> tuple[float, float]:
    embed = torch.nn.Embedding(shape.vocab_size, shape.dim).to(dtype)
    norm = RMSNorm(shape.dim, 1e-5).to(dtype)
    head = linear(shape.dim, shape.vocab_size).to(dtype)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for module in (embed, norm, head):
        module.to(device)
    tokens = torch.randint(0, shape.vocab_size, (batch_size, seq_len)).to(device)
    targets = torch.randint(0, shape.vocab_size, (batch_size * seq_len,)).to(device)

    def loss() -> torch.Tensor:
        logits = head(norm(embed(tokens)))
        return F.cross_entropy(logits.float().flatten(0, 1), targets)

    return _median_times(lambda: _timed_forward_backward(loss, device), repeats)


def measure_decoder_times(
    shape: DecoderShape,
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    repeats: int = 3,
    max_block_numel: int = 64_000_000,
    device: torch.device = torch.device("cpu"),
) -> DecoderTimes:
    """Time one block and the ends of `shape` at (batch_size, seq_len) on `device`; the model's time."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size={batch_size} and seq_len={seq_len} must both be at least 1")
    probe = shape
    scaled_from: Optional[int] = None
    if _block_numel(shape) > max_block_numel:
        ratio = math.sqrt(max_block_numel / _block_numel(shape))
        heads = max(1, int(shape.n_heads * ratio))
        kv = max(1, min(heads, int(shape.n_kv_heads * ratio)))
        while heads % kv:
            kv -= 1
        head_dim = shape.dim // shape.n_heads
        probe = dataclasses.replace(shape, dim=heads * head_dim, n_heads=heads, n_kv_heads=kv,
                                    ffn_dim=max(1, int(shape.ffn_dim * ratio)))
        scaled_from = probe.dim
    # The probe's random weights must not move the caller's RNG (a seeded run stays the same run).
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(0)
        block_fwd, block_bwd = _time_block(probe, batch_size, seq_len, dtype, repeats, device)
        ends_fwd, ends_bwd = _time_ends(shape, batch_size, seq_len, dtype, repeats, device)
    if scaled_from is not None:
        tokens = batch_size * seq_len
        scale = _block_flops(shape, tokens, seq_len) / _block_flops(probe, tokens, seq_len)
        block_fwd, block_bwd = block_fwd * scale, block_bwd * scale
    forward = shape.n_layers * block_fwd + ends_fwd
    backward = shape.n_layers * (block_bwd + (block_fwd if activation_checkpointing else 0.0)) + ends_bwd
    return DecoderTimes(forward, backward, scaled_from)


def cached_decoder_times(
    shape: DecoderShape,
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype,
    activation_checkpointing: bool,
    cache_path: Path,
    refresh: bool = False,
    progress: Optional[Callable[[str], None]] = None,
    device: torch.device = torch.device("cpu"),
) -> tuple[DecoderTimes, bool]:
    """measure_decoder_times through a JSON cache file (json_cache.read_cache / store_entry, the
    rates' layout); returns (times, whether they came from the cache). A GPU's times are kept
    under its name (the CPU's key is as before)."""
    key: dict = {
        "shape": dataclasses.asdict(shape), "batch_size": batch_size, "seq_len": seq_len, "dtype": str(dtype),
        "activation_checkpointing": activation_checkpointing, "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if device.type != "cpu":
        key["device"] = str(device)
        key["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    key_id = cache_key_id(key)
    entry = read_cache(cache_path, CACHE_WHAT).get(key_id)
    if not refresh and isinstance(entry, dict) and entry.get("key") == key:
        try:
            return DecoderTimes(**entry["times"]), True
        except (KeyError, TypeError):
            pass  # an entry of another version: measure again
    if progress is not None:
        progress(f"timing one {shape.dim}-wide block and the LM head at {batch_size} x {seq_len} tokens")
    times = measure_decoder_times(shape, batch_size, seq_len, dtype, activation_checkpointing, device=device)
    store_entry(cache_path, key_id, {"key": key, "times": dataclasses.asdict(times)}, CACHE_WHAT)
    return times, False
