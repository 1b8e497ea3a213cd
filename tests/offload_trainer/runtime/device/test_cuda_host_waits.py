"""The training thread does not wait for the GPU's compute in a steady-state step, except where the
host itself reads what the compute made ([Note: Host waits in a step] in device/accelerator.py).

Runs on the CPU: the whole engine trains with CudaAccelerator, its device memory being host memory,
while torch.cuda's streams and events are fakes that follow what each stream waits for. Every op
on a stream takes the next position of that stream; an event records the positions its stream has
reached and waited for, on every stream; a stream's wait on an event takes those positions over. A
host wait (event.synchronize, torch.cuda.synchronize) on an event that follows compute position p
waits for the GPU's compute up to p: it is a stall of the host on compute if p is beyond what the
host waited for before. Each is logged with the thread that waited and its call site. What the
fakes cannot see, a host read of device memory (`.item()`, `.cpu()`: device memory is host memory
here), test_cuda.py holds on a GPU with torch.cuda.set_sync_debug_mode("error").

Several ranks run as rank 0 of two whose twin holds zeros: the collectives are replaced by local
stand-ins (the numbers then differ from a real pair's, and are not checked here; finite is all the
step needs), so that the gradient buckets, their reduce-scatters and the all-gathers take the path
they take on two GPUs.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.runtime.collectives import Collectives, CollectiveWork
from offload_trainer.runtime.device.cuda import CudaAccelerator
from tests.offload_trainer.runtime.device.test_cuda_streams import ThreadStreams, install_fake_streams
from tests.offload_trainer.runtime.test_engine_parity import OPT, VOCAB, TinyLM, batches

RUNTIME = str(Path(ot.__file__).parent / "runtime")
DEVICE_DIR = str(Path(RUNTIME) / "device")


class FakeStream:
    def __init__(self, name: str, cuda: "DependencyCuda") -> None:
        self.name = name
        self._cuda = cuda
        self.reached: Dict[str, int] = {name: 0}
        """Per stream: the position this stream's next op runs after (its own: its last op)."""

    def op(self) -> None:
        with self._cuda.lock:
            self.reached[self.name] += 1

    def wait_event(self, event: "FakeEvent") -> None:
        with self._cuda.lock:
            for stream, position in event.reached.items():
                self.reached[stream] = max(self.reached.get(stream, 0), position)

    def wait_stream(self, other: "FakeStream") -> None:
        event = FakeEvent()
        event.record(other)
        self.wait_event(event)


class FakeEvent:
    cuda: "DependencyCuda"

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.reached: Dict[str, int] = {}

    def record(self, stream: Optional[FakeStream] = None) -> None:
        stream = stream if stream is not None else FakeEvent.cuda.current_stream()
        stream.op()
        with FakeEvent.cuda.lock:
            self.reached = dict(stream.reached)

    def query(self) -> bool:
        return FakeEvent.cuda.done(self.reached)

    def synchronize(self) -> None:
        FakeEvent.cuda.host_waits(self.reached)


class DependencyCuda(ThreadStreams):
    """torch.cuda's streams, events and synchronize, following what waits for what (module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.compute = FakeStream("compute", self)
        self._local = threading.local()
        self._names = iter(["h2d", "d2h", "comm"])
        self._streams = [self.compute]
        self.finished: Dict[str, int] = {}
        """Per stream: the position up to which the host has seen the GPU finish (a lazy GPU: it
        finishes nothing before some thread waits for it, so work that is only polled, query(),
        never shows as done, and every wait that matters shows as one)."""
        self.stalls: List[Tuple[str, str]] = []
        """(thread name, call site) of each host wait for compute not waited for before."""
        self.recording = False
        self.copies: List[Tuple[str, int, int]] = []
        """Per copy of the accelerator's, in issue order: its stream, its destination's address, and
        the compute position it follows (by its stream's waits, or because the host had waited for
        that compute before issuing it)."""

    def new_stream(self, *args: object, **kwargs: object) -> FakeStream:
        stream = FakeStream(next(self._names), self)
        self._streams.append(stream)
        return stream

    def synchronize(self, device: object = None) -> None:
        with self.lock:
            reached = {s.name: s.reached[s.name] for s in self._streams}
        self.host_waits(reached)

    def done(self, reached: Dict[str, int]) -> bool:
        with self.lock:
            return all(position <= self.finished.get(stream, 0) for stream, position in reached.items())

    def host_waits(self, reached: Dict[str, int]) -> None:
        with self.lock:
            stalled = reached.get("compute", 0) > self.finished.get("compute", 0)
            for stream, position in reached.items():
                self.finished[stream] = max(self.finished.get(stream, 0), position)
        if stalled and self.recording:
            self.stalls.append((threading.current_thread().name, call_site()))


def call_site() -> str:
    """The engine's frames that led to a host wait, innermost first, outside the copy path and the
    buffer pool's generic take: e.g. "gradients.py:flush < gradients.py:end_backward"."""
    frames = [
        f for f in reversed(traceback.extract_stack())
        if f.filename.startswith(RUNTIME) and not f.filename.startswith(DEVICE_DIR)
        and f.name not in ("_host_waits_for_reuse", "take", "try_take_as", "take_as")
    ]
    return " < ".join(f"{Path(f.filename).name}:{f.name}" for f in frames[:3])


@pytest.fixture
def cuda(monkeypatch) -> DependencyCuda:
    fake = DependencyCuda()
    FakeEvent.cuda = fake
    install_fake_streams(monkeypatch, fake, FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    real_copy = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if non_blocking:  # the accelerator's copies: an op on the current stream (a copy stream)
            stream = fake.current_stream()
            stream.op()
            with fake.lock:
                after = max(stream.reached.get("compute", 0), fake.finished.get("compute", 0))
            fake.copies.append((stream.name, self.data_ptr(), after))
        return real_copy(self, src)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return fake


@pytest.fixture
def twin_ranks(monkeypatch) -> None:
    """Collectives as rank 0 of two whose twin holds zeros (module docstring)."""
    real_init = Collectives.__init__

    def init(self: Collectives, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)
        self.world_size, self.rank = 2, 0

    def start_all_gather(self: Collectives, full: torch.Tensor, shard: torch.Tensor, name: str = "") -> CollectiveWork:
        if shard.data_ptr() != full.data_ptr():
            full[: shard.numel()].copy_(shard)
        full[shard.numel() :].zero_()
        return CollectiveWork(self, "all-gather", name, None, [])

    def start_reduce_scatter_mean(
        self: Collectives, shard: torch.Tensor, full: torch.Tensor, name: str = "", then: object = None
    ) -> CollectiveWork:
        shard.copy_(full[: shard.numel()])  # the twin's bucket is this one's: the mean is this one
        if then is not None:
            then()  # type: ignore[operator]
        return CollectiveWork(self, "reduce-scatter", name, None, [])

    monkeypatch.setattr(Collectives, "__init__", init)
    monkeypatch.setattr(Collectives, "start_all_gather", start_all_gather)
    monkeypatch.setattr(Collectives, "start_reduce_scatter_mean", start_reduce_scatter_mean)
    monkeypatch.setattr(Collectives, "all_reduce_sum", lambda self, t: t.mul_(2))
    monkeypatch.setattr(Collectives, "all_true", lambda self, flag: flag)
    def check_same(self: Collectives, value: int, what: str, error: Optional[BaseException] = None) -> None:
        if error is not None:  # the twin's own failure, raised as on one rank
            raise error

    monkeypatch.setattr(Collectives, "check_same", check_same)
    monkeypatch.setattr(Collectives, "check_none_failed", lambda self: None)  # the twin never fails
    monkeypatch.setattr(Collectives, "barrier", lambda self: None)


PLACEMENTS = {
    "all-device": dict(params="device", grads="device", optimizer="device"),
    "all-host": dict(params="host", grads="host", optimizer="host"),
    "all-nvme": dict(params="nvme", grads="nvme", optimizer="nvme"),
    # Each group's state split between the device and the host: updated on the host, its device
    # homes copied off and written back by the update thread.
    # Parameters and gradients on the device, optimizer states in host memory: every group updated
    # on the host, its gradient (and fp32 parameter) copied off, its parameter written back.
    "offload-optimizer": dict(params="device", grads="device", optimizer="host"),
    # Parameters alone on the device: updated on the host, the parameter home written back only.
    "device-params-only": dict(params="device", grads="host", optimizer="host"),
    # Gradients alone on NVMe: the few staging buffers the gradients have are all they get.
    "nvme-grads": dict(params="host", grads="nvme", optimizer="host"),
    "split": dict(
        params={"device": 0.5, "host": 0.5}, grads={"device": 0.5, "host": 0.5}, optimizer={"device": 0.3, "host": 0.7}
    ),
}


def stalls_in_steady_steps(
    cuda: DependencyCuda, tmp_path: Path, placement: str, precision: str = "fp32", num_steps: int = 5,
    between: Optional[Callable[[ot.Engine, torch.Tensor], None]] = None,
) -> Counter:
    """Train TinyLM for `num_steps` steps (two micro-batches each) under the fake CUDA; the host
    stalls on compute of the steps after the first two (the recording step and the first replay),
    by (thread, call site). `between(engine, x)`: run after each step's last backward, before step()."""
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(
        tiers=dict(PLACEMENTS[placement], nvme_dir=str(tmp_path)),
        prefetch={"lookahead_groups": 2},
        optimizer=OPT,
        precision={"compute_dtype": precision},
        grad_accum_steps=2,
    )
    accel = CudaAccelerator(torch.device("cuda", 0))
    accel.torch_device = torch.device("cpu")  # the "device" memory of this test is the CPU's
    with ot.initialize(TinyLM(tie=True), cfg, device=accel) as engine:
        for step, micro_batches in enumerate(batches(num_steps, 2)):
            cuda.recording = step >= 2
            for x, y in micro_batches:
                loss = nn.functional.cross_entropy(engine(x).reshape(-1, VOCAB), y.reshape(-1)) / 2
                engine.backward(loss)
            if between is not None:
                between(engine, micro_batches[0][0])
            engine.step()
        engine.wait_for_updates()
        cuda.recording = False
    return Counter(cuda.stalls)




STALLS_NEEDED = {
    # The end of the step's backward: the host merges each group's staged gradients into its host
    # home (or writes them to NVMe), so it waits for their copies off the device, each after the
    # compute that made it.
    "gradients.py:flush < gradients.py:_flush_ready < gradients.py:merge_all",
    # No staging buffer free in backward: the host merges a complete group to free one (above).
    "gradients.py:flush < gradients.py:_flush_ready < gradients.py:_take_staging",
    # A group's first gradient of a micro-batch while its previous micro-batch's are still staged
    # (their merge left for later, [Note: Merges left for later] in gradients.py): merged first.
    # Its copies were issued before the forward the host has issued since (the fakes' lazy GPU
    # counts every first wait for a compute position, however old).
    "gradients.py:flush < gradients.py:on_grad < engine.py:_grad_to_home",
    # A parameter staging buffer lent again to an NVMe read, which the host issues: the copy to
    # the device that read it last must be done (and it followed the compute that freed its slot).
    "shard_group.py:start_load < scheduler.py:_start_load < scheduler.py:_prefetch",
    "shard_group.py:start_load < scheduler.py:_start_load < scheduler.py:_load",
    # Several ranks, a host or NVMe grad home: the reduced shard copied off, the host adds it into
    # the home (its merge left for later, as one rank's staged gradients): at the end of the step's
    # last backward, when a staging buffer is needed, or at the group's next shard.
    "gradients.py:_add_reduced < gradients.py:_merge_reduced < gradients.py:merge_all",
    "gradients.py:_add_reduced < gradients.py:_take_staging < gradients.py:_finish_reduce",
    "gradients.py:_add_reduced < gradients.py:_finish_reduce < gradients.py:_flush_bucket",
    "gradients.py:_add_reduced < gradients.py:_finish_reduce < gradients.py:end_backward",
    # ... or before a reduced shard takes a staging buffer whose class every other buffer of is held
    # by shards waiting for their merge, one of them into an NVMe home ([Note: A merge's second
    # buffer] in gradients.py): the oldest is merged, so that one stays free for a merge's read.
    "gradients.py:_add_reduced < gradients.py:_keep_one_for_merges < gradients.py:_finish_reduce",
}
"""Where the training thread may wait for the GPU's compute in a steady-state step, and why: the
host reads, or the host's IO writes, memory a copy after that compute touches ([Note: Host waits in
a step] in device/accelerator.py). Anything else is a stall that a stream wait would avoid."""


def assert_stalls_needed_only(stalls: Counter, num_steps: int) -> None:
    training = {site for thread, site in stalls if thread == "MainThread"}
    assert training <= STALLS_NEEDED, f"the training thread waited for the GPU's compute at {training - STALLS_NEEDED}"
    updates = sum(n for (thread, _), n in stalls.items() if thread == "optimizer-updates")
    # Once per pass at most: its copies off the device follow the compute before the step only
    # (PreparedStep.compute), not the next forward's, which the pass would wait for group by group.
    # The steps recorded see one pass more: the one before them runs behind their first forward.
    passes = num_steps + 1
    assert updates <= passes, f"the update thread waited for the GPU's compute {updates} times in {passes} passes"
    others = {thread for thread, _ in stalls} - {"MainThread", "optimizer-updates"}
    assert not others, f"threads {others} waited for the GPU's compute"


@pytest.mark.parametrize(
    "placement, precision",
    [
        ("all-device", "fp32"), ("all-host", "fp32"), ("all-nvme", "bf16"), ("offload-optimizer", "bf16"),
        ("split", "fp32"),
    ],
)
def test_a_steady_step_waits_for_the_gpu_only_where_the_host_reads_what_it_made(
    cuda: DependencyCuda, tmp_path, placement: str, precision: str
) -> None:
    stalls = stalls_in_steady_steps(cuda, tmp_path, placement, precision)
    assert_stalls_needed_only(stalls, num_steps=3)
    if placement == "all-device":
        assert not stalls, "everything on the device: nothing for the host to wait for"


@pytest.mark.parametrize("placement", ["all-device", "all-host"])
def test_two_ranks_reuse_gradient_buckets_without_waiting_for_the_gpu(
    cuda: DependencyCuda, twin_ranks: None, tmp_path, placement: str
) -> None:
    """A bucket's last reader is its reduce-scatter, which the compute stream waited for (finish());
    its next writer is compute again: before, taking it waited on the host for the compute event
    given back with it, once per group in backward."""
    stalls = stalls_in_steady_steps(cuda, tmp_path, placement)
    assert_stalls_needed_only(stalls, num_steps=3)
    assert not any("_into_bucket < gradients.py:on_grad" in site for _, site in stalls)
    if placement == "all-device":
        assert not stalls


@pytest.mark.parametrize(
    "placement, ranks",
    [("all-host", 1), ("all-nvme", 1), ("split", 1), ("device-params-only", 1), ("all-host", 2), ("all-nvme", 2)],
)
def test_a_micro_batch_before_the_last_ends_its_backward_without_waiting_for_the_gpu(
    cuda: DependencyCuda, tmp_path, monkeypatch, request, placement: str, ranks: int
) -> None:
    """[Note: Merges left for later] in gradients.py: the end of a backward that is not the step's
    last merged every staged group (one rank) or the last reduced shard (two), so the host waited
    for the GPU to finish the backward before the next micro-batch's forward could be issued. Now
    it merges only what has landed (nothing, on the fakes' lazy GPU) and leaves the rest for later,
    unless it needs a staging buffer that only a merge frees (TinyLM's two ranks in host memory: 3
    buffers, 5 groups). The step's last backward still waits (the step reads the homes next)."""
    from offload_trainer.runtime.gradients import GradAccumulator

    if ranks == 2:
        request.getfixturevalue("twin_ranks")
    at_end: List[Tuple[bool, List[str]]] = []
    real_end = GradAccumulator.end_backward

    def end_backward(self: GradAccumulator) -> None:
        final, before = self.final_micro_batch, len(cuda.stalls)
        real_end(self)
        if cuda.recording:
            at_end.append((final, [site for _, site in cuda.stalls[before:]]))

    monkeypatch.setattr(GradAccumulator, "end_backward", end_backward)
    stalls_in_steady_steps(cuda, tmp_path, placement, num_steps=4)
    assert sorted({final for final, _ in at_end}) == [False, True]
    early = [site for final, sites in at_end if not final for site in sites]
    assert all("_take_staging" in site for site in early), early
    assert any(sites for final, sites in at_end if final), "the last backward waits for its gradients' copies"


@pytest.mark.parametrize(
    "placement, precision",
    [("all-host", "fp32"), pytest.param("all-nvme", "fp32", marks=pytest.mark.slow), pytest.param("all-host", "bf16", marks=pytest.mark.slow)],
)
def test_a_layer_major_step_merges_its_gradients_once_its_last_unit_is_issued(
    cuda: DependencyCuda, tmp_path, monkeypatch, placement: str, precision: str
) -> None:
    """[Note: Merges left for later] in gradients.py: a layer-major step closes the last micro-batch's
    piece of every unit (the end, each block, the begin) with end_backward, which merged every staged
    group on the spot: the host waited for the GPU to finish each block's backward before it could
    issue the next block's recomputation (9 waits per block here in all-host fp32). Now
    no end_backward waits while units are left to issue; the step's merges wait once its last unit
    is issued."""
    units = layer_major_units(cuda, tmp_path, monkeypatch, placement, precision)
    assert len(units) == 2 * 5, units  # per recorded step: the end, 3 blocks, the begin
    between_units = [
        site
        for s in (2, 3)
        for _, site in cuda.stalls[[n for t, n in units if t == s][0] : [n for t, n in units if t == s][-1]]
    ]
    assert not [site for site in between_units if "end_backward" in site], between_units
    assert_stalls_needed_only(Counter(cuda.stalls), num_steps=2)


def layer_major_units(
    cuda: DependencyCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, placement: str, precision: str
) -> List[Tuple[int, int]]:
    """Four layer-major steps of three micro-batches (a 3-block decoder), the host's waits recorded from
    the third on: per backward unit while recording, (step, waits so far)."""
    import contextlib

    from offload_trainer.models import DecoderConfig, DecoderLM
    from offload_trainer.runtime.layer_major import LayerMajorSchedule

    units: List[Tuple[int, int]] = []
    step = [0]
    real_unit = LayerMajorSchedule._unit

    @contextlib.contextmanager
    def unit(self: LayerMajorSchedule, backward: bool = False):  # type: ignore[no-untyped-def]
        if backward and cuda.recording:
            units.append((step[0], len(cuda.stalls)))
        with real_unit(self, backward):
            yield

    monkeypatch.setattr(LayerMajorSchedule, "_unit", unit)
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64))
    cfg = ot.OffloadConfig(
        tiers=dict(PLACEMENTS[placement], nvme_dir=str(tmp_path)), prefetch={"lookahead_groups": 1}, optimizer=OPT,
        precision={"compute_dtype": precision}, grad_accum_steps=3,
    )
    accel = CudaAccelerator(torch.device("cuda", 0))
    accel.torch_device = torch.device("cpu")  # the "device" memory of this test is the CPU's
    with ot.initialize(model, cfg, device=accel) as engine:
        for step[0], micro_batches in enumerate(batches(4, 3)):
            cuda.recording = step[0] >= 2
            engine.forward_backward_layer_major(
                [x for x, _ in micro_batches],
                lambda out, m: nn.functional.cross_entropy(out.float().reshape(-1, VOCAB), micro_batches[m][1].reshape(-1)),
            )
            engine.step()
        engine.wait_for_updates()
        cuda.recording = False
    monkeypatch.setattr(LayerMajorSchedule, "_unit", real_unit)
    return units


def stalls_between_units(cuda: DependencyCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str) -> Counter:
    """The host's waits for the GPU's compute between a layer-major step's first and last backward
    unit, in the steps after the first two, by call site (all-host, three micro-batches)."""
    cuda.stalls = []
    cuda._names = iter([f"{name} {precision}" for name in ("h2d", "d2h", "comm")])  # this engine's copy streams
    tmp_path.mkdir(parents=True, exist_ok=True)
    starts = layer_major_units(cuda, tmp_path, monkeypatch, "all-host", precision)
    first = [n for t, n in starts if t == 2]
    return Counter(site for _, site in cuda.stalls[first[0] : first[-1]])


@pytest.mark.slow  # about 25 s each; test_layer_major.py's NVMe writes once per step under bf16 runs by default
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_low_precision_layer_major_step_waits_between_units_no_more_than_an_fp32_one(
    cuda: DependencyCuda, tmp_path, monkeypatch, request, ranks: int
) -> None:
    """[Note: Gradients once per unit] in runtime/layer_major.py: under bf16 each micro-batch's piece
    of a unit's backward was handed over as it finished (to accumulate in fp32), so the next
    micro-batch's gradient of each group found the previous one still staged (one rank) or its
    reduced shard still waiting for its merge (two), and the host waited for the GPU there, once per
    group and micro-batch: 58 waits between the units of one step here on one rank, 10 on two,
    where fp32, whose micro-batches sum in `.grad`, waits 2 times. The unit's micro-batches now sum
    in fp32 on the device under any compute dtype, handed over once."""
    if ranks == 2:
        request.getfixturevalue("twin_ranks")
    fp32 = stalls_between_units(cuda, tmp_path / "fp32", monkeypatch, "fp32")
    bf16 = stalls_between_units(cuda, tmp_path / "bf16", monkeypatch, "bf16")
    assert sum(bf16.values()) <= sum(fp32.values()), (bf16, fp32)


def test_a_device_home_written_back_follows_the_compute_before_the_step(
    cuda: DependencyCuda, tmp_path, monkeypatch
) -> None:
    """Parameters on the device, gradients and optimizer states in host memory, bf16 compute: the
    update runs on the host from the fp32 master and writes the parameter home back, without
    reading it first. An evaluation forward between the last backward and step() (a validation
    loss at the accumulation boundary) issues kernels that read the parameter homes after the
    host's last wait (the gradients' copies): the write-back must follow them on the device, or
    it may overwrite a weight those kernels have yet to read."""
    from offload_trainer.runtime.optimizer import StreamingOptimizer

    prepares: List[int] = []
    real_prepare = StreamingOptimizer.prepare

    def prepare(self: StreamingOptimizer, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        prepared = real_prepare(self, *args, **kwargs)
        prepares.append(len(cuda.copies))
        cuda.copies.append(("prepare", 0, cuda.compute.reached["compute"]))  # every compute issued so far
        return prepared

    monkeypatch.setattr(StreamingOptimizer, "prepare", prepare)
    homes: List[Tuple[int, int]] = []
    real_initialize = ot.initialize

    def initialize(*args: object, **kwargs: object) -> ot.Engine:
        engine = real_initialize(*args, **kwargs)
        for group in engine.groups:
            for home in (group.param_home, *group.optimizer_homes.values()):
                if home.tier is ot.Tier.DEVICE:
                    homes.append((home.tensor.data_ptr(), home.tensor.data_ptr() + home.nbytes))
        return engine

    monkeypatch.setattr(ot, "initialize", initialize)

    def evaluate(engine: ot.Engine, x: torch.Tensor) -> None:
        with torch.no_grad():
            engine(x)
        cuda.compute.op()  # its kernels, which the fakes do not see: they read the parameter homes

    stalls_in_steady_steps(cuda, tmp_path, "device-params-only", "bf16", num_steps=3, between=evaluate)
    assert homes and prepares
    follows, write_backs = 0, 0
    for stream, ptr, after in cuda.copies:
        if stream == "prepare":
            follows = after
        elif stream == "h2d" and any(lo <= ptr < hi for lo, hi in homes):
            write_backs += 1
            assert after >= follows, "a device home was written back before the compute that read it"
    assert write_backs >= 3 * len(homes) // 2, write_backs


def update_thread_moves(cuda: DependencyCuda, monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """A list that gets the calling line of every `Tensor.to()` the update thread makes while the fake
    CUDA records (a step count moved between host and device: a copy that waits for the device)."""
    moves: List[str] = []
    real_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if cuda.recording and threading.current_thread().name == "optimizer-updates":
            moves.append("".join(traceback.format_stack(limit=3)[:1]))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return moves


def test_a_group_updated_on_the_device_moves_no_step_count_in_a_steady_step(
    cuda: DependencyCuda, tmp_path, monkeypatch
) -> None:
    """[Note: Step counts on the device] in runtime/optimizer.py: a count moved between pageable host
    memory and the device is a copy that waits for the device's stream, on the update thread,
    once per group (the next forward's loads wait for that thread). Every `.to()` the update thread
    makes in a steady step is logged: none."""
    moves = update_thread_moves(cuda, monkeypatch)
    stalls_in_steady_steps(cuda, tmp_path, "all-device", num_steps=4)
    assert not moves, moves


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_global_norm_copies_the_norms_off_the_device_once_per_step(
    cuda: DependencyCuda, tmp_path, monkeypatch, request, ranks: int
) -> None:
    """prepare() takes the norm on the host (step() decides there whether to update): a copy off the
    device, which waits for the backward's compute, once a step. On several ranks it was one copy
    per parameter's norm (`n.cpu()` each: each a wait for the device). Every `.cpu()` the training
    thread makes in a steady step is counted: at most one per step and device."""
    if ranks == 2:
        request.getfixturevalue("twin_ranks")
    copies_off: List[int] = []
    real_cpu = torch.Tensor.cpu

    def cpu(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if cuda.recording and threading.current_thread().name == "MainThread":
            copies_off.append(self.numel())
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    stalls_in_steady_steps(cuda, tmp_path, "all-device", num_steps=5)
    assert len(copies_off) <= 3, copies_off


def test_two_ranks_merge_reduced_shards_into_nvme_homes_with_the_gpu_behind(
    cuda: DependencyCuda, twin_ranks: None, tmp_path
) -> None:
    """[Note: A merge's second buffer] in gradients.py, for reduced shards: on several ranks, each
    group's reduced shard is copied off the device into a staging buffer and merged once the copy
    has landed; a merge into an NVMe home after the step's first reads the home into a second
    buffer. A GPU behind the host (the fakes' lazy GPU: nothing lands before it is waited for)
    left every buffer of a class held by a merge not yet made, each of which needed one more:
    backward raised "no host staging buffer is free and none can be freed" (on two GPUs, with the
    gradients on NVMe and the optimizer states in host memory: few staging buffers). The
    simulated accelerator cannot show it: its collectives run on the host (gloo) and wait for
    the copy that last read their output, so a merge is never left waiting there."""
    stalls = stalls_in_steady_steps(cuda, tmp_path, "nvme-grads")
    assert_stalls_needed_only(stalls, num_steps=3)


@pytest.mark.parametrize("how", ["checkpoint", "safetensors"])
def test_a_host_home_is_overwritten_only_after_the_loads_that_read_it(
    cuda: DependencyCuda, tmp_path, monkeypatch, how: str
) -> None:
    """Parameters in host memory: a forward's loads copy their homes into device slots on the h2d
    stream, and the forward's kernels wait for those copies on their stream, not the host. A
    checkpoint or a safetensors file loaded right after an evaluation forward (whose output is read
    later) overwrote the homes from the host while those copies, and the kernels reading their
    slots, might not have run yet: the forward computed with the loaded weights, or a mix (plain
    PyTorch's load_state_dict copies on the compute stream, after the forward). Every host home the
    host writes (Home.write) must follow the copies that read it; the simulated accelerator cannot
    show it: its compute waits for a copy on the host."""
    import io_engine.buffers
    from offload_trainer.runtime.groups.homes import Home

    monkeypatch.setattr(io_engine.buffers, "cuda_pinning_available", lambda: False)  # no CUDA to pin with
    loads: List[Tuple[int, int, int]] = []  # each copy's source range and its h2d position
    fake_copy = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        out = fake_copy(self, src, non_blocking)
        stream = cuda.current_stream()
        if non_blocking and stream.name == "h2d":
            loads.append((src.data_ptr(), src.data_ptr() + src.numel() * src.element_size(), stream.reached["h2d"]))
        return out

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    unordered: List[int] = []
    real_write = Home.write

    def write(self: Home, tiers: object, source: torch.Tensor, offset: int = 0) -> None:
        real_write(self, tiers, source, offset)  # type: ignore[arg-type]
        if self.tier is ot.Tier.HOST:
            lo, hi = self.tensor.data_ptr(), self.tensor.data_ptr() + self.nbytes  # type: ignore[union-attr]
            last = max((p for a, b, p in loads if a < hi and lo < b), default=0)
            if last > cuda.finished.get("h2d", 0):
                unordered.append(last)

    monkeypatch.setattr(Home, "write", write)
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(
        tiers=dict(PLACEMENTS["all-host"]), prefetch={"lookahead_groups": 2}, optimizer=OPT, grad_accum_steps=1
    )
    accel = CudaAccelerator(torch.device("cuda", 0))
    accel.torch_device = torch.device("cpu")  # the "device" memory of this test is the CPU's
    with ot.initialize(TinyLM(tie=True), cfg, device=accel) as engine:
        for (x, y), in batches(2, 1):
            engine.backward(nn.functional.cross_entropy(engine(x).reshape(-1, VOCAB), y.reshape(-1)))
            engine.step()
        saved = engine.save_checkpoint(tmp_path / "ckpt") if how == "checkpoint" else engine.export_safetensors(tmp_path / "w.safetensors")
        with torch.no_grad():
            engine(x)  # an evaluation forward, its output not read yet
        num_writes = len(loads)
        engine.load_checkpoint(saved) if how == "checkpoint" else engine.load_safetensors([saved])
    assert num_writes, "no load read a host home"
    assert not unordered, f"{len(unordered)} host homes overwritten before the loads that read them were done"


class RoutedMoE(nn.Module):
    """Two blocks of 6 experts each, one group per block: token t goes to expert t % 6, so a batch of
    one token value trains one expert per block, and the set of parameters with a gradient in a
    group changes from step to step (a mixture-of-experts model whose active experts vary)."""

    NUM_EXPERTS = 6

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(RoutedMoE.NUM_EXPERTS))

        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            out = torch.zeros_like(x)
            chosen = ids.flatten() % RoutedMoE.NUM_EXPERTS
            for e in chosen.unique().tolist():
                rows = chosen == e
                out[rows] = self.experts[e](x[rows])
            return x + out

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(RoutedMoE.Block() for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).flatten(0, 1)
        for block in self.blocks:
            x = block(x, ids)
        return self.head(x).view(*ids.shape, -1)


def test_experts_active_in_turn_copy_no_step_increments_to_the_device(
    cuda: DependencyCuda, tmp_path, monkeypatch
) -> None:
    """A group updated on the device whose parameters with a gradient change from step to step (the
    experts of a mixture-of-experts block, active in turn) moved its step counts by a 0/1 vector
    made on the host and copied to the device once per new pattern: a blocking copy from pageable
    memory (it waits for the device, on the update thread) in steady steps, and one more cached
    tensor per pattern, never dropped (2**num_params patterns per group). No `.to()` on the update
    thread in a steady step, and the optimizer holds no more after six steps than after three."""
    from offload_trainer.runtime.optimizer import StreamingOptimizer

    moves = update_thread_moves(cuda, monkeypatch)

    def held(optimizer: StreamingOptimizer) -> int:
        return sum(len(v) for v in vars(optimizer).values() if isinstance(v, dict))

    torch.manual_seed(0)
    cfg = ot.OffloadConfig(
        tiers=dict(PLACEMENTS["all-device"], nvme_dir=str(tmp_path)), optimizer=OPT,
        grouping={"module_classes": ("Block",)},
    )
    accel = CudaAccelerator(torch.device("cuda", 0))
    accel.torch_device = torch.device("cpu")  # the "device" memory of this test is the CPU's
    sizes = []
    with ot.initialize(RoutedMoE(), cfg, device=accel) as engine:
        assert any(len(g.plan.params) == 2 * RoutedMoE.NUM_EXPERTS for g in engine.groups)
        for step in range(RoutedMoE.NUM_EXPERTS):
            cuda.recording = step >= 2
            ids = torch.full((2, 4), step)  # expert `step` of each block, a new one each step
            engine.backward(nn.functional.cross_entropy(engine(ids).reshape(-1, VOCAB), ids.reshape(-1)))
            engine.step()
            engine.wait_for_updates()
            sizes.append(held(engine.optimizer))
        cuda.recording = False
    assert not moves, moves
    assert sizes[-1] == sizes[2], sizes
