"""Tokens: the IOEngine's counting semaphore, with C calls for acquire and release."""

import os
import signal
import sys
import threading
import types

import pytest

from io_engine.tokens import Tokens


def test_tokens_count_like_a_semaphore() -> None:
    slots = Tokens(2)
    slots.acquire()
    slots.acquire()
    assert slots.count == 0
    taken = threading.Event()

    def take() -> None:
        slots.acquire()
        taken.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    assert not taken.wait(0.05), "acquire returned with no token left"
    slots.release()
    assert taken.wait(30), "release did not wake the waiter"  # a hang guard, not a timing
    waiter.join(30)
    slots.release()
    slots.release()
    assert slots.count == 2
    with pytest.raises(ValueError, match="count=-1"):
        Tokens(-1)


def test_acquire_and_release_run_no_python_code() -> None:
    """The point of Tokens: threading.Semaphore's Python-level Condition cost several Python calls per
    acquire and release, two of each per block the IOEngine moves."""
    slots = Tokens(1)
    calls = []

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        slots.acquire()
        slots.release()
    finally:
        sys.setprofile(None)
    assert calls == []


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signals")
def test_ctrl_c_ends_a_wait_for_a_token() -> None:
    slots = Tokens(0)
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            slots.acquire()
    finally:
        timer.cancel()
