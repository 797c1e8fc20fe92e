"""Signal handlers that only set a flag (preemption/signals.py), with real signals.

Each case delivers a real ``os.kill(os.getpid(), …)`` to this process: our handler must
record the signal and chain to the handler that was there before (a user's), ``restore``
must put that one back, and a handler of ours left installed after ``restore`` (Lightning
restores the handlers it found, which may be ours) must behave like the one it replaced.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import pytest

from lightning_preempt.preemption.signals import SignalFlag, resolve_signal

SIG = signal.SIGUSR1
OTHER = signal.SIGUSR2


@pytest.fixture(autouse=True)
def _keep_handlers() -> Iterator[None]:
    """Whatever a case installs, the test process gets its own handlers back."""
    saved = {s: signal.getsignal(s) for s in (SIG, OTHER)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


class UserHandler:
    """A user's own handler: records what it was called with."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.calls.append(signum)


def _deliver(sig: int, until: Callable[[], bool]) -> None:
    """Send ``sig`` to this process and let Python run its handler (it runs on the main
    thread between bytecodes, normally before ``os.kill`` returns); fail after 5 s."""
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + 5
    while not until():
        assert time.monotonic() < deadline, f"the handler for {signal.Signals(sig).name} never ran"
        time.sleep(0.001)  # lets the interpreter reach its pending-signal check


def test_the_flag_is_set_and_the_users_handler_still_runs() -> None:
    user = UserHandler()
    signal.signal(SIG, user)
    flag = SignalFlag(["SIGUSR1"])
    assert flag.install() is True
    assert signal.getsignal(SIG) is not user and flag.active
    assert not flag.is_set and flag.poll() is None

    _deliver(SIG, until=lambda: bool(user.calls))
    assert flag.is_set and flag.received is SIG and flag.count == 1
    assert user.calls == [SIG]  # chained: the user's handler ran too, once
    notice = flag.poll()
    assert notice is not None and notice.source == "SIGUSR1" and notice.reason == "received SIGUSR1"
    assert notice.received_at == flag.received_at and flag.received_at is not None


def test_the_first_signal_is_kept_and_later_ones_are_counted() -> None:
    users = {SIG: UserHandler(), OTHER: UserHandler()}
    for s, handler in users.items():
        signal.signal(s, handler)
    flag = SignalFlag(["USR1", signal.SIGUSR2])
    flag.install()
    _deliver(OTHER, until=lambda: bool(users[OTHER].calls))
    first_at = flag.received_at
    _deliver(SIG, until=lambda: bool(users[SIG].calls))
    _deliver(SIG, until=lambda: len(users[SIG].calls) == 2)
    assert flag.received is OTHER and flag.received_at == first_at and flag.count == 3
    assert users[OTHER].calls == [OTHER] and users[SIG].calls == [SIG, SIG]
    flag.clear()
    assert not flag.is_set and flag.count == 0 and flag.poll() is None


def test_restore_puts_the_users_handler_back() -> None:
    user = UserHandler()
    signal.signal(SIG, user)
    flag = SignalFlag(["SIGUSR1"])
    flag.install()
    flag.install()  # a second install (a second fit) changes nothing: the user's stays the one to restore
    flag.restore()
    assert signal.getsignal(SIG) is user and not flag.active
    _deliver(SIG, until=lambda: bool(user.calls))
    assert user.calls == [SIG] and not flag.is_set  # ours is gone: nothing recorded


def test_restore_leaves_a_handler_installed_after_ours_alone() -> None:
    user, later = UserHandler(), UserHandler()
    signal.signal(SIG, user)
    flag = SignalFlag(["SIGUSR1"])
    flag.install()
    signal.signal(SIG, later)  # someone else installed theirs over ours
    flag.restore()
    assert signal.getsignal(SIG) is later  # not ours to replace


def test_a_stale_handler_behaves_like_the_one_it_replaced() -> None:
    user = UserHandler()
    signal.signal(SIG, user)
    flag = SignalFlag(["SIGUSR1"])
    flag.install()
    ours = signal.getsignal(SIG)
    flag.restore()
    signal.signal(SIG, ours)  # e.g. Lightning restoring the handlers it found at its start: ours
    _deliver(SIG, until=lambda: bool(user.calls))
    assert user.calls == [SIG] and not flag.is_set and flag.count == 0
    assert signal.getsignal(SIG) is user  # and it handed the signal back for good


def test_a_stale_handler_over_sig_ign_ignores_the_signal() -> None:
    signal.signal(SIG, signal.SIG_IGN)
    flag = SignalFlag(["SIGUSR1"])
    flag.install()
    _deliver(SIG, until=lambda: flag.is_set)  # active: recorded, and SIG_IGN is not called
    ours = signal.getsignal(SIG)
    flag.restore()
    assert signal.getsignal(SIG) == signal.SIG_IGN
    flag.clear()
    signal.signal(SIG, ours)
    os.kill(os.getpid(), SIG)  # stale: ignored like SIG_IGN would, and SIG_IGN is back
    deadline = time.monotonic() + 5
    while signal.getsignal(SIG) != signal.SIG_IGN:
        assert time.monotonic() < deadline, "the stale handler never ran"
        time.sleep(0.001)
    assert not flag.is_set and flag.count == 0


_STALE_OVER_DEFAULT = textwrap.dedent(
    """
    import os, signal, sys
    from lightning_preempt.preemption.signals import SignalFlag

    flag = SignalFlag(["SIGUSR1"])
    flag.install()  # over SIG_DFL, whose action for SIGUSR1 is to terminate the process
    ours = signal.getsignal(signal.SIGUSR1)
    flag.restore()
    signal.signal(signal.SIGUSR1, ours)
    print("armed", flush=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(1000):  # the stale handler re-raises under SIG_DFL: we never get past this
        pass
    print("survived", flush=True)
    sys.exit(3)
    """
)


def test_a_stale_handler_over_the_default_action_ends_the_process_like_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _STALE_OVER_DEFAULT], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.stdout == "armed\n", proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGUSR1, proc.stderr  # killed by the signal, as SIG_DFL does


def test_off_the_main_thread_install_refuses_and_changes_nothing() -> None:
    user = UserHandler()
    signal.signal(SIG, user)
    flag = SignalFlag(["SIGUSR1"])
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(flag.install()))
    worker.start()
    worker.join(timeout=30)
    assert result == [False] and not flag.active
    assert signal.getsignal(SIG) is user


def test_signal_names_resolve_or_say_what_to_use() -> None:
    assert resolve_signal("SIGTERM") is signal.SIGTERM
    assert resolve_signal("term") is signal.SIGTERM
    assert resolve_signal(int(signal.SIGUSR1)) is signal.SIGUSR1
    assert resolve_signal(signal.SIGINT) is signal.SIGINT
    with pytest.raises(ValueError, match="HINT: use names such as 'SIGTERM'"):
        resolve_signal("SIGNOPE")
