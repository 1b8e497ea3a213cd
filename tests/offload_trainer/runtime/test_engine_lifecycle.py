"""The engine's life as a notebook or a long-lived process sees it: an engine dropped without
close() gives back its threads, memory and swap files once collected (with a ResourceWarning), and
close() ends every thread it started, however the loop before it ended."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, List, Tuple

import pytest
import torch

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM


def config(tmp_path: Path) -> ot.OffloadConfig:
    return ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path)},
        optimizer={"lr": 1e-3},
    )


def train_and_drop(tmp_path: Path, steps: int) -> "weakref.ref[ot.Engine]":
    """An engine that trained `steps` steps, its updates done, then dropped with its model, unclosed."""
    model = DecoderLM(DecoderConfig.preset("tiny"))
    engine = ot.initialize(model, config(tmp_path), device="cpu")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        engine.backward(engine(tokens, tokens.roll(-1, 1))[1])
        engine.step()
    engine.wait_for_updates()
    return weakref.ref(engine)


def collected(ref: Callable[[], object]) -> bool:
    """Whether the collector takes `ref`'s object: the update thread lets go of a finished pass's
    objects just after it says the pass is done, so a few collections may be needed."""
    deadline = time.monotonic() + 30
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return ref() is None


class _InterruptedWait:
    """A read's handle whose first wait raises KeyboardInterrupt while the read goes on in the IO
    workers, as after a real Ctrl-C; later waits wait for it."""

    def __init__(self, handle: object) -> None:
        self.handle = handle
        self.interrupted = False

    def wait(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt()
        self.handle.wait()  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.handle, name)


@pytest.mark.parametrize("steps", [0, 2])
def test_an_engine_dropped_without_close_is_closed_when_collected(tmp_path: Path, steps: int) -> None:
    """`del engine` (or a notebook cell run again) without close(): its 11 threads (IO workers, the
    update thread, the copy workers) held it, so it was never collected: each engine made and
    dropped kept its threads, its host memory and its swap files until the process ended. The
    parameters' gradient hooks (held by C++, out of the collector's sight) held it too."""
    before = set(threading.enumerate())
    with pytest.warns(ResourceWarning, match=r"dropped without close\(\).*call engine\.close\(\)"):
        ref = train_and_drop(tmp_path, steps)
        assert collected(ref), "the dropped engine was never collected"
    left = [t.name for t in threading.enumerate() if t not in before]
    assert not left, f"threads of the dropped engine still running: {left}"
    assert not list(tmp_path.iterdir()), "its swap directory is still there"


def test_an_engine_closed_leaves_no_thread_and_is_collected(tmp_path: Path) -> None:
    """close() ends every thread the engine started; the closed engine, dropped, is collected (no
    warning: it was closed)."""
    before = set(threading.enumerate())
    model = DecoderLM(DecoderConfig.preset("tiny"))
    engine = ot.initialize(model, config(tmp_path), device="cpu")
    tokens = torch.randint(0, 256, (2, 16))
    engine.backward(engine(tokens, tokens)[1])
    engine.step()
    engine.close()
    engine.close()  # idempotent
    assert not [t.name for t in threading.enumerate() if t not in before]
    ref = weakref.ref(engine)
    del engine, model
    assert collected(ref)


@pytest.mark.parametrize("grads", ["host", "nvme"])
def test_after_a_swap_write_failed_close_frees_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grads: str) -> None:
    """The disk fails (EIO) under training: the loop gets the TransferError naming the file, offset
    and size, and close() then ends every thread and removes the swap directory. Before, a gradient
    write that failed left its buffer listed after it was given back ("staging buffer returned
    twice", raised in place of the disk's error), and close() stopped at the first error: the
    engine's threads and swap files stayed until the process ended."""
    import errno
    import os

    from io_engine import TransferError

    before = set(threading.enumerate())
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": grads, "optimizer": "nvme", "nvme_dir": str(tmp_path)},
        optimizer={"lr": 1e-3}, grad_accum_steps=2,
    )
    engine = ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg, device="cpu")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        for _ in range(2):
            engine.backward(engine(tokens, tokens.roll(-1, 1))[1] / 2)
        engine.step()
        engine.wait_for_updates()

    step()
    pwritev = os.pwritev

    def failing(fd: int, buffers: object, offset: int, *rest: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwritev", failing)
    with pytest.raises(TransferError, match=r"write of \d+ bytes at offset \d+ in .*swap-0000\.bin failed: Input/output error"):
        step()
    with contextlib.suppress(TransferError):  # close() may raise the same failure again, once all is freed
        engine.close()
    monkeypatch.setattr(os, "pwritev", pwritev)
    assert not [t.name for t in threading.enumerate() if t not in before]
    assert not list(tmp_path.iterdir()), "the swap directory is still there"


def test_after_a_swap_write_failed_the_loop_that_goes_on_is_refused_until_a_checkpoint_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fails (EIO) while a step writes the updated state; the loop catches the TransferError and
    goes on. The swap extents that write was replacing hold neither the old state nor the new, and
    the next forward read them (the update's parameters in part, the old ones where the write failed
    first) and trained on without a word. Now reading them raises LostWriteError naming the swap file;
    loading a checkpoint writes every extent again, and training goes on from it, bitwise as an engine
    that never failed (io_engine's [Note: Checksums of swap extents])."""
    import errno
    import os

    from io_engine import LostWriteError, TransferError

    def run(fail: bool) -> Tuple[torch.Tensor, ...]:
        cfg = ot.OffloadConfig(
            tiers={"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path / f"swap{fail}")},
            optimizer={"lr": 1e-3},
        )
        torch.manual_seed(0)
        engine = ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg, device="cpu")
        # Loads that read the homes (the extents a failed write lost): not filled by the update pass
        # ([Note: The next forward's load from the update]), whose writes would all fail here, step()
        # no longer waiting for the first ones.
        engine.scheduler.fill_from_update = lambda gi, shard, after: None
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

        def step(writes: Callable[..., int] = os.pwritev) -> None:
            engine.backward(engine(tokens, tokens.roll(-1, 1))[1])
            monkeypatch.setattr(os, "pwritev", writes)  # the update's writes alone
            try:
                engine.step()
                engine.wait_for_updates()
            finally:
                monkeypatch.undo()

        def failing(fd: int, buffers: object, offset: int, *rest: object) -> int:
            raise OSError(errno.EIO, "Input/output error")

        with engine:
            step()
            engine.save_checkpoint(tmp_path / f"ckpt{fail}")
            if fail:
                with pytest.raises(TransferError):
                    step(failing)
                # Each failed write is raised once, at the wait that finds it; then the loop is refused:
                # by the lost extents a load reads (LostWriteError), or, where the pass itself found a
                # write failed before it ended, by the pass that failed part-way (PartialStateError, at
                # the next call: which of the two comes first depends on when the writes fail).
                for _ in range(4):
                    with pytest.raises((TransferError, ot.PartialStateError)) as info:
                        step()
                    if isinstance(info.value, (LostWriteError, ot.PartialStateError)):
                        break
                if isinstance(info.value, LostWriteError):
                    assert "the last write of extent" in str(info.value) and "swap-0000.bin" in str(info.value)
                else:
                    assert isinstance(info.value, ot.PartialStateError), info.value
                    assert "failed part-way (TransferError" in str(info.value) and "load_checkpoint" in str(info.value)
                    with pytest.raises(ot.PartialStateError):
                        step()  # refused again, until the load below
                engine.load_checkpoint(tmp_path / f"ckpt{fail}")
            step()
            return tuple(t.clone() for t in engine.full_state_dict().values())

    for ours, theirs in zip(run(True), run(False), strict=True):
        assert torch.equal(ours, theirs)


class _Interrupted(Exception):
    """What the loop raises at the chosen point (a bad batch, a bug in the loss, a scheduler)."""


def _raise(error: BaseException) -> Callable[..., None]:
    def hook(*args: object) -> None:
        raise error

    return hook


@pytest.mark.parametrize("point", ["forward_ctrl_c", "loss", "backward_ctrl_c", "before_step", "lr_schedule"])
def test_the_loop_goes_on_after_an_exception_at_any_point(tmp_path: Path, point: str) -> None:
    """An exception at each point of the loop, caught, then training on: bitwise plain PyTorch's
    loop that had the same exception at the same point (Ctrl-C is a KeyboardInterrupt raised from a
    forward or backward hook), then a checkpoint saved and loaded, and close(). A backward that
    raised drops the step's gradients (as zero_grad() after it); an exception between backward and
    step, or from the learning-rate schedule inside step(), keeps them: the next backward adds to
    them, as .grad does."""
    import copy

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "nvme", "optimizer": {"host": 0.5, "nvme": 0.5}, "nvme_dir": str(tmp_path)},
        optimizer={"lr": 3e-3, "grad_clip_norm": 1.0, "weight_decay": 0.1},
    )
    ref = copy.deepcopy(model)
    opt = _plain_adamw(ref, cfg)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(5)]
    error: BaseException = KeyboardInterrupt() if point.endswith("ctrl_c") else _Interrupted()

    def one_step(net: torch.nn.Module, forward: Callable, backward: Callable, step: Callable, fail: bool) -> None:
        handles = []
        if fail and point == "forward_ctrl_c":
            handles.append(net.layers[1].register_forward_hook(_raise(error)))
        if fail and point == "backward_ctrl_c":
            handles.append(net.layers[1].register_full_backward_hook(_raise(error)))
        try:
            loss = forward()
            if fail and point == "loss":
                raise error
            backward(loss)
            if fail and point == "before_step":
                raise error
            step(fail and point == "lr_schedule")
        finally:
            for handle in handles:
                handle.remove()

    def ref_backward(loss: torch.Tensor) -> None:
        try:
            loss.backward()
        except BaseException:
            opt.zero_grad()  # README: a backward that raised drops the step's gradients
            raise

    def ref_step(fail: bool) -> None:
        if fail:  # the schedule is asked before the update
            raise error
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    with ot.initialize(model, cfg, device="cpu") as engine:
        def engine_step(fail: bool) -> None:
            if fail:
                engine.lr_schedule = _raise(error)
            try:
                engine.step()
            finally:
                engine.lr_schedule = cfg.optimizer.lr_at

        for k, tokens in enumerate(batches):
            targets = tokens.roll(-1, 1)
            for net, forward, backward, step in (
                (ref, lambda x=tokens, y=targets: ref(x, y)[1], ref_backward, ref_step),
                (model, lambda x=tokens, y=targets: engine(x, y)[1], engine.backward, engine_step),
            ):
                with pytest.raises(type(error)) if k == 2 else contextlib.nullcontext():
                    one_step(net, forward, backward, step, fail=k == 2)
        state = engine.full_state_dict()
        assert not [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
        engine.load_checkpoint(engine.save_checkpoint(tmp_path / "ckpt"))
        assert not [n for n, p in engine.full_state_dict().items() if not torch.equal(p, state[n])]


def test_ctrl_c_inside_a_gradient_flush_keeps_training_going(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C landing while a flush waits for its read of the gradient home (NVMe gradients,
    accumulation 2): the flush's staging buffers, one with the read still in flight into it, were
    lost, and every step after failed with "all host staging buffers are busy" ([Note: A flush
    interrupted] in runtime/gradients.py). Now the step's gradients are dropped, as for any
    backward that raised, and training goes on bitwise as plain PyTorch's loop that zeroed its
    gradients after the same interrupt."""
    import copy

    from offload_trainer.runtime.groups import homes
    armed = {"on": False}
    real_start_read = homes.Home.start_read

    def start_read(self: homes.Home, *args: object, **kwargs: object) -> object:
        handle = real_start_read(self, *args, **kwargs)
        callers = {sys._getframe(depth).f_code.co_name for depth in (1, 2, 3)}
        if armed["on"] and "_read_after_writes" in callers:  # the flush's read of the home
            armed["on"] = False
            return _InterruptedWait(handle)
        return handle

    monkeypatch.setattr(homes.Home, "start_read", start_read)
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path)},
        optimizer={"lr": 3e-3, "grad_clip_norm": 1.0},
        grad_accum_steps=2,
    )
    ref = copy.deepcopy(model)
    opt = _plain_adamw(ref, cfg)
    g = torch.Generator().manual_seed(5)
    batches = [[torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)] for _ in range(5)]
    with ot.initialize(model, cfg, device="cpu") as engine:
        for k, micro in enumerate(batches):
            interrupted = False
            engine.wait_for_updates()  # the last pass's reads ahead hold their buffers from here to the next pass
            assert engine.staging is not None
            free_before = engine.staging.num_free
            for m, tokens in enumerate(micro):
                targets = tokens.roll(-1, 1)
                (ref(tokens, targets)[1] / 2).backward()
                armed["on"] = k == 2 and m == 1  # the second micro-batch's flush reads the first's sums
                try:
                    engine.backward(engine(tokens, targets)[1] / 2)
                except KeyboardInterrupt:
                    interrupted = True
                    opt.zero_grad()  # README: a backward that raised drops the step's gradients
                    assert engine.staging.num_free == free_before, "the flush's staging buffers were lost"
            assert interrupted is (k == 2)
            if interrupted:
                assert not engine.step()  # nothing accumulated: no update
                continue
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            assert engine.step()
        state = engine.full_state_dict()
    assert not [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]


def _fail_at_call(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, n: int) -> None:
    """Make the `n`th call of owner.name raise an OSError, as a failing disk would."""
    original, calls = getattr(owner, name), [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise OSError(5, "Input/output error (injected)")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


@pytest.mark.parametrize("params", ["host", "nvme"])
@pytest.mark.parametrize(
    "where",
    ["third-group-written", "after-the-hooks"],
)
def test_an_engine_that_fails_to_build_gives_the_model_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, params: str, where: str
) -> None:
    """An Engine whose construction fails after it took some of the model's parameters (a disk error
    writing the third group, an error after the hooks were put on) used to leave the model with
    empty placeholders and, past the hooks, with hooks calling a dead engine: a model loaded over
    minutes was lost, and a second engine refused it as "given to an engine that is closed". The
    parameters now get their values back, the hooks come off, and the model trains again."""
    from offload_trainer.runtime import engine as engine_module

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = model(tokens, tokens.roll(-1, 1))[1].detach()
    cfg = ot.OffloadConfig(
        tiers={"params": params, "grads": "host", "optimizer": params, "nvme_dir": str(tmp_path)},
        optimizer={"lr": 1e-3},
    )
    if where == "third-group-written":
        _fail_at_call(monkeypatch, engine_module.Engine, "_write_initial_shard", 3)
    else:
        _fail_at_call(monkeypatch, engine_module, "LayerMajorSchedule", 1)
    with pytest.raises(OSError, match="injected") as failed:
        ot.initialize(model, cfg, device="cpu")
    assert any("given back" in note for note in getattr(failed.value, "__notes__", [])), failed.value
    monkeypatch.undo()
    for name, p in model.named_parameters():
        assert p.shape == before[name].shape and torch.equal(p.detach(), before[name]), name
    assert torch.equal(model(tokens, tokens.roll(-1, 1))[1].detach(), expected)  # no hook of the dead engine
    assert set(model.state_dict()) == set(before)  # not refused as an engine's model
    with ot.initialize(model, cfg, device="cpu") as engine:
        engine.backward(engine(tokens, tokens.roll(-1, 1))[1])
        engine.step()


def test_a_failed_build_in_low_precision_gives_back_the_fp32_masters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In bf16 compute the parameter homes hold bf16: a trainable parameter comes back exact from its
    fp32 master; a frozen one has no master, so it comes back rounded, and the note says so."""
    from offload_trainer.runtime import engine as engine_module

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    model.layers[0].mlp.gate_proj.weight.requires_grad_(False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path)},
        precision={"compute_dtype": "bf16"},
    )
    _fail_at_call(monkeypatch, engine_module, "LayerMajorSchedule", 1)
    with pytest.raises(OSError, match="injected") as failed:
        ot.initialize(model, cfg, device="cpu")
    assert any("given back" in n and "frozen ones rounded to torch.bfloat16" in n for n in failed.value.__notes__)
    for name, p in model.named_parameters():
        want = before[name]
        if name == "layers.0.mlp.gate_proj.weight":
            want = want.to(torch.bfloat16).float()
        assert p.dtype == torch.float32 and torch.equal(p.detach(), want), name


EXIT_WITHOUT_CLOSE = """
import sys, torch
sys.path.insert(0, {repo!r})
import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM

fused = torch._fused_adamw_
def slow_fused(*args, **kwargs):  # the update pass is in a torch op (the GIL released) when the script ends
    a = torch.ones(2000, 2000)
    a = a @ a / 2000  # about a second here
    return fused(*args, **kwargs)
torch._fused_adamw_ = slow_fused
model = DecoderLM(DecoderConfig.preset("tiny"))
engine = ot.initialize(model, ot.OffloadConfig(tiers={{"params": "nvme", "optimizer": "nvme", "nvme_dir": {nvme!r}}}), device="cpu")
t = torch.randint(0, 256, (2, 16))
engine.backward(engine(t, t.roll(-1, 1))[1])
engine.step()
print("script done", flush=True)
"""


def test_a_script_ending_without_close_exits_cleanly(tmp_path: Path) -> None:
    """A script that trains and ends without engine.close() aborted at exit about half the time
    ("terminate called without an active exception", exit code 134): the update pass still ran
    behind the last step, inside a torch op, and a daemon thread that wakes in C++ code while the
    interpreter finalizes is torn down by an unwind that C++ turns into std::terminate. Engines
    still open are closed at exit now (the pass finished, threads ended, swap files removed)."""
    import subprocess
    import sys as _sys

    script = tmp_path / "script.py"
    script.write_text(EXIT_WITHOUT_CLOSE.format(repo=str(Path(__file__).resolve().parents[3]), nvme=str(tmp_path / "swap")))
    done = subprocess.run([_sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "script done" in done.stdout, (done.returncode, done.stderr[-2000:])
    assert "terminate called" not in done.stderr
    swap = tmp_path / "swap"
    assert not swap.exists() or not any(p.is_file() for p in swap.rglob("*")), list(swap.rglob("*"))


def test_a_held_model_refuses_deepcopy_and_pickling_saying_what_to_do(tmp_path: Path) -> None:
    """copy.deepcopy of a model the engine holds (an EMA's AveragedModel, a best model kept aside)
    copied its empty placeholders without a word; torch.save(model) failed on a hook's local
    function. Both now raise TypeError naming the fix, open or closed; before initialize they work."""
    import copy
    import io
    import pickle

    from torch.optim.swa_utils import AveragedModel

    model = DecoderLM(DecoderConfig.preset("tiny"))
    copy.deepcopy(model)  # not held yet: a real copy
    engine = ot.initialize(model, config(tmp_path), device="cpu")
    for copying in (
        lambda: copy.deepcopy(model), lambda: copy.deepcopy(model.layers[0]), lambda: AveragedModel(model),
        lambda: torch.save(model, io.BytesIO()), lambda: pickle.dumps(model.layers[1].mlp),
    ):
        with pytest.raises(TypeError, match=r"held by an offload_trainer engine.*engine\.full_state_dict\(\)"):
            copying()
    tokens = torch.randint(0, 256, (2, 16))
    engine.backward(engine(tokens, tokens.roll(-1, 1))[1])  # the refusals changed nothing
    engine.step()
    engine.close()
    with pytest.raises(TypeError, match="an engine that is closed took"):
        copy.deepcopy(model)


def test_a_closed_engines_parameter_refuses_deepcopy_and_pickling(tmp_path: Path) -> None:
    """After close() the model refused copy.deepcopy and torch.save, but its parameters, their own class
    again, did not: torch.save(p) wrote the 0-element placeholder and copy.deepcopy(p) made one, without
    a word ([Note: A closed engine's parameter is not copied] in model_claims.py). Both now raise
    TypeError naming the parameter; one given values again copies them, as plain PyTorch does."""
    import copy
    import io
    import pickle

    model = DecoderLM(DecoderConfig.preset("tiny"))
    engine = ot.initialize(model, config(tmp_path), device="cpu")
    engine.close()
    weight = model.layers[0].mlp.up_proj.weight
    for copying in (
        lambda: torch.save(weight, io.BytesIO()), lambda: copy.deepcopy(weight),
        lambda: torch.save(list(model.parameters()), io.BytesIO()), lambda: pickle.dumps(weight),
    ):
        with pytest.raises(TypeError, match=r"parameter '(layers\.0\.mlp\.up_proj|embed_tokens)\.weight'.*engine.*is closed.*full_state_dict"):
            copying()
    weight.data = torch.arange(6.0).reshape(2, 3)
    saved = io.BytesIO()
    torch.save(weight, saved)
    saved.seek(0)
    for copied in (torch.load(saved, weights_only=False), copy.deepcopy(weight)):
        assert type(copied) is torch.nn.Parameter and torch.equal(copied, weight), copied


def test_a_closed_engines_model_refuses_a_forward_saying_why(tmp_path: Path) -> None:
    """After close() the model keeps empty placeholders (README). `model(x)` then failed inside
    torch, "'weight' must be 2-D" from the embedding, naming neither the engine nor the fix; now
    each module holding them refuses its forward with UnresidentReadError naming the module and
    what to do. A forward over real values still runs: torch.func.functional_call with the
    engine's full_state_dict(), and a module given new parameters, match plain PyTorch."""
    from torch.func import functional_call

    from offload_trainer.errors import UnresidentReadError

    model = DecoderLM(DecoderConfig.preset("tiny"))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    engine = ot.initialize(model, config(tmp_path), device="cpu")
    engine.backward(engine(tokens, tokens.roll(-1, 1))[1])
    engine.step()
    state = engine.full_state_dict()
    engine.close()
    with pytest.raises(UnresidentReadError, match=r"forward of module 'embed_tokens'.*engine that held.*closed.*full_state_dict"):
        model(tokens)
    with pytest.raises(UnresidentReadError, match=r"forward of module 'layers\.0\.mlp\.up_proj'"):
        model.layers[0].mlp.up_proj(torch.ones(2, model.layers[0].mlp.up_proj.in_features))
    plain = DecoderLM(DecoderConfig.preset("tiny"))
    plain.load_state_dict(state)
    assert torch.equal(functional_call(model, state, (tokens,)), plain(tokens))
    up = model.layers[0].mlp.up_proj
    up.weight = torch.nn.Parameter(state["layers.0.mlp.up_proj.weight"].clone())
    x = torch.ones(2, up.in_features)
    assert torch.equal(up(x), plain.layers[0].mlp.up_proj(x))


def _fp16_model(tmp_path: Path) -> Tuple[torch.nn.Module, ot.OffloadConfig, dict]:
    return DecoderLM(DecoderConfig.preset("tiny")).half(), config(tmp_path), {}


def _nvme_dir_a_file(tmp_path: Path) -> Tuple[torch.nn.Module, ot.OffloadConfig, dict]:
    (tmp_path / "a-file").write_text("")
    return DecoderLM(DecoderConfig.preset("tiny")), config(tmp_path / "a-file"), {}


def _auto_placement_refused(tmp_path: Path) -> Tuple[torch.nn.Module, ot.OffloadConfig, dict]:
    cfg = ot.OffloadConfig(placement="auto", tiers={"host_budget_bytes": 1000, "nvme_dir": str(tmp_path)})
    return DecoderLM(DecoderConfig.preset("tiny")), cfg, {"micro_batch": (2, 16)}


@pytest.mark.parametrize(
    "failing",
    [_fp16_model, _nvme_dir_a_file, pytest.param(_auto_placement_refused, marks=pytest.mark.slow)],
    ids=["fp16-model", "nvme-dir-a-file", "auto-placement-refused"],
)
def test_an_initialize_refused_before_the_build_leaves_no_thread(
    tmp_path: Path, failing: Callable[[Path], Tuple[torch.nn.Module, ot.OffloadConfig, dict]]
) -> None:
    """initialize refused after it made the device's copy path (and the IO engine) but before the
    build's own undo took over (a model of another dtype, an nvme_dir that cannot be used, a placement
    = "auto" that fits nowhere): each refusal left the two copy workers running, so a notebook
    retrying gathered two threads per try until the process ended."""
    before = set(threading.enumerate())
    for _ in range(2):
        model, cfg, kwargs = failing(tmp_path)
        with pytest.raises((ValueError, OSError)):
            ot.initialize(model, cfg, device="cpu", **kwargs)
    assert not [t.name for t in threading.enumerate() if t not in before]


def test_a_meta_model_refused_by_its_plan_can_be_given_again(tmp_path: Path) -> None:
    """A model built on the meta device whose initialize was refused (a host budget too small, a
    PlanError) kept the empty CPU parameters the build had put in place of the meta ones: the retry
    with the budget raised was refused as "init_fn is for a model built on the meta device", and
    without init_fn it built an engine over the empty ones ("'weight' must be 2-D" at the first
    forward). The meta parameters are put back, and the retry trains as a first try would."""
    from offload_trainer.models import init_weights

    def meta_model() -> DecoderLM:
        with torch.device("meta"):
            return DecoderLM(DecoderConfig.preset("tiny"))

    def tiers(**budget: int) -> ot.OffloadConfig:
        return ot.OffloadConfig(tiers={"params": "host", "grads": "host", "optimizer": "host", **budget})

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    with ot.initialize(meta_model(), tiers(), device="cpu", init_fn=init_weights) as engine:
        expected = engine(tokens, tokens.roll(-1, 1))[1].detach()
    model = meta_model()
    with pytest.raises(ot.PlanError, match="host_budget_bytes=1000"):
        ot.initialize(model, tiers(host_budget_bytes=1000), device="cpu", init_fn=init_weights)
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    with ot.initialize(model, tiers(), device="cpu", init_fn=init_weights) as engine:
        assert torch.equal(engine(tokens, tokens.roll(-1, 1))[1].detach(), expected)


class _LateWrite:
    """An io_engine write request submitted 0.5 s after it is asked for (a slow disk), whose wait on
    the training thread raises KeyboardInterrupt once while `interrupt` is set (Ctrl-C lands there);
    the write interrupted so is submitted 1 s after the interrupt, after the others."""

    def __init__(self, submit: Callable[[], object], interrupt: dict) -> None:
        self._interrupt = interrupt
        self._handle: object = None
        self._submitted = threading.Event()
        self._callbacks: list = []
        self._lock = threading.Lock()
        self._interrupted_at: "float | None" = None
        threading.Timer(0.5, self._submit, args=(submit,)).start()

    def _submit(self, submit: Callable[[], object]) -> None:
        if self._interrupted_at is not None:
            time.sleep(max(0.0, self._interrupted_at + 1.0 - time.monotonic()))
        handle = submit()
        with self._lock:
            self._handle = handle
            self._submitted.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            handle.add_done_callback(lambda _h, cb=callback: cb(self))  # type: ignore[attr-defined]

    def done(self) -> bool:
        return self._submitted.is_set() and self._handle.done()  # type: ignore[attr-defined]

    def wait(self, timeout: "float | None" = None) -> int:
        if self._interrupt["on"] and threading.current_thread() is threading.main_thread():
            self._interrupt["on"] = False
            self._interrupted_at = time.monotonic()
            raise KeyboardInterrupt()
        self._submitted.wait()
        return self._handle.wait(timeout)  # type: ignore[attr-defined]

    def add_done_callback(self, callback: Callable[[object], None]) -> None:
        with self._lock:
            if not self._submitted.is_set():
                self._callbacks.append(callback)
                return
        self._handle.add_done_callback(lambda _h: callback(self))  # type: ignore[attr-defined]


@pytest.mark.slow  # 12 s; test_optimizer_pipeline's unit test holds the mechanism by default
def test_ctrl_c_while_a_forward_waits_for_an_update_write_loses_no_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C landing while the next forward waits for an update's NVMe write (a group's load waits
    there while the update pass runs behind the forward: where the loop spends its waits, so where an
    interrupt lands), caught, and the forward made again: the writes were taken off the pipeline's
    list before the wait, so the group counted as written, and its next load read the home while
    the write was still to come: the step trained on the old values, silently ([Note: Writes leave
    the list once over] in runtime/optimizer_pipeline.py). The update pass's writes here are
    submitted late; training then matches plain PyTorch's loop, which made the forward once.
    Without the fix this fails two runs in three (what the late writes overwrite varies), never with it."""
    import io_engine.file_store
    late, interrupt = {"on": False}, {"on": False}
    pwrite_many = io_engine.file_store.FileStore.pwrite_many

    def late_pwrite_many(self: io_engine.file_store.FileStore, parts: object, *, background: bool = False) -> object:
        if not late["on"]:
            return pwrite_many(self, parts, background=background)  # type: ignore[arg-type]
        return _LateWrite(lambda: pwrite_many(self, parts, background=background), interrupt)  # type: ignore[arg-type]

    monkeypatch.setattr(io_engine.file_store.FileStore, "pwrite_many", late_pwrite_many)
    model, ref, opt, cfg, batches = _tiny_model_and_its_plain_twin(tmp_path)
    with ot.initialize(model, cfg, device="cpu") as engine:
        # Loads that wait for the write and read the home (not filled by the update pass: [Note: The
        # next forward's load from the update]; a Ctrl-C in a fill's wait is the test below).
        engine.scheduler.fill_from_update = lambda gi, shard, after: None
        for k, tokens in enumerate(batches):
            targets = tokens.roll(-1, 1)
            if k == 2:
                interrupt["on"] = True
                with pytest.raises(KeyboardInterrupt):
                    engine(tokens, targets)
                assert not interrupt["on"], "no wait for an update's write was interrupted"
                late["on"] = False
            _plain_step(ref, opt, tokens, targets)
            engine.backward(engine(tokens, targets)[1])
            late["on"] = late["on"] or k == 1  # step 1's update pass writes late: its writes are still to come at k == 2
            engine.step()
        state = engine.full_state_dict()
    assert not [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]


@pytest.mark.parametrize("device", ["cpu", "simulated"])
def test_ctrl_c_while_a_forward_waits_for_a_load_the_update_fills_trains_as_plain_pytorch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """The next forward's first loads wait for the update pass to fill them ([Note: The next forward's
    load from the update]): where the loop waits, so where a Ctrl-C lands. Caught, and the forward
    made again, the load is dropped (its fill withdrawn, or finished into a slot no one reads) and
    made again: training matches plain PyTorch's loop, which made the forward once."""
    from offload_trainer.runtime.optimizer_pipeline import ParamFill
    from tests.offload_trainer.runtime.test_engine_api import engine_device

    wait_issued = ParamFill.wait_issued
    interrupt = {"on": False}

    def interrupted(fill: ParamFill) -> None:
        if interrupt["on"] and threading.current_thread() is threading.main_thread():
            interrupt["on"] = False
            raise KeyboardInterrupt()
        wait_issued(fill)

    monkeypatch.setattr(ParamFill, "wait_issued", interrupted)
    model, ref, opt, cfg, batches = _tiny_model_and_its_plain_twin(tmp_path)
    with ot.initialize(model, cfg, device=engine_device(device)) as engine:
        for k, tokens in enumerate(batches):
            targets = tokens.roll(-1, 1)
            if k >= 1:
                interrupt["on"] = True
                with pytest.raises(KeyboardInterrupt):
                    engine(tokens, targets)
                assert not interrupt["on"], "no wait for a fill was interrupted"
            _plain_step(ref, opt, tokens, targets)
            engine.backward(engine(tokens, targets)[1])
            engine.step()
        state = engine.full_state_dict()
    assert not [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]


@pytest.mark.parametrize("device", ["cpu", "simulated"])
def test_a_load_interrupted_before_it_started_gives_its_slot_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """A Ctrl-C landing in a group load's wait before anything was issued into its device slot (for
    a parameter staging buffer, or for the slot's last users), caught, and the forward made again:
    the slot stayed taken by nobody, one fewer for every later step ([Note: A load that never
    started] in residency/scheduler.py). Training goes on bitwise as plain PyTorch's, every pool
    as full as before."""
    import copy

    from offload_trainer.runtime.device.host import SimulatedAccelerator
    from offload_trainer.runtime.groups.homes import Home
    calls = {"n": 0, "armed": False}
    start_read = Home.start_read

    def interrupted(self: Home, *args: object, **kwargs: object) -> object:
        if calls["armed"] and sys._getframe(1).f_code.co_name == "start_load":
            calls["n"] += 1
            if calls["n"] == 2:  # the forward's second load, before its read is issued
                calls["armed"] = False
                raise KeyboardInterrupt()
        return start_read(self, *args, **kwargs)  # type: ignore[arg-type]

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    ref = copy.deepcopy(model)
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path)},
        optimizer={"lr": 1e-3}, prefetch={"lookahead_groups": 1},
    )
    opt = _plain_adamw(ref, cfg)
    accel = SimulatedAccelerator(h2d_delay_s=0.0005, d2h_delay_s=0.0005) if device == "simulated" else "cpu"
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(3)]

    def free(engine: ot.Engine) -> list:
        engine.wait_for_updates()
        return [pool.num_free for pool in (engine.device_slots, engine.staging, engine.param_staging) if pool is not None]

    with ot.initialize(model, cfg, device=accel) as engine:
        monkeypatch.setattr(Home, "start_read", interrupted)
        for k, tokens in enumerate(batches):
            targets = tokens.roll(-1, 1)
            if k == 1:
                calls["armed"] = True
                with pytest.raises(KeyboardInterrupt):
                    engine(tokens, targets)
                assert calls["n"] == 2
            _plain_step(ref, opt, tokens, targets)
            engine.backward(engine(tokens, targets)[1])
            engine.step()
            if k == 0:
                before = free(engine)  # after a step: the next forward's first loads and states read ahead hold some
        assert free(engine) == before, "a device slot (or staging buffer) was lost"
        state = engine.full_state_dict()
    assert not [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]


class _FailedRead:
    """An io_engine read whose wait, once the read is over, raises EIO's TransferError (a read that
    failed on the disk while the pass went on)."""

    def __init__(self, handle: object) -> None:
        self.handle = handle

    def done(self) -> bool:
        return self.handle.done()  # type: ignore[attr-defined]

    def wait(self, timeout: "float | None" = None) -> int:
        import errno

        from io_engine import TransferError

        self.handle.wait(timeout)  # type: ignore[attr-defined]
        raise TransferError("read", "swap-0000.bin", 0, 4096, errno.EIO)

    def add_done_callback(self, callback: Callable[[object], None]) -> None:
        self.handle.add_done_callback(lambda _h: callback(self))  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["fails", "refused"])
def test_a_read_that_fails_in_an_update_pass_gives_its_buffers_back_and_refuses_the_mix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The disk fails a read of the optimizer states in an update pass (EIO once the read is over, or
    a request refused when it is made): the pass raised, holding the staging buffers of the loads it
    had started (the chunk it updated, the one read ahead of it, the states read ahead for its first
    groups), and they never went back: 6 of 15 lost per failed pass, then "all 15 host staging
    buffers are busy" for good ([Note: A failed pass gives its reads' buffers back] in optimizer.py).
    Now every buffer is free after the failure. The groups after the failed read missed the step's
    update, and a loop that went on trained on that mix without a word: now it is refused
    (PartialStateError: [Note: A pass that failed part-way] in optimizer_pipeline.py) until a
    checkpoint is loaded, from which it trains on bitwise as an engine that never failed."""
    import errno

    from io_engine import TransferError

    from offload_trainer.runtime import optimizer

    start_reads = optimizer.start_reads
    calls = {"n": 0, "armed": False}

    def failing(tiers: object, moves: object, *rest: object) -> object:
        if calls["armed"] and threading.current_thread().name == "optimizer-updates":
            calls["n"] += 1
            if calls["n"] == 3:  # the pass holds three loads by then
                calls["armed"] = False
                if how == "refused":
                    raise TransferError("read", "swap-0000.bin", 0, 4096, errno.EIO)
                return [_FailedRead(h) for h in start_reads(tiers, moves, *rest)]  # type: ignore[arg-type]
        return start_reads(tiers, moves, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(optimizer, "start_reads", failing)

    def run(fail: bool) -> Tuple[torch.Tensor, ...]:
        cfg = ot.OffloadConfig(
            tiers={"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path / f"swap{fail}")},
            optimizer={"lr": 1e-3},
        )
        torch.manual_seed(0)
        engine = ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg, device="cpu")
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

        def step() -> None:
            engine.backward(engine(tokens, tokens.roll(-1, 1))[1])
            engine.step()
            engine.wait_for_updates()

        with engine:
            assert engine.staging is not None
            step()
            engine.save_checkpoint(tmp_path / f"ckpt{fail}")
            if fail:
                calls["armed"] = True
                with pytest.raises(TransferError, match="Input/output error"):
                    step()
                assert calls["n"] == 3
                assert engine.staging.num_free == engine.staging.num_buffers, "staging buffers lost"
                # The groups after the failed read missed the step's update: nothing goes on from that mix.
                for refused in (step, engine.full_state_dict, lambda: engine.save_checkpoint(tmp_path / "mixed")):
                    with pytest.raises(ot.PartialStateError, match=r"update pass .* failed part-way \(TransferError.*load_checkpoint"):
                        refused()
                assert not (tmp_path / "mixed").exists()
                engine.load_checkpoint(tmp_path / f"ckpt{fail}")
            step()
            step()
            return tuple(t.clone() for t in engine.full_state_dict().values())

    for ours, theirs in zip(run(True), run(False), strict=True):
        assert torch.equal(ours, theirs)


def _tiny_model_and_its_plain_twin(
    tmp_path: Path,
) -> Tuple[DecoderLM, torch.nn.Module, torch.optim.AdamW, ot.OffloadConfig, List[torch.Tensor]]:
    """The tiny decoder for an engine, its copy and fused AdamW for plain PyTorch (config(tmp_path)), and
    four batches of tokens."""
    import copy

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    ref = copy.deepcopy(model)
    cfg = config(tmp_path)
    g = torch.Generator().manual_seed(3)
    return model, ref, _plain_adamw(ref, cfg), cfg, [torch.randint(0, 256, (2, 16), generator=g) for _ in range(4)]


def _plain_step(ref: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    ref(tokens, targets)[1].backward()
    opt.step()
    opt.zero_grad()


def _plain_adamw(ref: torch.nn.Module, cfg: ot.OffloadConfig) -> torch.optim.AdamW:
    """Plain PyTorch's fused AdamW over `ref` with the engine's settings (the bitwise reference)."""
    from offload_trainer.runtime.optimizer import torch_param_groups

    o = cfg.optimizer
    return torch.optim.AdamW(torch_param_groups(ref, o), lr=o.lr, betas=o.betas, eps=o.eps, fused=True)


def _tiny_nvme_engine(tmp_path: Path, name: str) -> ot.Engine:
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path / name)},
        optimizer={"lr": 1e-2},
    )
    torch.manual_seed(0)
    return ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg, device="cpu")


def _train(engine: ot.Engine, steps: int) -> None:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        engine.backward(engine(tokens, tokens.roll(-1, 1))[1])
        engine.step()


def _refused_everywhere(engine: ot.Engine, tmp_path: Path, match: str) -> None:
    """Every way of computing, saving or exporting from the engine raises PartialStateError."""
    tokens = torch.randint(0, 256, (2, 16))
    for refused in (
        lambda: engine(tokens, tokens), lambda: engine.model(tokens), lambda: engine.step(),
        engine.full_state_dict, lambda: engine.save_checkpoint(tmp_path / "mixed"),
        lambda: engine.export_safetensors(tmp_path / "mixed.safetensors"),
    ):
        with pytest.raises(ot.PartialStateError, match=match):
            refused()
    assert not (tmp_path / "mixed").exists() and not (tmp_path / "mixed.safetensors").exists()


def test_a_checkpoint_load_that_fails_part_way_is_refused_until_a_load_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_checkpoint checks every record, then writes the homes group by group. One that raised part-way
    (a Ctrl-C in a load of minutes, a file unreadable while it is read) left the engine with the
    checkpoint's step count and some groups' values, its own in the others: a loop that caught the error
    trained (and could save a checkpoint) on that mix without a word. Now everything that computes, saves
    or exports raises PartialStateError naming the load ([Note: A load that failed part-way] in engine.py),
    a load refused before it writes (a damaged checkpoint) leaves it so, and a load that completes mends it:
    training goes on bitwise as an engine that loaded the checkpoint at once."""
    from offload_trainer.runtime.groups.homes import Home

    with _tiny_nvme_engine(tmp_path, "a") as engine:
        _train(engine, 1)
        checkpoint = engine.save_checkpoint(tmp_path / "ckpt")
        _train(engine, 2)
        write = Home.write
        calls = {"n": 0}

        def interrupted(self: Home, *args: object, **kwargs: object) -> None:
            calls["n"] += 1
            if calls["n"] == 5:  # the fifth home written
                raise KeyboardInterrupt()
            write(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Home, "write", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.load_checkpoint(checkpoint)
        monkeypatch.setattr(Home, "write", write)
        match = r"engine\.load_checkpoint\('.*ckpt'\) raised after it had written part of .*load again: engine\.load_checkpoint"
        _refused_everywhere(engine, tmp_path, match)
        damaged = tmp_path / "damaged"
        import shutil

        shutil.copytree(checkpoint, damaged)
        with open(damaged / "rank00000.bin", "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(ot.CheckpointError, match="fails its checksum"):
            engine.load_checkpoint(damaged)
        _refused_everywhere(engine, tmp_path, match)  # a refused load changed nothing: still the mix
        engine.load_checkpoint(checkpoint)
        _train(engine, 2)
        ours = engine.full_state_dict()
    with _tiny_nvme_engine(tmp_path, "b") as engine:
        engine.load_checkpoint(checkpoint)
        _train(engine, 2)
        theirs = engine.full_state_dict()
    assert not [n for n in theirs if not torch.equal(ours[n], theirs[n])]


def test_a_weights_load_that_fails_part_way_is_refused_until_a_load_completes(tmp_path: Path) -> None:
    """load_safetensors writes each tensor as it reads it; one found to hold a NaN (a damaged download) is
    refused then, the tensors before it written already: the loop that caught the ValueError trained on
    part the new weights, part the old. Now that is refused (PartialStateError) until a load completes: the
    good weights loaded again give bitwise an engine that loaded them at once."""
    import safetensors.torch

    from offload_trainer.runtime.persist.safetensors_load import SafetensorsFiles

    with _tiny_nvme_engine(tmp_path, "a") as engine:
        _train(engine, 1)
        weights = {n: t.clone() for n, t in engine.full_state_dict().items()}
        good = tmp_path / "good.safetensors"
        safetensors.torch.save_file(weights, str(good))
        last = SafetensorsFiles([good]).units()[-1].names[0]  # the tensor read last
        bad = dict(weights)
        bad[last] = bad[last].clone()
        bad[last].view(-1)[0] = float("nan")
        safetensors.torch.save_file(bad, str(tmp_path / "bad.safetensors"))
        _train(engine, 1)
        with pytest.raises(ValueError, match="NaN or infinite"):
            engine.load_safetensors([tmp_path / "bad.safetensors"])
        _refused_everywhere(
            engine, tmp_path, r"engine\.load_safetensors\(\.\.\.\) raised after .*or the weights again with engine\.load_safetensors"
        )
        with pytest.raises(ValueError, match="do not fit"):  # refused before anything is written: still the mix
            engine.load_safetensors([tmp_path / "bad.safetensors", good])
        with pytest.raises(ot.PartialStateError):
            engine.full_state_dict()
        engine.load_safetensors([good])
        _train(engine, 1)
        ours = engine.full_state_dict()
    with _tiny_nvme_engine(tmp_path, "b") as engine:
        _train(engine, 2)
        engine.load_safetensors([good])
        _train(engine, 1)
        theirs = engine.full_state_dict()
    assert not [n for n in theirs if not torch.equal(ours[n], theirs[n])]


class _SkipsABlock(torch.nn.Module):
    """Three blocks; the middle one is skipped when asked (an idle expert, a layer dropped): its
    parameters get a gradient in some micro-batches only."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(3)])

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (skip and i == 1):
                x = torch.tanh(block(x))
        return x.square().mean()


def test_ctrl_c_in_the_steps_norm_read_keeps_every_staging_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The global norm reads a gradient home back from NVMe in step() for a parameter whose norm its last
    micro-batch did not take (one that got no gradient there: a block skipped). A Ctrl-C in that wait,
    caught, and step() called again: the read's staging buffer was lost, one fewer for every later step
    (9 of 12 free before, 8 after). Now it goes back once the read is over, and training matches plain
    PyTorch's loop bitwise."""
    import copy

    from offload_trainer.runtime.groups import homes
    armed = {"on": False}
    start_read = homes.Home.start_read

    def interrupted(self: homes.Home, *args: object, **kwargs: object) -> object:
        handle = start_read(self, *args, **kwargs)
        if armed["on"] and sys._getframe(1).f_code.co_name == "_read_home":
            armed["on"] = False
            return _InterruptedWait(handle)
        return handle

    monkeypatch.setattr(homes.Home, "start_read", interrupted)
    torch.manual_seed(0)
    model = _SkipsABlock()
    ref = copy.deepcopy(model)
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path)},
        optimizer={"lr": 1e-2}, grad_accum_steps=2,
    )
    opt = _plain_adamw(ref, cfg)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    with ot.initialize(model, cfg, device="cpu") as engine:
        assert engine.staging is not None
        for k in range(3):
            for skip in (False, True):
                (ref(x, skip) / 2).backward()
                engine.backward(engine(x, skip) / 2)
            opt.step()
            opt.zero_grad()
            if k == 1:
                armed["on"] = True
                with pytest.raises(KeyboardInterrupt):
                    engine.step()
                assert not armed["on"], "the norm's read was not interrupted"
            engine.step()
            engine.wait_for_updates()
            if k == 0:
                free = engine.staging.num_free
        assert engine.staging.num_free == free, "a staging buffer was lost"
        state = engine.full_state_dict()
    assert not [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]


@pytest.mark.parametrize("device", ["cpu", "simulated"])
def test_a_parameter_read_that_failed_once_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """A group's load from NVMe fails once (a disk's transient EIO): the forward raises the TransferError,
    and the loop goes on with the next batch. Every later forward raised the same error from the same
    failed read, the engine lost for good: on the CPU the group stayed LOADING with the failed read; on
    an accelerator the parameter staging buffer kept it as its last user, whose wait at each take raised
    it again ([Note: A failed transfer is its own user's error] in device/pending.py). Now the load is
    dropped and read again, and training goes on bitwise as plain PyTorch's loop that skipped that batch."""
    import copy

    from io_engine import TransferError

    from offload_trainer.runtime.device.host import SimulatedAccelerator
    from offload_trainer.runtime.groups.homes import Home
    armed = {"on": False}
    start_read = Home.start_read

    def failing(self: Home, *args: object, **kwargs: object) -> object:
        handle = start_read(self, *args, **kwargs)  # type: ignore[arg-type]
        if armed["on"] and sys._getframe(1).f_code.co_name == "start_load":
            armed["on"] = False
            return _FailedRead(handle)
        return handle

    monkeypatch.setattr(Home, "start_read", failing)
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    ref = copy.deepcopy(model)
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "host", "optimizer": "host", "nvme_dir": str(tmp_path)}, optimizer={"lr": 1e-3},
    )
    opt = _plain_adamw(ref, cfg)
    accel = SimulatedAccelerator(h2d_delay_s=0.0005, d2h_delay_s=0.0005) if device == "simulated" else "cpu"
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(4)]
    with ot.initialize(model, cfg, device=accel) as engine:
        # Loads that read the home (not filled by the update pass: [Note: The next forward's load
        # from the update]), so that the injected failure meets the first forward's first load.
        engine.scheduler.fill_from_update = lambda gi, shard, after: None
        for k, tokens in enumerate(batches):
            targets = tokens.roll(-1, 1)
            if k == 1:
                armed["on"] = True
                with pytest.raises(TransferError, match="Input/output error"):
                    engine(tokens, targets)
                assert not armed["on"], "no parameter load was made to fail"
                continue  # the next batch
            _plain_step(ref, opt, tokens, targets)
            engine.backward(engine(tokens, targets)[1])
            engine.step()
        state = engine.full_state_dict()
    assert not [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]


def test_ctrl_c_in_the_steps_prefetch_still_counts_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """step() submits the update, then loads the next forward's first groups, each waiting for its
    update: a wait where a Ctrl-C in step() lands. Caught there, the update was applied but global_step
    not moved on: it stayed one behind for good, so every later step trained at its predecessor's
    learning rate (warmup_cosine here) and checkpoints named the wrong step. Now the step counts once
    its update is submitted, and training goes on bitwise as the engine never interrupted."""
    from offload_trainer.runtime.optimizer_pipeline import OptimizerPipeline

    wait_params = OptimizerPipeline.wait_params
    armed = {"on": False}

    def interrupted(self: OptimizerPipeline, gi: int) -> None:
        if armed["on"] and any(sys._getframe(d).f_code.co_name == "prefetch_next_step" for d in range(1, 6)):
            armed["on"] = False
            raise KeyboardInterrupt()
        wait_params(self, gi)

    monkeypatch.setattr(OptimizerPipeline, "wait_params", interrupted)  # before initialize binds it

    def run(fail: bool) -> Tuple[int, Tuple[torch.Tensor, ...]]:
        cfg = ot.OffloadConfig(
            tiers={"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path / f"swap{fail}")},
            optimizer={"lr": 1e-2, "schedule": "warmup_cosine", "warmup_steps": 3, "total_steps": 6},
            prefetch={"lookahead_groups": 1},
        )
        torch.manual_seed(0)
        with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg, device="cpu") as engine:
            # Loads that wait in step() (those the update pass does not fill: [Note: The next forward's
            # load from the update]).
            engine.scheduler.fill_from_update = lambda gi, shard, after: None
            tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
            for k in range(4):
                engine.backward(engine(tokens, tokens.roll(-1, 1))[1])
                armed["on"] = fail and k == 1
                try:
                    engine.step()
                except KeyboardInterrupt:
                    assert fail and k == 1
                assert not armed["on"], "the prefetch's wait was not interrupted"
            return engine.global_step, tuple(t.clone() for t in engine.full_state_dict().values())

    (steps, ours), (their_steps, theirs) = run(True), run(False)
    assert steps == their_steps == 4
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_a_second_ctrl_c_in_close_frees_nothing_while_the_update_thread_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while close() waits for the update pass, and a second one while it waits for the update
    thread to end: close() went on past the interrupted wait and closed the IO engine and the tiers
    (arenas unpinned, swap files removed) with the thread still updating over them. Now each wait of
    close() finishes, the thread ends before anything is freed, and the Ctrl-C is raised after
    ([Note: A close interrupted while a thread runs] in io_engine/thread_join.py)."""
    import signal

    from offload_trainer.runtime.groups.tiers import MemoryTiers
    from offload_trainer.runtime.optimizer import StreamingOptimizer

    main = threading.main_thread().ident
    closing, freed, late = threading.Event(), [], []
    chunks = {"done": 0, "last": -1}  # chunk updates so far; the number of the armed pass's last one
    real_update, real_close = StreamingOptimizer._update_chunk, MemoryTiers.close

    def slow_update(self: StreamingOptimizer, *args: object, **kwargs: object) -> object:
        chunks["done"] += 1
        if chunks["done"] == chunks["last"]:
            # The pass's last chunk: no step() waits for it (only for the first groups the next
            # forward needs), so it waits here until close() waits for the pass, whatever the load.
            assert closing.wait(60), "close() never waited for the update pass"
            late.append("interrupting")
            for _ in range(2):  # the first lands in wait_all, the second in the join of the thread
                time.sleep(0.3)
                signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.5)
            late.append(list(freed))  # what close() had freed while this update still ran
        return real_update(self, *args, **kwargs)

    monkeypatch.setattr(StreamingOptimizer, "_update_chunk", slow_update)
    monkeypatch.setattr(MemoryTiers, "close", lambda self: (freed.append("tiers"), real_close(self))[1])
    engine = _tiny_nvme_engine(tmp_path, "swap")
    _train(engine, 1)  # its update pass runs behind
    engine.wait_for_updates()
    chunks["last"] = 2 * chunks["done"]  # the next pass updates the same chunks
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(tokens, tokens.roll(-1, 1))[1])
    engine.step()  # this pass's last update waits for `closing`
    real_wait_all = engine.pipeline.wait_all

    def wait_all() -> None:  # close()'s wait for the pass
        closing.set()
        real_wait_all()

    monkeypatch.setattr(engine.pipeline, "wait_all", wait_all)
    # Ctrl-C as Python's default handler raises it, whatever handler an earlier test in this process left.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.close()
    finally:
        signal.signal(signal.SIGINT, before)
    assert late[-1] == [], "close() freed the tiers while the update thread still ran"
    assert freed == ["tiers"]
    assert not engine.pipeline._thread.is_alive() and not any(t.is_alive() for t in engine.io._threads)


def test_a_step_retried_after_its_norm_failed_keeps_the_recorded_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """step() raised while computing the global norm (a read of a gradient home failing), after it
    had closed the step's recorded order; the loop called step() again. The second close recorded
    the acquisitions since the first, none, as the trace: the next step ran without prefetching
    and was recorded again (stats().re_records 1). The trace now stays, and the training is
    bitwise plain PyTorch's, the retried step updating once."""
    import copy

    from offload_trainer.runtime.optimizer import StreamingOptimizer

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    ref = copy.deepcopy(model)
    cfg = config(tmp_path)
    opt = _plain_adamw(ref, cfg)
    _fail_at_call(monkeypatch, StreamingOptimizer, "_global_norm", 2)
    g = torch.Generator().manual_seed(3)
    with ot.initialize(model, cfg, device="cpu") as engine:
        for k in range(3):
            tokens = torch.randint(0, 256, (2, 16), generator=g)
            engine.backward(engine(tokens, tokens.roll(-1, 1))[1])
            ref(tokens, tokens.roll(-1, 1))[1].backward()
            if cfg.optimizer.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.optimizer.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            if k == 1:
                with pytest.raises(OSError, match="injected"):
                    engine.step()
            trace = list(engine.order.trace)
            assert engine.step() is True
            if k:  # the first step records the trace
                assert engine.order.trace == trace and engine.stats().re_records == 0, k
        state = engine.full_state_dict()
    assert not [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
