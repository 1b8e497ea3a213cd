"""The engine API a DeepSpeed or plain-PyTorch user expects: step() updates only at the accumulation
boundary (the README's loop, as printed, equals plain PyTorch bitwise), torch.optim.lr_scheduler
schedulers drive the learning rate through engine.param_groups / engine.lr_optimizer, and
engine.train() / engine.eval() switch the wrapped model's mode, and training goes on after a
forward that raised."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Callable, List, Tuple

import pytest
import torch

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.runtime.optimizer import torch_param_groups
from tests.offload_trainer.runtime.test_engine_parity import accelerator


def token_batches(n: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 256, (2, 16), generator=g)
        out.append((tokens, tokens.roll(-1, 1)))
    return out


def config(tmp_path: Path, accum: int = 1, **optimizer: object) -> ot.OffloadConfig:
    return ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "host", "optimizer": {"host": 0.5, "nvme": 0.5}, "nvme_dir": str(tmp_path)},
        optimizer={"lr": 3e-3, "grad_clip_norm": 1.0, "weight_decay": 0.1, **optimizer},
        grad_accum_steps=accum,
    )


def reference(model: torch.nn.Module, cfg: ot.OffloadConfig) -> Tuple[torch.nn.Module, torch.optim.AdamW]:
    ref = copy.deepcopy(model)
    o = cfg.optimizer
    return ref, torch.optim.AdamW(torch_param_groups(ref, o), lr=o.lr, betas=o.betas, eps=o.eps, fused=True)


def assert_equal(ref: torch.nn.Module, engine: ot.Engine) -> None:
    state = engine.full_state_dict()
    bad = [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
    assert not bad, f"parameters differ from plain PyTorch: {bad}"


def engine_device(device: str) -> object:
    """The engine's device for a test parametrized by "cpu" or "simulated" (copies landing 0.5 ms late)."""
    return accelerator("sim" if device == "simulated" else device, h2d_delay_s=0.0005, d2h_delay_s=0.0005)


def step_both(ref: torch.nn.Module, opt: torch.optim.Optimizer, engine: ot.Engine, tokens: torch.Tensor, targets: torch.Tensor) -> bool:
    """One step of plain PyTorch (clipping at 1.0) and of the engine on the same batch; the engine's step() result."""
    _, loss = ref(tokens, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    engine.backward(engine(tokens, targets)[1])
    return engine.step()


def test_the_readme_loop_with_accumulation_equals_plain_pytorch(tmp_path: Path) -> None:
    """The README's loop, as printed: step() after every micro-batch, grad_accum_steps = 4."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = config(tmp_path, accum=4)
    ref, opt = reference(model, cfg)
    batches = token_batches(8)
    for k, (tokens, targets) in enumerate(batches):
        _, loss = ref(tokens, targets)
        (loss / 4).backward()
        if (k + 1) % 4 == 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

    engine = ot.initialize(model, cfg)       # takes ownership of the model's parameters
    applied = []
    for tokens, targets in batches:
        logits, loss = engine(tokens, targets)   # forward of the wrapped model
        engine.backward(loss / 4)                # gradients accumulate (fp32) in their homes
        applied.append(engine.step())            # at the accumulation boundary: clip, update, zero
    try:
        assert applied == [False, False, False, True] * 2
        assert engine.global_step == 2
        assert_equal(ref, engine)
    finally:
        engine.close()


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3, eta_min=1e-4),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_torch_lr_scheduler_drives_the_learning_rate(tmp_path: Path, name: str) -> None:
    make: Callable = SCHEDULERS[name]
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = config(tmp_path)
    ref, opt = reference(model, cfg)
    ref_sched = make(opt)
    with ot.initialize(model, cfg) as engine:
        assert len(engine.param_groups) == len(opt.param_groups) == 2  # with and without weight decay
        sched = make(engine.lr_optimizer)
        for tokens, targets in token_batches(5):
            ref(tokens, targets)[1].backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            ref_sched.step()
            engine.backward(engine(tokens, targets)[1])
            engine.step()
            sched.step()
            assert [g["lr"] for g in engine.param_groups] == [g["lr"] for g in opt.param_groups]
        assert_equal(ref, engine)


def test_without_a_scheduler_the_config_schedule_sets_param_groups(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = config(tmp_path, schedule="warmup_cosine", warmup_steps=2, total_steps=6)
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg) as engine:
        for tokens, targets in token_batches(3):
            engine.backward(engine(tokens, targets)[1])
            engine.step()
            assert {g["lr"] for g in engine.param_groups} == {cfg.optimizer.lr_at(engine.global_step - 1)}


def test_train_and_eval_switch_the_wrapped_model(tmp_path: Path) -> None:
    model = DecoderLM(DecoderConfig.preset("tiny"))
    with ot.initialize(model, config(tmp_path)) as engine:
        assert engine.eval() is engine and not model.training
        assert engine.train() is engine and model.training
        assert all(m.training for m in model.modules())


def _forward_that_raises(engine: ot.Engine, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    with pytest.raises(IndexError):
        engine(torch.full_like(tokens, 10_000), targets)


def _loss_backward_outside_the_engine(engine: ot.Engine, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    with pytest.raises(ot.BackwardOutsideEngineError, match=r"call engine\.backward\(loss\) instead"):
        engine(tokens, targets)[1].backward()
    assert engine.step() is False  # nothing was taken from the refused backward


@pytest.mark.parametrize("device", ["cpu", "simulated"])
@pytest.mark.parametrize("misstep", [_forward_that_raises, _loss_backward_outside_the_engine], ids=["forward_raised", "loss_backward"])
def test_training_goes_on_after_a_misstep(tmp_path: Path, device: str, misstep: Callable[..., None]) -> None:
    """A step the loop gets wrong and goes on from, then training bitwise plain PyTorch's without it:
    - a batch whose forward raises (token ids out of range here; out of memory on a GPU), caught and
      skipped: the modules the forward was inside never ran their forward hooks, and their groups
      stayed in use, so the next step() failed;
    - `loss.backward()` in place of `engine.backward(loss)`: the gradients reached the engine's hooks
      but the micro-batch was never counted, so step() silently updated nothing (or from a step's
      partial gradients). It now raises, naming the fix, before any gradient is taken."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = config(tmp_path)
    ref, opt = reference(model, cfg)
    accel = engine_device(device)
    with ot.initialize(model, cfg, device=accel) as engine:
        for k, (tokens, targets) in enumerate(token_batches(4)):
            if k == 2:
                misstep(engine, tokens, targets)
            assert step_both(ref, opt, engine, tokens, targets) is True
        assert_equal(ref, engine)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing dynamo warns about torch.jit
def test_a_torch_compiled_model_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """torch.compile'd (the wrapper, a compiled block, or compiled after initialize): dynamo failed
    inside its own guards at the first forward, with a traceback asking to report a bug. Each is
    now refused in one line, naming the fix. Nothing here compiles: torch.compile is lazy."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"the model is compiled with torch.compile.*pass the model uncompiled"):
        ot.initialize(torch.compile(DecoderLM(DecoderConfig.preset("tiny"))), config(tmp_path))
    model = DecoderLM(DecoderConfig.preset("tiny"))
    model.layers[1].compile()
    with pytest.raises(ValueError, match=r"'layers.1' is compiled with torch.compile"):
        ot.initialize(model, config(tmp_path))
    model = DecoderLM(DecoderConfig.preset("tiny"))
    tokens, targets = token_batches(1)[0]
    with ot.initialize(model, config(tmp_path)) as engine:
        model.compile()
        with pytest.raises(ValueError, match=r"'DecoderLM' is compiled with torch.compile"):
            engine(tokens, targets)


@pytest.mark.parametrize("device", ["cpu", "simulated"])
def test_two_backwards_through_one_graph_with_retain_graph(tmp_path: Path, device: str) -> None:
    """engine.backward(loss, retain_graph=True) then engine.backward(loss) through the same graph:
    both gradients accumulate, as two loss.backward() calls do in plain PyTorch (the engine took no
    retain_graph, so a second backward through a graph was impossible)."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = config(tmp_path)
    ref, opt = reference(model, cfg)
    accel = engine_device(device)
    with ot.initialize(model, cfg, device=accel) as engine:
        for tokens, targets in token_batches(3):
            loss = ref(tokens, targets)[1]
            (loss * 0.5).backward(retain_graph=True)
            (loss * 0.25).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            loss = engine(tokens, targets)[1]
            engine.backward(loss * 0.5, retain_graph=True)
            engine.backward(loss * 0.25)
            assert engine.step() is True
        assert_equal(ref, engine)


def test_a_model_given_to_a_second_engine_is_refused(tmp_path: Path) -> None:
    """initialize() leaves the model empty placeholders: a second initialize() of it (or of one of
    its modules), with the first engine open or closed, partitioned the placeholders and failed in
    forward ("'weight' must be 2-D") or trained nothing. Refused now, naming what to do."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    engine = ot.initialize(model, config(tmp_path / "a"))
    with pytest.raises(ValueError, match="held by an engine that is still open"):
        ot.initialize(model, config(tmp_path / "b"))
    with pytest.raises(ValueError, match="its module '0' is held by an engine"):
        ot.initialize(torch.nn.Sequential(model.layers[0]), config(tmp_path / "b"))
    engine.close()
    with pytest.raises(ValueError, match="given to an engine that is closed.*build the model again"):
        ot.initialize(model, config(tmp_path / "b"))
    fresh = DecoderLM(DecoderConfig.preset("tiny"))  # a new model is the engine's to take
    ot.initialize(fresh, config(tmp_path / "b")).close()


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises while `failing` is set (out of memory in backward, say)."""

    failing = False

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        if _FailingBackward.failing:
            raise RuntimeError("injected failure in backward")
        return grad


@pytest.mark.parametrize("device", ["cpu", "simulated"])
@pytest.mark.parametrize("grads", ["host", "nvme"])
def test_a_backward_that_raised_leaves_no_gradient_behind(tmp_path: Path, device: str, grads: str) -> None:
    """A backward raising half-way (after the head's and the last blocks' gradients reached their
    homes) in the second micro-batch of a step: the step's gradients are dropped, the first
    micro-batch's too, as plain PyTorch's zero_grad() after the error, and the step starts over.
    Before, the partial gradients stayed and the failed backward did not count, so the update came
    a micro-batch late and, with staged gradients, differed between placements."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    middle = model.layers[1]
    middle.register_forward_hook(lambda module, args, out: _FailingBackward.apply(out))
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": grads, "optimizer": "nvme", "nvme_dir": str(tmp_path)},
        optimizer={"lr": 3e-3, "grad_clip_norm": 1.0, "weight_decay": 0.1},
        grad_accum_steps=2,
    )
    ref, opt = reference(model, cfg)
    accel = engine_device(device)
    batches = token_batches(8)
    try:
        with ot.initialize(model, cfg, device=accel) as engine:
            done = 0
            for k, (tokens, targets) in enumerate(batches):
                _FailingBackward.failing = k == 3  # the second micro-batch of the second step
                try:
                    ref(tokens, targets)[1].div(2).backward()
                except RuntimeError:
                    opt.zero_grad()
                    done = 0
                else:
                    done += 1
                with pytest.raises(RuntimeError, match="injected") if k == 3 else contextlib.nullcontext():
                    engine.backward(engine(tokens, targets)[1] / 2)
                if done == 2:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
                    done = 0
                    assert engine.step()
                else:
                    assert not engine.step()
            assert_equal(ref, engine)
    finally:
        _FailingBackward.failing = False


HOST = {"params": "host", "grads": "host", "optimizer": "host"}


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda m: ot.initialize(None, ot.OffloadConfig(tiers=HOST)), TypeError,
         "model must be a torch.nn.Module, not NoneType"),
        (lambda m: ot.initialize(m, {"tiers": HOST}), TypeError,
         r"config must be an OffloadConfig, not dict .*OffloadConfig.from_dict"),
        (lambda m: ot.initialize(m, "run.toml"), TypeError, r"config must be an OffloadConfig, not str .*from_file"),
        (lambda m: ot.Engine(m, {"tiers": HOST}), TypeError, "config must be an OffloadConfig, not dict"),
        (lambda m: ot.initialize(m, ot.OffloadConfig(tiers=HOST), device="banana"), ValueError,
         "device 'banana' is not a device: use 'cpu', 'cuda'"),
        # "'float' object is not callable", naming neither the argument nor the fix
        (lambda m: ot.initialize(m, ot.OffloadConfig(tiers=HOST), lr_schedule=3e-4), TypeError,
         r"lr_schedule must be a callable or None, not float \(0.0003\).*optimizer.lr"),
        (lambda m: ot.Engine(m, ot.OffloadConfig(tiers=HOST), init_fn="init_weights"), TypeError,
         "init_fn must be a callable or None, not str"),
        # "MicroBatch.__init__() takes 3 positional arguments but 6 were given"
        (lambda m: ot.initialize(m, ot.OffloadConfig(placement="auto"), micro_batch="2x256"), TypeError,
         r"micro_batch='2x256' must be a pair \(batch_size, seq_len\)"),
        (lambda m: ot.initialize(m, ot.OffloadConfig(placement="auto"), micro_batch=(2, 256, 1)), TypeError,
         r"micro_batch=\(2, 256, 1\) must be a pair"),
    ],
    ids=["model-none", "config-dict", "config-path", "engine-config-dict", "device-banana", "lr-schedule-a-rate",
         "init-fn-a-name", "micro-batch-text", "micro-batch-triple"],
)
def test_arguments_of_the_wrong_kind_are_named(call: Callable, error: type, match: str) -> None:
    # They ended in AttributeError ('dict' object has no attribute 'placement') or torch's RuntimeError
    # listing twenty device types: no ValueError/TypeError naming what was passed.
    with pytest.raises(error, match=match):
        call(DecoderLM(DecoderConfig.preset("tiny")))


def test_save_and_load_arguments_of_the_wrong_kind_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    # extra=[1] was saved, and the checkpoint then refused by load_checkpoint ("the manifest lacks
    # 'extra'"); load_safetensors("model.safetensors") read the path's characters as files ('/' first).
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), ot.OffloadConfig(tiers=HOST)) as engine:
        for extra, match in (([1], "extra=\\[1\\] must be a dict"), ({"t": torch.ones(2)}, "Tensor is not JSON")):
            with pytest.raises(TypeError, match=match):
                engine.save_checkpoint(tmp_path / "ckpt", extra=extra)
        assert list(tmp_path.iterdir()) == []
        with pytest.raises(TypeError, match=r"must be a list of safetensors files: pass \['m.safetensors'\]"):
            engine.load_safetensors("m.safetensors")
        engine.save_checkpoint(tmp_path / "ckpt", extra={"position": [1, 2]})
        assert engine.load_checkpoint(tmp_path / "ckpt") == {"position": [1, 2]}


def test_a_state_that_lacks_a_value_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """engine.load_state_dict({"step": 5}) set the step count, then ended in KeyError 'loss_scale': a loop
    that caught it went on at step 5; load_rank_state_dicts([{}]) ended in KeyError 'optimizer'."""
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), ot.OffloadConfig(tiers=HOST)) as engine:
        tokens, targets = token_batches(1)[0]
        engine.backward(engine(tokens, targets)[1])
        engine.step()
        shared, rank = engine.state_dict(), engine.rank_state_dict()
        with pytest.raises(ValueError, match=r"load_state_dict\(state\): the state lacks 'loss_scale', so nothing of it"):
            engine.load_state_dict({"step": 5})
        with pytest.raises(ValueError, match=r"the state misstates a value .*pass what engine\.state_dict\(\) gave"):
            engine.load_state_dict({**shared, "step": "x"})
        with pytest.raises(ValueError, match=r"load_rank_state_dicts\(states\): the state lacks 'optimizer'"):
            engine.load_rank_state_dicts([{}])
        assert engine.global_step == 1
        assert engine.state_dict() == shared and str(engine.rank_state_dict()) == str(rank)


def test_a_loss_backward_cannot_take_is_refused_keeping_the_step(tmp_path: Path) -> None:
    """engine.backward of a loss computed under torch.no_grad() (an evaluation forward reused by
    mistake): torch raised "element 0 of tensors does not require grad" from inside the backward,
    naming no fix, and the engine then dropped the step's gradients so far (a backward that raised),
    where plain PyTorch's loss.backward() raises before touching .grad. Refused up front now, naming
    the fix; the step's earlier micro-batch is kept, and training matches plain PyTorch's. So are a loss
    of more than one number and one that is no tensor."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = config(tmp_path, accum=2)
    ref, opt = reference(model, cfg)
    batches = token_batches(4)
    with ot.initialize(model, cfg) as engine:
        for k, (tokens, targets) in enumerate(batches):
            if k == 1:
                with torch.no_grad():
                    loss = engine(tokens, targets)[1]
                with pytest.raises(ValueError, match=r"does not require grad.*torch\.no_grad\(\).*gradients so far are kept"):
                    engine.backward(loss / 2)
                with pytest.raises(RuntimeError, match="does not require grad"):  # plain PyTorch: .grad untouched
                    (ref(tokens, targets)[1] / 2).detach().backward()
                # a loss not reduced to one number (torch: "grad can be implicitly created only for scalar
                # outputs"), and a number (AttributeError: 'float' object has no attribute 'backward'), raised
                # inside the backward: the step's gradients so far were dropped
                with pytest.raises(ValueError, match=r"the loss has shape \[2, 16\].*loss\.mean\(\).*gradients so far are kept"):
                    engine.backward(engine(tokens, targets)[0].sum(-1))
                with pytest.raises(TypeError, match=r"must be the torch\.Tensor the model's forward gave, not float"):
                    engine.backward(float(loss))
            (ref(tokens, targets)[1] / 2).backward()
            engine.backward(engine(tokens, targets)[1] / 2)
            if k % 2:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            assert engine.step() is bool(k % 2)
        assert_equal(ref, engine)


def test_peak_bytes_takes_a_tier_or_its_name_and_names_the_tiers_otherwise() -> None:
    # engine.peak_bytes("host") ended in KeyError 'host', and a misspelt name in KeyError too, naming no tier.
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), ot.OffloadConfig(tiers=HOST)) as engine:
        assert engine.peak_bytes("host") == engine.peak_bytes(ot.Tier.HOST) > 0
        assert engine.peak_bytes(" NVMe ") == engine.peak_bytes(ot.Tier.NVME) == 0
        with pytest.raises(ValueError, match=r"tier='hots' is not a tier: give one of 'device', 'host', 'nvme'"):
            engine.peak_bytes("hots")
        with pytest.raises(ValueError, match=r"tier=1 is not a tier"):
            engine.peak_bytes(1)  # type: ignore[arg-type]


def test_an_export_into_a_directory_or_under_a_file_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    # An existing directory at the export's path: every group was gathered and written to a temporary,
    # then os.replace raised a bare IsADirectoryError naming the temporary beside it.
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "keep").write_text("the user's")
    (tmp_path / "afile").write_text("the user's")
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), ot.OffloadConfig(tiers=HOST)) as engine:
        with pytest.raises(IsADirectoryError, match=r"Is a directory, where a file is to be written: '.*adir'$") as e:
            engine.export_safetensors(tmp_path / "adir")
        assert e.value.filename == str(tmp_path / "adir")
        with pytest.raises(NotADirectoryError, match=r"a file is there, where a directory is needed: '.*afile'$"):
            engine.export_safetensors(tmp_path / "afile" / "m.safetensors")
        with pytest.raises(NotADirectoryError, match=r"a file is there, where a directory is needed: '.*afile'$"):
            engine.save_checkpoint(tmp_path / "afile" / "ckpt")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["adir", "afile", "keep"]
    assert (tmp_path / "adir" / "keep").read_text() == (tmp_path / "afile").read_text() == "the user's"


def test_a_no_decay_pattern_that_matches_no_parameter_is_refused() -> None:
    # optimizer.no_decay_patterns=["layernorm"] on a model whose norms are named "norm": every parameter
    # it was meant to exempt decayed, without a word (PEFT refuses target_modules that match nothing alike).
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = ot.OffloadConfig(tiers=HOST, optimizer={"no_decay_patterns": ["ATTN", "layrnorm"]})
    with pytest.raises(ValueError, match=r"optimizer.no_decay_patterns=\['ATTN', 'layrnorm'\] holds 'layrnorm', which is in "
                                         r"the name of no trainable parameter .*: correct it or remove it"):
        ot.initialize(model, cfg)
    with ot.initialize(model, ot.OffloadConfig(tiers=HOST, optimizer={"no_decay_patterns": ["ATTN"]})):
        pass


def test_a_learning_rate_that_is_no_rate_is_refused_before_the_step_changes_anything() -> None:
    # lr_schedule giving nan (a schedule dividing by zero), or a loop or torch scheduler writing one:
    # step() applied it, every weight became nan, and step() returned True.
    calls = {"nan": True}
    schedule = lambda step: float("nan") if calls["nan"] else 1e-3  # noqa: E731
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), ot.OffloadConfig(tiers=HOST), lr_schedule=lambda s: 1e-3) as engine:
        tokens, targets = token_batches(1)[0]
        engine.backward(engine(tokens, targets)[1])
        before = engine.full_state_dict()
        engine.param_groups[0]["lr"] = float("inf")
        with pytest.raises(ValueError, match=r"engine.param_groups\[0\]\['lr'\]=inf is not a learning rate"):
            engine.step()
        engine.param_groups[0]["lr"] = 1e-3
        engine.param_groups[0]["weight_decay"] = -0.1
        with pytest.raises(ValueError, match=r"engine.param_groups\[0\]\['weight_decay'\]=-0.1 is not"):
            engine.step()
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before) and engine.global_step == 0
        engine.param_groups[0]["weight_decay"] = 0.01
        assert engine.step() is True  # the gradients were kept for it
        assert all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict().values())
    with pytest.raises(ValueError, match=r"lr_schedule\(0\)=nan is not a learning rate"):
        ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), ot.OffloadConfig(tiers=HOST), lr_schedule=schedule)
    calls["nan"] = False
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), ot.OffloadConfig(tiers=HOST), lr_schedule=schedule) as engine:
        tokens, targets = token_batches(1)[0]
        engine.backward(engine(tokens, targets)[1])
        calls["nan"] = True
        with pytest.raises(ValueError, match=r"lr_schedule\(0\)=nan is not a learning rate"):
            engine.step()
        assert engine.global_step == 0


def test_a_trace_into_a_directory_or_under_a_file_is_refused_when_armed(tmp_path: Path) -> None:
    # trace_next_step(a directory) was taken; the traced step then ran and ended in IsADirectoryError.
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("the user's")
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), ot.OffloadConfig(tiers=HOST)) as engine:
        with pytest.raises(IsADirectoryError, match=r"Is a directory, where a file is to be written: '.*adir'$"):
            engine.trace_next_step(tmp_path / "adir")
        with pytest.raises(NotADirectoryError, match=r"a file is there, where a directory is needed: '.*afile'$"):
            engine.trace_next_step(tmp_path / "afile" / "sub" / "t.json")
        tokens, targets = token_batches(1)[0]
        engine.backward(engine(tokens, targets)[1])
        assert engine.step() is True  # nothing armed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"] and not any((tmp_path / "adir").iterdir())


@pytest.mark.parametrize("grads", ["host", "nvme"])
def test_zero_grad_between_micro_batches_drops_the_steps_gradients(tmp_path: Path, grads: str) -> None:
    """A loop that calls optimizer.zero_grad() (here engine.lr_optimizer's) after a micro-batch's
    backward drops that gradient in plain PyTorch, and the step's backwards start over. The engine's
    zero_grad() did nothing: step() updated from the dropped gradient added to the new ones, and
    came a micro-batch early. Now it matches plain PyTorch bitwise; zero_grad(set_to_none=False),
    whose zeros AdamW would update from, is refused, the gradients kept; at the accumulation
    boundary (after step()) zero_grad() changes nothing, as in the README's loop."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = config(tmp_path, accum=2)
    cfg = cfg.with_overrides({"tiers.grads": grads})
    ref, opt = reference(model, cfg)
    batches = token_batches(7)
    with ot.initialize(model, cfg, device="cpu") as engine:
        for k in range(2):
            dropped, first, second = batches[3 * k : 3 * k + 3]
            (ref(*dropped)[1] / 2).backward()
            opt.zero_grad()
            engine.backward(engine(*dropped)[1] / 2)
            with pytest.raises(ValueError, match=r"zero_grad\(set_to_none=False\) between micro-batches \(1 backward"):
                engine.lr_optimizer.zero_grad(set_to_none=False)
            engine.lr_optimizer.zero_grad()
            for tokens, targets in (first, second):
                (ref(tokens, targets)[1] / 2).backward()
                assert engine.step() is False
                engine.backward(engine(tokens, targets)[1] / 2)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            assert engine.step() is True
            engine.lr_optimizer.zero_grad()  # at the boundary: nothing to drop
        assert_equal(ref, engine)


@pytest.mark.parametrize("params", ["device", "nvme"])
def test_clip_grad_norm_over_the_engines_parameters_is_refused_not_zero(tmp_path: Path, params: str) -> None:
    """Plain PyTorch's loop clips between backward and step: torch.nn.utils.clip_grad_norm_ returns the
    total norm. Over the engine's parameters it found every .grad None (the gradients are in their
    homes) and returned 0, clipping nothing, without a word. Now reading .grad there raises, naming the
    parameter and the fix; the engine's own clipping gives the norm clip_grad_norm_ gives plain PyTorch.
    A frozen parameter's .grad reads None, as in plain PyTorch, and after step() every one does
    (model.zero_grad() goes on), as after plain PyTorch's zero_grad()."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    model.norm.weight.requires_grad_(False)
    cfg = config(tmp_path, accum=2).with_overrides({"tiers.params": params})
    ref, opt = reference(model, cfg)
    batches = token_batches(2)
    with ot.initialize(model, cfg, device="cpu") as engine:
        for tokens, targets in batches:
            (ref(tokens, targets)[1] / 2).backward()
            assert model.norm.weight.grad is None  # before the first backward too: nothing held
            engine.backward(engine(tokens, targets)[1] / 2)
            with pytest.raises(ot.GradientReadError, match=r"parameter 'embed_tokens.weight' has no \.grad .*clip_grad_norm_.*grad_clip_norm"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with pytest.raises(ot.GradientReadError):
                model.zero_grad()
            assert model.norm.weight.grad is None
        plain_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        assert engine.step() is True
        assert engine.stats().grad_norm == plain_norm.item()
        assert all(p.grad is None for p in model.parameters())
        model.zero_grad()
        assert_equal(ref, engine)


@pytest.mark.parametrize("device", ["cpu", "simulated"])
def test_a_parameters_size_reads_as_in_plain_pytorch_between_steps_and_in_a_forward(tmp_path: Path, device: str) -> None:
    """`sum(p.numel() for p in model.parameters())` (a parameter count, transformers' num_parameters(),
    an MFU estimate) gave 0 between steps, and p.shape (0,), silently: the placeholder's sizes. Every
    size read answers the parameter's own now, channels-last strides included, before the first step,
    between steps and in a forward, and fetches nothing; training stays bitwise."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    model.embed_tokens.weight.data = model.embed_tokens.weight.data.t().contiguous().t()  # stored transposed
    cfg = config(tmp_path)
    ref, opt = reference(model, cfg)
    reads = [
        lambda p: p.numel(), lambda p: p.nelement(), lambda p: tuple(p.shape), lambda p: p.size(), lambda p: p.size(-1),
        lambda p: p.dim(), lambda p: p.ndim, lambda p: p.ndimension(), lambda p: p.nbytes, lambda p: p.stride(),
        lambda p: p.is_contiguous(), lambda p: torch.numel(p), lambda p: len(p),
    ]

    def sizes(m: torch.nn.Module) -> List[object]:
        return [read(p) for p in m.parameters() for read in reads]

    expected = sizes(ref)
    in_forward: List[object] = []
    with ot.initialize(model, cfg, device=engine_device(device)) as engine:
        assert sizes(model) == expected
        model.lm_head.register_forward_pre_hook(lambda *_: in_forward.append(sizes(model)))
        for tokens, targets in token_batches(2):
            step_both(ref, opt, engine, tokens, targets)
            assert sizes(model) == expected
            assert engine.stats().unpack_refetches == 0  # the forward's reads fetched no group
        assert in_forward and all(seen == expected for seen in in_forward)
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
        assert_equal(ref, engine)
