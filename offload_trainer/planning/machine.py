"""MachineRates: what this machine moves and computes per second, measured once and cached.

A placement planner weighs where state should live by how fast each tier is. This file measures
those rates the way the engine itself moves and updates bytes, and keeps them per machine:

    rates, from_cache = machine_rates("/nvme/swap", IOConfig(), torch.device("cuda"), progress=print)
    rates.nvme_read_bytes_per_s          # None when no nvme_dir was given

What is measured (each the best of `repeats` timed passes, after an untimed warm-up):

- NVMe write and read: one file of `size_bytes` in a FileStore under `nvme_dir` (a private
  directory, removed afterwards, also on an exception or Ctrl-C; `size_bytes` None: 256 MiB, or
  on a disk with less room NVME_SHARE_OF_FREE of its free space, see nvme_test_file_bytes), moved by an IOEngine with the
  given IOConfig, `queue_depth` requests of `block_bytes` in flight, from and into one aligned
  host arena of random bytes, as scripts/bench_io.py does. The file is written once untimed
  first: the first write of fallocated space also converts unwritten extents and runs slower,
  while the engine's swap files are overwritten again and again. A write pass ends with fsync;
  where the file system refused O_DIRECT the file's cached pages are dropped before each read
  pass, so a read never comes from the page cache.
- Host to device and device to host: the engine's own copy path (runtime/device/) between an
  io_engine HostArena (pinned under CUDA, as the engine's host memory is) and device memory of
  min(size_bytes, 256 MiB): the copy streams under CUDA; on a machine without a GPU the device
  tier is host memory and the copy runs on the copy worker, as the engine fills a device slot.
- AdamW and SGD (with momentum): `torch._fused_adamw_` / `torch._fused_sgd_` on the CPU, called
  as offload_trainer/optimizer.py calls them, on fp32 tensors that together take size_bytes (at
  most 16 Mi elements each), in elements per second.

The host buffers of the copy and optimizer passes (on a CPU two copy buffers, then four optimizer
tensors: 512 and 256 MiB at the default size) are held to MEASURE_SHARE_OF_AVAILABLE of the memory
available (host_memory.py): in a 400 MiB container `placement = "auto"` was OOM-killed while it
measured, with no line, before it could plan anything.

The cache is a JSON file (default_cache_path()) of entries keyed by a machine key: host name,
the NVMe directory and its file system, the IOConfig, the device, the torch version and torch's
thread count; change any of these and the rates are measured again. Writes are atomic; an
unreadable cache file is ignored with a warning and replaced on the next write.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from io_engine import DirectMode, FileStore, HostArena, IOConfig, IOEngine, NotEnoughSpaceError, run_pass
from io_engine import file_store as io_file_store
from io_engine.buffers import round_up

from offload_trainer.config import OptimizerConfig
from offload_trainer.config.byte_size import format_bytes
from offload_trainer.runtime.device.choose import accelerator_for
from offload_trainer.runtime.device.pending import Pending
from offload_trainer.planning.host_memory import memory_available_bytes
from offload_trainer.planning.json_cache import cache_key_id, read_cache, store_entry

Progress = Callable[[str], None]

MiB = 1 << 20
DEFAULT_SIZE_BYTES = 256 * MiB
"""Bytes of the NVMe test file, and the cap of the copy buffers."""
NVME_SHARE_OF_FREE = 0.5
"""Share of nvme_dir's free space that the default NVMe test file may take (nvme_test_file_bytes)."""
DEFAULT_REPEATS = 3
MAX_COPY_BYTES = 256 * MiB
"""Copy buffers are min(size_bytes, this): large enough to reach the memory's streaming rate."""
MAX_OPTIMIZER_NUMEL = 16 * MiB
"""Elements of each optimizer tensor at most (4 fp32 tensors of 16 Mi elements = 256 MiB)."""
MEASURE_SHARE_OF_AVAILABLE = 0.25
"""Share of the memory available that the host buffers of one measurement pass may take."""
MIN_MEASURE_BYTES = 4 * MiB
"""The least a measurement pass's buffers take however little memory is available."""
OPTIMIZER_TENSORS = 4
"""param, grad and two states (AdamW); SGD uses three of them."""
CACHE_ENV = "OFFLOAD_TRAINER_CACHE"
"""Environment variable naming the cache file itself."""
_EXTENT_KEY = "machine-rates"
_SEED = 0x5EED
_MIN_SECONDS = 1e-9
"""Floor of a timed interval, so that a rate is always finite."""


@dataclass(frozen=True)
class MachineRates:
    """Bytes or elements per second of each operation the engine's placement depends on."""

    nvme_read_bytes_per_s: Optional[float]
    """Sequential reads through io_engine from a file in nvme_dir; None: no nvme_dir was measured."""
    nvme_write_bytes_per_s: Optional[float]
    """Sequential writes (ending with fsync) through io_engine; None: no nvme_dir was measured."""
    nvme_direct_io: Optional[bool]
    """Whether the NVMe passes bypassed the page cache (O_DIRECT); None: no nvme_dir was measured."""
    host_to_device_bytes_per_s: float
    """Host arena to device copy (pinned under CUDA; host to host on a machine without a GPU)."""
    device_to_host_bytes_per_s: float
    """Device to host arena copy."""
    adamw_elements_per_s: float
    """fp32 elements updated per second by torch._fused_adamw_ on the CPU."""
    sgd_elements_per_s: float
    """fp32 elements updated per second by torch._fused_sgd_ (with momentum) on the CPU."""

    def __post_init__(self) -> None:
        nvme = (self.nvme_read_bytes_per_s, self.nvme_write_bytes_per_s, self.nvme_direct_io)
        if any(v is None for v in nvme) and not all(v is None for v in nvme):
            raise ValueError(
                f"MachineRates NVMe fields {nvme} must all be set or all be None (not measured)"
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "nvme_direct_io":
                if value is not None and not isinstance(value, bool):
                    raise ValueError(f"MachineRates.nvme_direct_io={value!r} must be true, false or null")
                continue
            if value is None and f.name.startswith("nvme_"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"MachineRates.{f.name}={value!r} must be a finite number above 0")

    def to_dict(self) -> Dict[str, Any]:
        """The rates as plain JSON values."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "MachineRates":
        """Rates from to_dict()'s output; ValueError naming what is missing, extra or invalid."""
        if not isinstance(data, dict):
            raise ValueError(f"machine rates must be a JSON object, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        extra = sorted(set(data) - set(names))
        if missing or extra:
            raise ValueError(f"machine rates lack {missing} and have unknown {extra}; measure them again")
        values = {n: data[n] for n in names}
        for n, v in values.items():
            if isinstance(v, int) and not isinstance(v, bool):
                values[n] = float(v)
        return cls(**values)


# -- measuring -----------------------------------------------------------------------------------


def _rate(amount: float, seconds: float) -> float:
    return amount / max(seconds, _MIN_SECONDS)


def _best_seconds(run_once: Callable[[], float], repeats: int) -> float:
    return min(run_once() for _ in range(repeats))


def _nvme_pass(store: FileStore, slices: List[torch.Tensor], size_bytes: int, is_read: bool) -> float:
    """Move the whole extent block by block, len(slices) requests in flight; return the seconds.

    io_engine.run_pass through the FileStore, as the engine goes: slice k is reused as soon as its
    request completes, so the queue stays full. A write pass ends with fsync of the file, timed.
    """
    submit = functools.partial(store.pread if is_read else store.pwrite, _EXTENT_KEY)
    seconds = run_pass(submit, slices, range(0, size_bytes, slices[0].numel()), size_bytes)
    if not is_read:
        fsync_start_s = time.perf_counter()
        store.file_of(_EXTENT_KEY).fsync()
        seconds += time.perf_counter() - fsync_start_s
    return seconds


def nvme_test_file_bytes(nvme_dir: str, io: IOConfig, size_bytes: Optional[int]) -> int:
    """Bytes of the NVMe test file measure_rates writes in `nvme_dir`: `size_bytes` when given (ValueError
    if it does not fit); None: DEFAULT_SIZE_BYTES, or on a disk with less room NVME_SHARE_OF_FREE of its
    free space in whole blocks, at least one block (ValueError naming the directory if not even that fits).

    The planner measures with the default, and offload-train's user has no size to pass: a swap
    directory with 200 MiB free, ample for the swap files of a small model, refused placement =
    "auto" with "pass a smaller size_bytes". A smaller file gives rougher rates, never a refusal."""
    available = io_file_store.swap_room_bytes(nvme_dir)  # the store measuring reclaims dead runs' first
    if size_bytes is not None:
        needed = round_up(size_bytes, io.alignment_bytes)
        if needed > available:
            raise ValueError(
                f"measuring NVMe rates needs a test file of {needed} bytes ({format_bytes(needed)}) in "
                f"{nvme_dir}, but its file system has {available} bytes ({format_bytes(available)}) free; "
                f"pass a smaller size_bytes (at most {available // io.alignment_bytes * io.alignment_bytes}) or "
                "free some space"
            )
        return size_bytes
    fits = int(NVME_SHARE_OF_FREE * available) // io.block_bytes * io.block_bytes
    if fits < io.block_bytes:
        raise ValueError(
            f"the NVMe directory {nvme_dir} is on a file system with {format_bytes(available)} free, too little to "
            f"measure its rates (a test file of one IO block, {format_bytes(io.block_bytes)}, needs "
            f"{format_bytes(math.ceil(io.block_bytes / NVME_SHARE_OF_FREE))} free); free space there, or set "
            "tiers.nvme_dir to a directory on a disk with room"
        )
    return min(DEFAULT_SIZE_BYTES, fits)


def _measure_nvme(
    nvme_dir: str, io: IOConfig, size_bytes: int, repeats: int, progress: Progress
) -> Tuple[float, float, bool]:
    """(read bytes/s, write bytes/s, O_DIRECT used) of a test file of `size_bytes` in a FileStore under nvme_dir."""
    engine = IOEngine(io)
    finished = False
    try:
        store = FileStore(engine, nvme_dir)
        try:
            try:
                store.allocate({_EXTENT_KEY: size_bytes})
            except NotEnoughSpaceError as exc:
                raise ValueError(f"{exc}; or pass a smaller size_bytes") from None
            num_slots = min(io.queue_depth, -(-size_bytes // io.block_bytes))
            # Random bytes, not zeros: a virtual disk may turn zero writes into cheap "write zeroes".
            # Not pinned: IO does not need it, and an arena left pinned would outlive its mapping.
            buffer = HostArena(num_slots * io.block_bytes, pin=False).slice(0, num_slots * io.block_bytes)
            buffer.random_(generator=torch.Generator().manual_seed(_SEED))
            slices = [buffer[k * io.block_bytes : (k + 1) * io.block_bytes] for k in range(num_slots)]
            size_text = format_bytes(size_bytes)
            progress(f"writing the NVMe test file ({size_text}) in {nvme_dir} once, untimed")
            _nvme_pass(store, slices, size_bytes, is_read=False)
            progress(f"measuring NVMe write ({size_text})")
            write_s = _best_seconds(lambda: _nvme_pass(store, slices, size_bytes, is_read=False), repeats)
            direct = io.direct is not DirectMode.OFF and not engine.buffered_fallback

            def read_once() -> float:
                if not direct:
                    store.file_of(_EXTENT_KEY).drop_cached_pages()
                return _nvme_pass(store, slices, size_bytes, is_read=True)

            progress(f"measuring NVMe read ({size_text})")
            read_s = _best_seconds(read_once, repeats)
            finished = True
        finally:
            # Workers first (failing what is still queued unless all went well), then the files.
            engine.close(cancel=not finished)
            store.close()
    finally:
        engine.close(cancel=not finished)
    return _rate(size_bytes, read_s), _rate(size_bytes, write_s), direct


def _measure_copies(device: torch.device, nbytes: int, repeats: int, progress: Progress) -> Tuple[float, float]:
    """(host to device, device to host) bytes/s of the engine's own copy path (runtime/device/) between
    a host arena (pinned under CUDA, as the engine's are) and device memory of nbytes: a copy worker
    on the CPU, the copy streams under CUDA."""
    size_text = format_bytes(nbytes)
    accel = accelerator_for(device)
    where = " (device is host memory)" if accel.is_host else ""
    arena = HostArena(nbytes)
    device_arena = HostArena(nbytes, pin=False) if accel.torch_device.type == "cpu" else None
    try:
        host = arena.slice(0, nbytes)
        host.fill_(1)
        if device_arena is not None:
            on_device = device_arena.slice(0, nbytes)
        else:
            on_device = torch.empty(nbytes, dtype=torch.uint8, device=accel.torch_device)

        def copy_s(copy: Callable[[torch.Tensor, torch.Tensor], Pending], dst: torch.Tensor, src: torch.Tensor) -> float:
            start_s = time.perf_counter()
            accel.host_waits(copy(dst, src), "rate probe")
            return time.perf_counter() - start_s

        progress(f"measuring host-to-device copy ({size_text}{where})")
        copy_s(accel.h2d, on_device, host)
        h2d_s = _best_seconds(lambda: copy_s(accel.h2d, on_device, host), repeats)
        progress(f"measuring device-to-host copy ({size_text}{where})")
        copy_s(accel.d2h, host, on_device)
        d2h_s = _best_seconds(lambda: copy_s(accel.d2h, host, on_device), repeats)
    finally:
        accel.close()  # also after an error: every copy is done before the arena is unpinned
        arena.close()
    return _rate(nbytes, h2d_s), _rate(nbytes, d2h_s)


def _measure_optimizers(numel: int, repeats: int, progress: Progress) -> Tuple[float, float]:
    """(AdamW, SGD with momentum) fp32 elements/s of the fused kernels on the CPU."""
    cfg = OptimizerConfig()
    momentum = cfg.momentum if cfg.momentum != 0 else 0.9
    elem_bytes = 4
    stride = round_up(numel * elem_bytes, 4096)
    arena = HostArena(stride * OPTIMIZER_TENSORS, pin=False)  # a CPU kernel: pinning buys nothing
    param, grad, exp_avg, exp_avg_sq = (
        arena.slice(k * stride, numel * elem_bytes).view(torch.float32) for k in range(OPTIMIZER_TENSORS)
    )
    generator = torch.Generator().manual_seed(_SEED)
    param.normal_(generator=generator)
    grad.normal_(generator=generator)
    exp_avg.zero_()
    exp_avg_sq.zero_()
    step = torch.zeros((), dtype=torch.float32)

    def adamw_s() -> float:
        step.add_(1)
        start_s = time.perf_counter()
        torch._fused_adamw_(
            [param],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [step],
            lr=cfg.lr,
            beta1=cfg.betas[0],
            beta2=cfg.betas[1],
            weight_decay=cfg.weight_decay,
            eps=cfg.eps,
            amsgrad=False,
            maximize=False,
        )
        return time.perf_counter() - start_s

    def sgd_s() -> float:
        start_s = time.perf_counter()
        # is_first_step=False: the steady state, where the momentum buffer is read and written.
        torch._fused_sgd_(
            [param],
            [grad],
            [exp_avg],
            weight_decay=cfg.weight_decay,
            momentum=momentum,
            lr=cfg.lr,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            is_first_step=False,
        )
        return time.perf_counter() - start_s

    progress(f"measuring AdamW ({numel / MiB:g} Mi fp32 elements)")
    adamw_s()
    adamw = _rate(numel, _best_seconds(adamw_s, repeats))
    progress(f"measuring SGD with momentum ({numel / MiB:g} Mi fp32 elements)")
    sgd_s()
    sgd = _rate(numel, _best_seconds(sgd_s, repeats))
    return adamw, sgd


def _check_device(device: torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device={str(device)!r} is not supported: use 'cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but CUDA is not available here; use device 'cpu'")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


def measure_rates(
    nvme_dir: Optional[str],
    io: IOConfig,
    device: torch.device,
    size_bytes: Optional[int] = None,
    repeats: int = DEFAULT_REPEATS,
    progress: Optional[Progress] = None,
    device_rates: Optional[MachineRates] = None,
) -> MachineRates:
    """Measure every rate now (see the file docstring for how); takes seconds, and size_bytes on disk.

    `nvme_dir` None: the NVMe rates are None. `size_bytes` None: the NVMe test file fits the disk
    (nvme_test_file_bytes) and the host buffers are sized by DEFAULT_SIZE_BYTES. ValueError if a
    size_bytes given does not fit on nvme_dir's file system (checked before anything is written). The test file is removed
    whatever happens. `device_rates`: rates of this machine and device measured for another
    IOConfig; their copy and optimizer rates, which no IO setting changes, are taken from it
    rather than measured again (the tuner measures one IO setting after another).
    """
    if size_bytes is not None and (isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 1):
        raise ValueError(f"size_bytes={size_bytes!r} must be a positive int, e.g. {DEFAULT_SIZE_BYTES} (256 MiB)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int of at least 1, e.g. {DEFAULT_REPEATS}")
    device = _check_device(device)
    say: Progress = progress if progress is not None else (lambda _message: None)
    nvme_read: Optional[float] = None
    nvme_write: Optional[float] = None
    direct: Optional[bool] = None
    if nvme_dir is not None:
        nvme_dir = os.fspath(nvme_dir)
        nvme_bytes = nvme_test_file_bytes(nvme_dir, io, size_bytes)
        nvme_read, nvme_write, direct = _measure_nvme(nvme_dir, io, nvme_bytes, repeats, say)
    if device_rates is not None:
        say("copy and optimizer rates: those of another IO setting (no IO setting changes them)")
        return dataclasses.replace(
            device_rates, nvme_read_bytes_per_s=nvme_read, nvme_write_bytes_per_s=nvme_write, nvme_direct_io=direct
        )
    if size_bytes is None:
        size_bytes = DEFAULT_SIZE_BYTES
    host_bytes = max(MIN_MEASURE_BYTES, int(MEASURE_SHARE_OF_AVAILABLE * memory_available_bytes()) // MiB * MiB)
    copy_buffers = 2 if device.type == "cpu" else 1  # on a CPU the "device" buffer is host memory too
    h2d, d2h = _measure_copies(device, min(size_bytes, MAX_COPY_BYTES, host_bytes // copy_buffers), repeats, say)
    numel = max(1, min(MAX_OPTIMIZER_NUMEL, min(size_bytes, host_bytes) // (OPTIMIZER_TENSORS * 4)))
    adamw, sgd = _measure_optimizers(numel, repeats, say)
    return MachineRates(
        nvme_read_bytes_per_s=nvme_read,
        nvme_write_bytes_per_s=nvme_write,
        nvme_direct_io=direct,
        host_to_device_bytes_per_s=h2d,
        device_to_host_bytes_per_s=d2h,
        adamw_elements_per_s=adamw,
        sgd_elements_per_s=sgd,
    )


# -- the cache -----------------------------------------------------------------------------------


def default_cache_path() -> Path:
    """$OFFLOAD_TRAINER_CACHE (the file itself), else $XDG_CACHE_HOME/offload-trainer/machine.json,
    else ~/.cache/offload-trainer/machine.json."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec: a relative path in XDG_CACHE_HOME is invalid and is to be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "offload-trainer" / "machine.json"
    home = os.path.expanduser("~")
    if not os.path.isabs(home):  # Path.home() raises RuntimeError, a traceback for the user
        raise ValueError(
            f"there is no home directory for the machine-rate cache (HOME is unset and user id {os.getuid()} has "
            f"no password entry): set {CACHE_ENV} to the cache file's path, or HOME to a writable directory"
        )
    return Path(home) / ".cache" / "offload-trainer" / "machine.json"


def machine_key(nvme_dir: Optional[str], io: IOConfig, device: torch.device) -> Dict[str, Any]:
    """What the rates depend on: equal keys, same rates. JSON values only.

    The NVMe directory counts by its resolved path and its file system (st_dev; of the closest
    existing parent if the directory is not made yet, as FileStore would make it there).
    """
    device = _check_device(device)
    nvme: Optional[Dict[str, Any]] = None
    if nvme_dir is not None:
        resolved = os.path.realpath(os.fspath(nvme_dir))
        nvme = {"path": resolved, "st_dev": os.stat(io_file_store.existing_ancestor(resolved)).st_dev}
    io_fields = {f.name: getattr(io, f.name) for f in dataclasses.fields(io)}
    io_fields = {k: v.value if isinstance(v, DirectMode) else v for k, v in io_fields.items()}
    io_fields["num_threads"] = io.worker_threads()  # unset: this machine's count (the rates depend on it)
    return {
        "hostname": socket.gethostname(),
        "nvme": nvme,
        "io": io_fields,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
    }


def machine_rates(
    nvme_dir: Optional[str],
    io: IOConfig,
    device: torch.device,
    *,
    cache_path: Optional[Path] = None,
    refresh: bool = False,
    progress: Optional[Progress] = None,
    size_bytes: Optional[int] = None,
    repeats: int = DEFAULT_REPEATS,
    device_rates: Optional[MachineRates] = None,
) -> Tuple[MachineRates, bool]:
    """(rates, from_cache): the cached rates of this machine key, or measured now and cached.

    `cache_path` defaults to default_cache_path(); `refresh` measures again even on a hit.
    `size_bytes`, `repeats` and `device_rates` go to measure_rates on a miss (they are not part
    of the key).
    A cache that cannot be written is warned about, and the measured rates are still returned.
    """
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    say: Progress = progress if progress is not None else (lambda _message: None)
    key = machine_key(nvme_dir, io, device)
    key_id = cache_key_id(key)
    if not refresh:
        entry = read_cache(path).get(key_id)
        if isinstance(entry, dict) and entry.get("key") == key:
            try:
                rates = MachineRates.from_dict(entry.get("rates"))
            except ValueError as exc:
                warnings.warn(f"ignoring an unreadable entry of the machine-rate cache {path}: {exc}", stacklevel=2)
            else:
                say(f"machine rates from the cache {path} (measured {entry.get('measured_at', '?')})")
                return rates, True
    rates = measure_rates(
        nvme_dir, io, device, size_bytes=size_bytes, repeats=repeats, progress=progress, device_rates=device_rates
    )
    measured_at_s = time.time()
    entry = {
        "key": key,
        "rates": rates.to_dict(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(measured_at_s)),
        "measured_at_unix_s": measured_at_s,
        "size_bytes": size_bytes,
        "repeats": repeats,
    }
    if store_entry(path, key_id, entry, "machine-rate cache"):
        say(f"machine rates saved to {path}")
    return rates, False


__all__ = [
    "MachineRates",
    "cache_key_id",
    "default_cache_path",
    "machine_key",
    "machine_rates",
    "measure_rates",
    "nvme_test_file_bytes",
    "read_cache",
    "store_entry",
]
