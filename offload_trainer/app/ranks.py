"""The data-parallel ranks of an offload-train run: joining them with a timeout, and naming the rank
that stopped answering when a collective fails.

    ranks = join_ranks(timeout_s=300)            # torchrun's env (WORLD_SIZE > 1): gloo on CPU, NCCL (+ gloo) on CUDA
    ...
    except RuntimeError as exc:
        if ranks.is_collective_failure(exc):
            raise RankFailure(ranks.describe_failure(exc, "during step 5", trainer.how_to_continue())) from exc
    ranks.leave()

[Note: Which rank stopped answering]
A collective fails in one of two ways when a peer is gone: at once ("Connection closed by peer")
when the peer's process died, or after the process group's timeout (train.dist_timeout_s) when the
peer is alive but stopped: SIGSTOP, a hang in a system call, a machine that froze. Neither error
says which rank. So each rank runs a heartbeat: a daemon thread adds 1 to its own counter in the
rendezvous store (the TCPStore at MASTER_ADDR:MASTER_PORT, torchrun's or rank 0's, over a
connection of the thread's own) every HEARTBEAT_INTERVAL_S. When a collective fails, the rank reads
every counter, waits STALE_AFTER_S, and reads them again: the ranks whose counters did not move are
the ones that stopped answering. If the store itself does not answer, it lived in the process that
stopped (rank 0 hosts it outside torchrun). A stopped process's threads stop with it, so the test
is of the process, not of its training loop; a rank that is alive but slow is reported as such,
with the timeout to raise.

[Note: A store that is gone, quietly]
c10d's TCPStore client prints to stderr from C++ (a warning with a stack trace, then one per
connection retry) when its store is gone: the heartbeat's next add and the check for stopped
ranks printed some fifty lines before the one line the run ends with, whenever rank 0 (the store's
host outside torchrun) died. So neither asks a store that is gone: the heartbeat also holds a bare
TCP connection to the store that it never writes to, and stops beating once the store's end
closes it (the kernel closes it however the host dies); the check first connects with a bare
socket and counts the store as gone if that is refused, and watches that socket through its wait
between the two reads of the counters (a rank 0 interrupted mid-checkpoint still hosts the store
while it cleans up, and was gone by the second read). The store's server takes such connections
without a word. A rank other than 0 waits the same way for the store to accept a bare connection
before it joins (_wait_for_store): rank 0 killed before it made the store left c10d's client retrying,
and printing, for twice the timeout. The heartbeat's connections are made before join_ranks returns,
and the ranks then pass a barrier, so that no rank goes on (and dies) while another still connects.

[Note: A request in flight as the store dies]
A check of the bare connection comes before each request, never with it: the heartbeat's add sent
just after its check found the store's end open, and answered by no one because the host died in
between (some milliseconds on a loaded machine, where the thread waits for the GIL after its check),
made c10d's client log a warning with a C++ stack trace ("recvValue failed") above the rank's one
line, now and then (a flaky two-rank kill test). No check closes that window, and c10d offers no
quieter request. So offload-train with several ranks starts torch with its C++ log lines below ERROR
off (app/launch.py's quiet_cpp_warnings, before torch is imported; TORCH_CPP_LOG_LEVEL=WARNING or
INFO set by the user brings them back): the failed request raises all the same, and the heartbeat
ends on it quietly. One rank runs with torch's C++ warnings as they are.
"""

from __future__ import annotations

import datetime
import os
import re
import select
import socket
import threading
import time
from typing import List, Optional

import torch
import torch.distributed as dist

HEARTBEAT_INTERVAL_S = 0.5
"""How often each rank's heartbeat counter moves."""
STALE_AFTER_S = 2.0
"""A counter that did not move in this long belongs to a rank that stopped answering (4 beats)."""
STORE_TIMEOUT_S = 3.0
"""How long one request to the rendezvous store may take before the store counts as gone."""
_KEY_PREFIX = "offload-trainer/heartbeat"
DEFAULT_JOIN_TIMEOUT_S = 1800.0
"""How long a rank waits for the rendezvous store when join_ranks is given no timeout (torch's default)."""


class RankFailure(RuntimeError):
    """A collective between ranks failed because a rank stopped answering (its message names it)."""


def _store_address() -> Optional[tuple]:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        return None
    return host, int(port)


def _connect(timeout_s: float) -> "dist.Store":
    address = _store_address()
    if address is None:
        raise RuntimeError("no MASTER_ADDR and MASTER_PORT: the rendezvous store cannot be reached")
    return dist.TCPStore(
        address[0], address[1], is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _bare_connection(timeout_s: float) -> Optional[socket.socket]:
    """A plain TCP connection to the rendezvous store, or None if none can be made (the store is
    gone): never through c10d, which prints its failures ([Note: A store that is gone, quietly])."""
    address = _store_address()
    if address is None:
        return None
    try:
        return socket.create_connection(address, timeout=timeout_s)
    except OSError:
        return None


def _closed(connection: socket.socket) -> bool:
    """Whether the store's end closed `connection` (a bare one, never written to): its host is gone."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _closes_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the store's end closes `connection` (a bare one) within `seconds`; False if it is still open then."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return _closed(connection)
        try:
            readable, _, _ = select.select([connection], [], [], left)
        except OSError:
            return True
        if readable and _closed(connection):
            return True
        if readable:  # the store never writes to it: nothing to wait for but its close
            time.sleep(min(left, 0.05))


def _wait_for_store(timeout_s: float) -> None:
    """Before a rank other than 0 joins: wait, quietly, until the rendezvous store accepts a bare
    connection, else DistStoreError naming it. c10d's own client, asked to join a store that never
    comes (rank 0, its host outside torchrun, died before it made it), retried for twice the
    timeout and printed some fifty lines of C++ stack traces before the one line the run ends with
    ([Note: A store that is gone, quietly])."""
    address = _store_address()
    if address is None:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        connection = _bare_connection(max(0.1, min(STORE_TIMEOUT_S, deadline - time.monotonic())))
        if connection is not None:
            connection.close()
            return
        if time.monotonic() >= deadline:
            raise dist.DistStoreError(
                f"the rendezvous store at {address[0]}:{address[1]} (MASTER_ADDR:MASTER_PORT, hosted by rank 0 "
                f"or torchrun's agent) accepted no connection within train.dist_timeout_s={timeout_s:g}: "
                "rank 0 is gone or never started"
            )
        time.sleep(0.1)


def _key(rank: int) -> str:
    # One run's keys: torchrun restarts reuse its store, so the attempt is part of the key.
    return f"{_KEY_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


class Ranks:
    """This process's place among the data-parallel ranks (rank 0 of 1 without torch.distributed)."""

    def __init__(self, rank: int, world_size: int, timeout_s: Optional[float]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def several(self) -> bool:
        return self.world_size > 1

    def start_heartbeat(self) -> None:
        """Start this rank's heartbeat (see [Note: Which rank stopped answering]); a store that cannot be
        reached leaves the rank without one, and failures are then described without naming a rank.
        Its connections are made here, before join_ranks' barrier: made in the thread, they raced rank
        0's death right after the join (a SIGKILL while it built its model), and c10d's client printed
        its retries with their stack traces above the other rank's one line."""
        if not self.several or _store_address() is None:
            return
        watch = _bare_connection(STORE_TIMEOUT_S)
        if watch is None:
            return
        try:
            store = _connect(STORE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the store went away: the failure, if any, is described elsewhere
            watch.close()
            return
        self._thread = threading.Thread(
            target=self._beat, args=(watch, store), name="offload-trainer-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self, watch: socket.socket, store: "dist.Store") -> None:
        try:
            while not self._stop.is_set() and not _closed(watch):  # [Note: A store that is gone, quietly]
                store.add(_key(self.rank), 1)  # [Note: A request in flight as the store dies]
                self._stop.wait(HEARTBEAT_INTERVAL_S)
        except Exception:  # noqa: BLE001 - the store went away: the failure, if any, is described elsewhere
            return
        finally:
            watch.close()

    def stopped_ranks(self) -> Optional[List[int]]:
        """The other ranks whose heartbeat did not move in STALE_AFTER_S; None if the store does not answer
        (or no heartbeat runs). Takes about STALE_AFTER_S."""
        if self._thread is None:
            return None
        probe = _bare_connection(STORE_TIMEOUT_S)  # [Note: A store that is gone, quietly]
        if probe is None:
            return None
        try:
            store = _connect(STORE_TIMEOUT_S)
            others = [r for r in range(self.world_size) if r != self.rank]
            before = {r: store.add(_key(r), 0) for r in others}
            # The store's host may be on its way out (rank 0 interrupted, cleaning up): watch the bare
            # connection through the wait, and ask the store nothing more once its end has closed it.
            if _closes_within(probe, STALE_AFTER_S):
                return None
            after = {r: store.add(_key(r), 0) for r in others}
        except Exception:  # noqa: BLE001 - any failure to reach the store means it is gone
            return None
        finally:
            probe.close()
        return [r for r in others if after[r] == before[r]]

    def is_collective_failure(self, exc: BaseException) -> bool:
        """Whether `exc` (raised during a multi-rank run) is a collective that failed or timed out."""
        if not self.several or isinstance(exc, RankFailure):
            return False
        dist_error = getattr(dist, "DistError", None)
        if dist_error is not None and isinstance(exc, dist_error):
            return True
        text = str(exc)
        return isinstance(exc, RuntimeError) and any(
            marker in text
            for marker in (
                "gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out",
                # all_gather_single's work.wait() when a stopped peer lets the process group time out
                "Application timeout caused pair closure",
            )
        )

    def describe_failure(self, exc: BaseException, moment: str, how_to_continue: str) -> str:
        """One line: which rank stopped answering (see [Note: Which rank stopped answering]), when
        (`moment`: "during step 5", "while saving ckpt-000004") and what continues the run once every
        rank can run (`how_to_continue`: the trainer's, from what is on disk)."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)  # gloo's source location
        stopped = self.stopped_ranks()
        if stopped:
            who = (
                f"rank {stopped[0]} stopped answering" if len(stopped) == 1
                else f"ranks {', '.join(map(str, stopped))} stopped answering"
            ) + " (its process died, was stopped or hangs)"
        elif stopped is None and self._thread is not None:
            who = "the rendezvous store stopped answering too, so rank 0 (which hosts it) or torchrun's agent is gone"
        elif stopped is None:
            who = "another rank stopped answering"
        else:
            who = (
                "every rank is still alive, so one was too slow to reach the collective within "
                f"train.dist_timeout_s={self.timeout_s:g}; raise it if steps (or saves) can take that long"
            )
        return f"a collective failed {moment} ({first}): {who}. The run stops; once every rank can run, {how_to_continue}"

    def barrier(self) -> None:
        if self.several:
            dist.barrier()

    def leave(self) -> None:
        """Stop the heartbeat and leave the process group (if this process joined one)."""
        self._stop.set()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def process_group_backend(cuda: bool) -> str:
    """gloo on the CPU; on CUDA, NCCL for CUDA tensors and gloo for host ones. The engine and the
    trainer also run collectives on small host tensors (the ranks' agreements, the gradient norm's
    sum of squares, the step's loss, a checkpoint's shared name, consolidated exports), which a
    process group of NCCL alone refuses ("No backend type associated with device type cpu")."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def local_cuda_index(local_rank: int, device_count: int) -> int:
    """The GPU of the rank `local_rank` (torchrun's LOCAL_RANK) of its node: its own, or the only one
    it sees (CUDA_VISIBLE_DEVICES set per process). Without it every rank would use GPU 0, and NCCL
    refuses two ranks on one GPU."""
    if device_count == 1:
        return 0
    if not 0 <= local_rank < device_count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but this node has {device_count} GPUs: start at most {device_count} "
            "processes per node (torchrun --nproc-per-node)"
        )
    return local_rank


def _launcher_int(name: str, default: int, minimum: int, below: Optional[int] = None) -> int:
    """The whole number torchrun put in the environment variable `name` (`default` where it is unset),
    or ValueError naming the variable, its value and the fix: int()'s own message named neither."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum or (below is not None and value >= below):
        bound = f"from {minimum} to {below - 1}" if below is not None else f"{minimum} or more"
        raise ValueError(
            f"the environment variable {name}={raw!r} must be a whole number {bound}: start the run with torchrun, "
            f"which sets it, or unset {name} (and WORLD_SIZE, RANK, LOCAL_RANK) to train on one rank"
        )
    return value


def _check_rendezvous_address() -> None:
    """ValueError naming the variable, its value and the fix unless MASTER_ADDR and MASTER_PORT say where the
    rendezvous store is (a host, and a port from 1 to 65535): torch's own messages named no variable for a port
    that is no number ("invalid literal for int() with base 10: 'abc'") or one out of range ("port must have
    value from 0 to 65535 but was 99999."), and no fix for either variable missing."""
    fix = (
        "start the run with torchrun, which sets it, or set it by hand on every rank (MASTER_ADDR: rank 0's host; "
        "MASTER_PORT: a free port there)"
    )
    host = os.environ.get("MASTER_ADDR")
    if host is None or not host.strip():
        raise ValueError(
            f"the environment variable MASTER_ADDR={host!r} must name the host of rank 0 when WORLD_SIZE > 1: {fix}"
        )
    raw = os.environ.get("MASTER_PORT")
    try:
        port = int(raw.strip()) if raw is not None else None
    except ValueError:
        port = None
    if port is None or not 1 <= port <= 65535:
        raise ValueError(
            f"the environment variable MASTER_PORT={raw!r} must be a port number from 1 to 65535 when "
            f"WORLD_SIZE > 1: {fix}"
        )


def join_ranks(timeout_s: Optional[float] = None) -> Ranks:
    """Under torchrun (WORLD_SIZE > 1), join the process group (process_group_backend), with
    `timeout_s` for every collective, each rank on its own GPU (local_cuda_index) under CUDA; start
    the heartbeat. One rank of one otherwise. torchrun's variables are checked first (_launcher_int,
    _check_rendezvous_address)."""
    world = _launcher_int("WORLD_SIZE", 1, minimum=1)
    if world > 1 and not dist.is_initialized():
        rank = _launcher_int("RANK", 0, minimum=0, below=world)
        local_rank = _launcher_int("LOCAL_RANK", 0, minimum=0)
        _check_rendezvous_address()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_cuda_index(local_rank, torch.cuda.device_count()))
        kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        if rank != 0:
            _wait_for_store(timeout_s if timeout_s is not None else DEFAULT_JOIN_TIMEOUT_S)
        dist.init_process_group(process_group_backend(cuda), **kwargs)
    if dist.is_available() and dist.is_initialized():
        ranks = Ranks(dist.get_rank(), dist.get_world_size(), timeout_s)
    else:
        ranks = Ranks(0, 1, timeout_s)
    ranks.start_heartbeat()
    if ranks.several and _store_address() is not None:  # the same on every rank: all take this barrier or none
        try:  # every rank's heartbeat is connected (or failed to) before any goes on (start_heartbeat)
            dist.barrier()
        except Exception as exc:
            if not ranks.is_collective_failure(exc):
                raise
            raise dist.DistError(f"a rank left while the ranks joined ({str(exc).strip().splitlines()[0]})") from exc
    return ranks
