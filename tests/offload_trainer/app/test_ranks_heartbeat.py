"""app/ranks.py's heartbeat against a rendezvous store whose host dies (rank 0 outside torchrun):
the rank left says so in its one line, and c10d prints nothing on the way
([Note: A store that is gone, quietly]); nor when the store never comes (rank 0 died before it made it).

Run: pytest tests/offload_trainer/app/test_ranks_heartbeat.py
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from offload_trainer.app.ranks import HEARTBEAT_INTERVAL_S, STALE_AFTER_S, Ranks, _key, join_ranks

STORE_HOST = r"""
import time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(300)
"""


def test_a_rank_whose_store_host_died_prints_nothing_of_c10d(monkeypatch, capfd: pytest.CaptureFixture) -> None:
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        ranks = Ranks(rank=1, world_size=2, timeout_s=10.0)
        ranks.start_heartbeat()
        try:
            reader = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=10))
            deadline = time.monotonic() + 30
            while reader.add(_key(1), 0) == 0 and time.monotonic() < deadline:  # the heartbeat beats
                time.sleep(0.05)
            assert reader.add(_key(1), 0) > 0
            del reader
            host.kill()  # SIGKILL: rank 0, the store's host, is gone
            host.wait()
            time.sleep(3 * HEARTBEAT_INTERVAL_S)  # the heartbeat's next beats meet the dead store
            assert ranks.stopped_ranks() is None  # "the rendezvous store stopped answering too"
        finally:
            ranks.leave()
    finally:
        host.kill()
        host.wait()
    assert capfd.readouterr().err == ""


def test_a_store_host_that_dies_while_the_stopped_ranks_are_counted_prints_nothing(
    monkeypatch, capfd: pytest.CaptureFixture
) -> None:
    """Rank 0 interrupted mid-checkpoint still hosts the store while it cleans up: the other rank's
    count of stopped ranks found the store there, read the counters, and read them again
    STALE_AFTER_S later from a store that was gone by then, so c10d printed its warning and stack
    (a slow test's one line became 17). The wait now watches a bare connection and asks no more."""
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setattr("offload_trainer.app.ranks.HEARTBEAT_INTERVAL_S", 60.0)  # one beat: the count's reads only
        ranks = Ranks(rank=1, world_size=2, timeout_s=10.0)
        ranks.start_heartbeat()
        try:
            killer = threading.Timer(STALE_AFTER_S / 4, host.kill)  # while the count waits
            killer.start()
            assert ranks.stopped_ranks() is None  # "the rendezvous store stopped answering too"
            killer.join()
        finally:
            ranks.leave()
    finally:
        host.kill()
        host.wait()


def test_a_rank_whose_store_never_comes_ends_naming_it_and_c10d_prints_nothing(
    monkeypatch, capfd: pytest.CaptureFixture
) -> None:
    """Rank 0 (the store's host outside torchrun) was killed before it made the store: rank 1's join
    gives up after the timeout with an error naming the store, and nothing else on stderr (c10d's
    client printed some fifty lines of C++ stack traces while it retried for twice the timeout)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(dist.DistError, match=f"127.0.0.1:{port} .*accepted no connection within "
                                             r"train.dist_timeout_s=1: rank 0 is gone"):
        join_ranks(timeout_s=1.0)
    assert not dist.is_initialized()
    assert capfd.readouterr().err == ""


RACING_BEAT = r"""
import os, subprocess, sys, time
os.environ["WORLD_SIZE"] = "2"
from offload_trainer.app.launch import quiet_cpp_warnings
quiet_cpp_warnings()  # what offload-train does before torch is imported
from offload_trainer.app import ranks as ranks_module
host = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=host.stdout.readline().strip())
ranks_module._closed = lambda connection: False  # every check done just before the host dies
ranks = ranks_module.Ranks(rank=1, world_size=2, timeout_s=10.0)
ranks.start_heartbeat()
time.sleep(2 * ranks_module.HEARTBEAT_INTERVAL_S)
host.kill()
host.wait()
ranks._thread.join(10)
print("heartbeat ended" if not ranks._thread.is_alive() else "heartbeat still beating", flush=True)
"""


def test_a_beat_sent_as_the_store_host_dies_prints_nothing_of_c10d() -> None:
    """The heartbeat checks the store's end before each add, but the host can die between the check and
    the reply: c10d's client then logged "recvValue failed" with a C++ stack trace above the other
    rank's one line (now and then: the two-rank kill test of rank 0 mid-checkpoint). Here every check
    passes, so the add after the death is certain: offload-train's C++ log level (quiet_cpp_warnings,
    set as a run of several ranks starts) keeps it off stderr, and the heartbeat ends on the error."""
    done = subprocess.run([sys.executable, "-c", RACING_BEAT, STORE_HOST], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "heartbeat ended"
    assert done.stderr == "", done.stderr[-3000:]


def test_the_cpp_log_level_is_quieted_for_several_ranks_only_and_never_over_the_users(monkeypatch) -> None:
    from offload_trainer.app.launch import quiet_cpp_warnings

    for world, before, after in (("2", None, "ERROR"), ("1", None, None), (None, None, None), ("4", "INFO", "INFO")):
        environ = {k: v for k, v in (("WORLD_SIZE", world), ("TORCH_CPP_LOG_LEVEL", before)) if v is not None}
        quiet_cpp_warnings(environ)
        assert environ.get("TORCH_CPP_LOG_LEVEL") == after, (world, before)
