"""Idle engine memory is given back to the OS ([Note: Discarding idle memory] in io_engine/buffers.py).

A gradient home holds nothing live from its group's update to the next backward's first gradient,
and staging buffers nothing held sit idle through a backward: the engine discards their pages
(Engine._before_load -> GradAccumulator.discard_home; Engine._before_backward -> BufferPool.discard_free),
which must never change a result. The model here is large enough (blocks of 2 MiB) that the host
arena is private memory, where discarding really happens; the tiny models of the other tests stay
in MAP_SHARED arenas, where it does nothing.
"""

from __future__ import annotations

import copy
import ctypes.util
import mmap
import platform
from typing import Dict, List, Optional

import psutil
import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.runtime.groups import freed_heap
from offload_trainer.runtime.groups import tiers as tiers_module
from offload_trainer.runtime.groups.tiers import DISCARD_MIN_BYTES
from offload_trainer.runtime.optimizer import torch_param_groups
from tests.offload_trainer.runtime.test_engine_parity import (
    OPT, VOCAB, TinyLM, accelerator, assert_params_equal, batches,
)


def _config(tmp_path, accum: int) -> ot.OffloadConfig:
    # The bench's 124M placement: parameters and optimizer states on NVMe, gradients in host memory.
    return ot.OffloadConfig(
        tiers=dict(params="nvme", grads="host", optimizer="nvme", nvme_dir=str(tmp_path), release_idle_memory=True),
        optimizer=OPT,
        grad_accum_steps=accum,
    )


def _grad_homes(engine: ot.Engine) -> Dict[int, Optional[torch.Tensor]]:
    """Each grad home's values (None: a home lent from the heap, given back: [Note: Gradient homes
    lent from the heap] in runtime/gradients.py)."""
    def values(home) -> Optional[torch.Tensor]:
        if home.lent:
            return None if home.pieces is None else torch.cat([p.reshape(-1) for p in home.pieces if p is not None])
        return home.tensor.clone()

    return {g.index: values(g.grad_home) for g in engine.groups if g.grad_home is not None}


def _whole_pages(t: torch.Tensor) -> torch.Tensor:
    """The part of a float tensor that lies in whole pages (only those are given back)."""
    page = mmap.PAGESIZE
    ptr = t.data_ptr()
    first = (-ptr % page) // t.element_size()
    last = ((ptr + t.numel() * t.element_size()) // page * page - ptr) // t.element_size()
    return t[first:last] if last > first else t[:0]


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("tie", [False, True])
def test_discarding_idle_memory_keeps_results_bitwise(tmp_path, device: str, tie: bool) -> None:
    torch.manual_seed(0)
    model = TinyLM(dim=256, n_layers=2, tie=tie)
    ref = copy.deepcopy(model)
    cfg = _config(tmp_path, accum=2)
    opt = torch.optim.AdamW(torch_param_groups(ref, cfg.optimizer), lr=OPT.lr, betas=OPT.betas, fused=True)
    loss_fn = nn.CrossEntropyLoss()
    engine = ot.initialize(model, cfg, device=accelerator(device))
    discarded: List[str] = []
    tiers_discard = engine.tiers.discard

    def spy(tensor: torch.Tensor) -> bool:
        done = tiers_discard(tensor)
        if done:
            is_home = any(g.grad_home is not None and g.grad_home.tensor is tensor for g in engine.groups)
            discarded.append("grad home" if is_home else "staging")
        return done

    engine.tiers.discard = spy  # type: ignore[method-assign]
    try:
        for k, step in enumerate(batches(4, 2)):
            for m, (x, y) in enumerate(step):
                ref_loss = loss_fn(ref(x).reshape(-1, VOCAB), y.reshape(-1)) / 2
                ref_loss.backward()
                before_forward = _grad_homes(engine)
                loss = loss_fn(engine(x).reshape(-1, VOCAB), y.reshape(-1)) / 2
                homes = _grad_homes(engine)
                if m == 1:
                    # The second micro-batch's forward must leave the first one's gradients alone.
                    assert all(h is not None and torch.equal(h, before_forward[i]) for i, h in homes.items())
                elif k > 0 and device == "cpu":
                    # On the CPU the homes are lent from the heap: the first forward of a step gave them back.
                    assert all(h is None for h in homes.values())
                elif k > 0:
                    # The first forward of a step finds every home's last values used: given back, zeros
                    # (homes under DISCARD_MIN_BYTES are kept).
                    live = {
                        g.index: g.grad_home.tensor
                        for g in engine.groups
                        if g.grad_home is not None and g.grad_home.nbytes >= DISCARD_MIN_BYTES
                    }
                    assert all(not bool(_whole_pages(t).any()) for t in live.values())
                    assert sum(_whole_pages(t).numel() for t in live.values()) > 500_000
                engine.backward(loss)
                assert torch.equal(ref_loss, loss)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            engine.step()
        assert_params_equal(ref, engine.full_state_dict())
    finally:
        engine.close()
    assert "staging" in discarded and ("grad home" in discarded) == (device != "cpu")


def test_discard_free_skips_buffers_lent_or_still_in_use(tmp_path) -> None:
    from offload_trainer.config import Tier
    from offload_trainer.runtime.device.pending import Pending

    class NotYet(Pending):
        def done(self) -> bool:
            return False

        def wait(self) -> None:  # pragma: no cover - never waited for here
            pass

    torch.manual_seed(0)
    engine = ot.initialize(TinyLM(dim=256, n_layers=2), _config(tmp_path, accum=1), device="cpu")
    try:
        pool = engine.staging
        assert pool is not None and pool.num_free >= 3
        numel = pool.buffer_numel
        lent = pool.take_as(numel, torch.float32)
        busy = pool.take_as(numel, torch.float32)
        idle = pool.take_as(numel, torch.float32)
        for buf in (lent, busy, idle):
            buf.fill_(1.0)
        pool.give(busy, [NotYet()])
        pool.give(idle)
        assert pool.discard_free() > 0
        assert bool((lent == 1).all()) and bool((busy == 1).all())  # lent, and given back with work in flight
        assert not bool(idle.any())  # given back idle: discarded, reads as zeros
        pool.give(lent)
        assert engine.tiers.accounts[Tier.HOST].resident_bytes > 0  # budgets still count discarded memory
        pool.take_as(numel, torch.float32)
    finally:
        engine.close()


def test_small_tensors_are_not_discarded(tmp_path) -> None:
    """A tensor under DISCARD_MIN_BYTES keeps its memory (and its values): faulting its pages in
    again would cost more than the little it takes out of the peak. (On the simulated accelerator,
    whose grad homes are carved from the host arena; the CPU's are lent from the heap.)"""
    engine = ot.initialize(TinyLM(dim=256, n_layers=2), _config(tmp_path, accum=1), device=accelerator("sim"))
    try:
        small = [g.grad_home.tensor for g in engine.groups if g.grad_home is not None and g.grad_home.nbytes < DISCARD_MIN_BYTES]
        assert small, "the model must have a small group (a norm, the head's bias)"
        for t in small:
            t.fill_(1.0)
            assert engine.tiers.discard(t) is False
            assert bool((t == 1).all())
    finally:
        engine.close()


def test_idle_memory_is_kept_unless_asked(tmp_path) -> None:
    """tiers.release_idle_memory is off by default: nothing is discarded (its refaults cost time).
    (On the simulated accelerator, whose grad homes are carved from the host arena.)"""
    cfg = ot.OffloadConfig(tiers=dict(params="nvme", grads="host", optimizer="nvme", nvme_dir=str(tmp_path)))
    engine = ot.initialize(TinyLM(dim=256, n_layers=2), cfg, device=accelerator("sim"))
    try:
        big = [g.grad_home.tensor for g in engine.groups if g.grad_home is not None and g.grad_home.nbytes >= DISCARD_MIN_BYTES]
        assert big
        for t in big:
            t.fill_(1.0)
            assert engine.tiers.discard(t) is False
            assert bool((t == 1).all())
        assert engine.staging is not None and engine.staging.discard_free() == 0
    finally:
        engine.close()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_malloc_trim_is_found_where_find_library_finds_no_c_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no ldconfig, gcc or ld is installed (distroless images, NixOS), ctypes.util.find_library("c")
    is None on glibc too, and tiers.release_idle_memory silently never gave the freed heap back."""
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    freed_heap.c_library_function.cache_clear()
    try:
        assert freed_heap.c_library_function("malloc_trim") is not None
        assert freed_heap.c_library_function("no_such_function_in_any_c_library") is None
    finally:
        freed_heap.c_library_function.cache_clear()


def test_heap_memory_freed_inside_the_heap_is_given_back() -> None:
    """[Note: Freed heap memory in backward]: memory freed between live allocations stays resident
    under glibc until malloc_trim gives its pages back; give_back_freed_heap does."""
    if freed_heap.c_library_function("malloc_trim") is None:
        pytest.skip("the C library has no malloc_trim (not glibc)")
    process = psutil.Process()
    freed, kept = [], []
    for _ in range(1000):  # 64 KiB blocks (heap, under glibc's mmap threshold) between kept ones
        freed.append(torch.ones(16384))
        kept.append(torch.ones(1024))
    before = process.memory_info().rss
    del freed
    after_free = process.memory_info().rss
    assert freed_heap.give_back_freed_heap()
    after_trim = process.memory_info().rss
    if before - after_free >= 16 << 20:
        # Where the heap's earlier life left the freed blocks at its top (the kept ones served from
        # free lists elsewhere: seen in one run of the whole suite under torch 2.11), glibc trims them
        # by itself: nothing is left for malloc_trim to show here.
        pytest.skip("this process's heap gave the freed blocks back by itself (they lay at its top)")
    assert after_free - after_trim > 32 << 20
    del kept


@pytest.mark.parametrize("release", [True, False])
def test_backward_gives_freed_heap_back_at_each_acquisition(tmp_path, monkeypatch, release: bool) -> None:
    """With tiers.release_idle_memory on the CPU, each backward acquisition gives the heap its
    activations freed back (so the peak holds the larger of activations and gradients, not both);
    without it, never."""
    calls: List[int] = []
    monkeypatch.setattr(tiers_module, "give_back_freed_heap", lambda: calls.append(1) or True)
    cfg = ot.OffloadConfig(
        tiers=dict(params="nvme", grads="host", optimizer="nvme", nvme_dir=str(tmp_path), release_idle_memory=release),
        optimizer=OPT,
    )
    engine = ot.initialize(TinyLM(dim=64, n_layers=2), cfg, device="cpu")
    acquisitions: List[int] = []
    real = engine.scheduler.acquire
    monkeypatch.setattr(
        engine.scheduler, "acquire", lambda ids, backward=False: (acquisitions.append(1) if backward else None, real(ids, backward))[1]
    )
    try:
        x, y = batches(1, accum=1)[0][0]
        out = engine(x)
        engine.backward(nn.CrossEntropyLoss()(out.reshape(-1, VOCAB), y.reshape(-1)))
        assert acquisitions
        assert len(calls) == (len(acquisitions) if release else 0)
        assert (engine._running.heap_release_s > 0) is release
    finally:
        engine.close()
