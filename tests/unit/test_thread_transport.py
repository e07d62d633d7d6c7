"""``ThreadTransport``: the core is built in the thread that then runs its loop (one OpenMP pool) and
closes it, build errors reach the caller, and a built core that never started still lets its thread end."""

from __future__ import annotations

import threading

import pytest

from engine.core_messages import Shutdown
from engine.core_transport import ThreadTransport


class FakeCore:
    def __init__(self) -> None:
        self.facts = "facts"
        self.built_in = threading.get_ident()
        self.ran_in = None
        self.closed_in = None
        self.commands = []

    def run(self, channel) -> None:
        self.ran_in = threading.get_ident()
        while True:
            command = channel.get(block=True)
            self.commands.append(command)
            if isinstance(command, Shutdown):
                channel.put("stopped")
                return

    def close(self) -> None:
        self.closed_in = threading.get_ident()


def test_builds_and_runs_in_one_thread_other_than_the_callers():
    transport = ThreadTransport(FakeCore)
    core = transport.core
    assert transport.facts == "facts" and core.built_in != threading.get_ident()
    messages = []
    transport.start(messages.append)
    transport.send("hello")
    transport.shutdown(timeout_s=5)
    assert core.ran_in == core.built_in == core.closed_in   # the loop's end closes the core, in its thread
    assert core.commands[0] == "hello" and isinstance(core.commands[1], Shutdown) and messages == ["stopped"]
    assert not transport.is_alive()


def test_build_error_is_raised_to_the_caller():
    def fail():
        raise ValueError("bad model")
    with pytest.raises(ValueError, match="bad model"):
        ThreadTransport(fail)


def test_shutdown_before_start_ends_the_thread():
    transport = ThreadTransport(FakeCore)
    transport.shutdown(timeout_s=5)
    assert not transport._thread.is_alive() and transport.core.ran_in is None
    assert transport.core.closed_in == transport.core.built_in
