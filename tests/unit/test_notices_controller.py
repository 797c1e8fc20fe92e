"""How the controller acts on a cloud notice: ``on_notice`` "continue" vs "exit", the
deadline it plans with, an advisory notice made definite; and the callback's options
as LightningCLI reads them (plain types)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from lightning_preempt import Tuning
from lightning_preempt.engine.config import PreemptionConfig
from lightning_preempt.preemption.controller import PreemptionController
from lightning_preempt.preemption.sources import Notice


class SettableSource:
    """A real (if trivial) ``PreemptionSource``: the test sets what it announces."""

    name = "cloud"

    def __init__(self) -> None:
        self.notice: Notice | None = None

    def start(self) -> None:
        pass

    def poll(self) -> Notice | None:
        return self.notice

    def stop(self) -> None:
        pass

    def announce(self, reason: str = "reclaim", in_s: float | None = 120.0) -> Notice:
        now = time.monotonic()
        self.notice = Notice("cloud", reason, now, None if in_s is None else now + in_s)
        return self.notice


@pytest.fixture
def source() -> SettableSource:
    return SettableSource()


def _controller(source: SettableSource, on_notice: str) -> Iterator[PreemptionController]:
    config = PreemptionConfig(dirpath="unused", overlap_agreement=False, agree_every_n_steps=1, grace_period_s=30.0)
    ctl = PreemptionController(config, [source], on_notice=on_notice)
    ctl.bind(None)  # one process: the agreement is the identity
    ctl.start()  # installs the SIGTERM handler (a flag)
    try:
        yield ctl
    finally:
        ctl.stop()


@pytest.fixture
def cont(source: SettableSource) -> Iterator[PreemptionController]:
    yield from _controller(source, "continue")


@pytest.fixture
def exits(source: SettableSource) -> Iterator[PreemptionController]:
    yield from _controller(source, "exit")


def _boundary(ctl: PreemptionController):  # type: ignore[no-untyped-def]
    return ctl.at_boundary(time.monotonic(), save_due=False, stop=False)


def test_continue_snapshots_once_then_the_signal_preempts(cont: PreemptionController, source: SettableSource) -> None:
    assert not _boundary(cont).save_due
    notice = source.announce(in_s=120)
    first = _boundary(cont)
    assert first.save_due and first.notice_snapshot and not first.preempt
    again = _boundary(cont)
    assert not again.save_due and not again.preempt  # once: training goes on
    assert cont.deadline() == notice.deadline  # planning counts down to the notice's deadline
    os.kill(os.getpid(), signal.SIGTERM)  # a real signal: our handler sets the flag
    last = _boundary(cont)
    assert last.preempt
    sent = cont.signal_flag.received_at
    assert sent is not None and cont.deadline() == pytest.approx(sent + 30.0)  # now the signal's grace
    assert any("SIGTERM after the cloud notice" in event for event, _ in cont.timeline)


def test_exit_preempts_at_the_next_boundary(exits: PreemptionController, source: SettableSource) -> None:
    notice = source.announce(in_s=90)
    decision = _boundary(exits)
    assert decision.preempt and not decision.notice_snapshot
    assert exits.deadline() == notice.deadline
    assert exits.now().preempt  # the synchronous agreement (validation) sees it too


def test_a_notice_deadline_earlier_than_the_signal_grace_wins(
    cont: PreemptionController, source: SettableSource
) -> None:
    notice = source.announce(in_s=10)
    _boundary(cont)
    os.kill(os.getpid(), signal.SIGTERM)
    assert _boundary(cont).preempt
    assert cont.deadline() == notice.deadline  # 10 s left beats the 30 s grace


def test_an_advisory_notice_made_definite_snapshots_again(cont: PreemptionController, source: SettableSource) -> None:
    source.announce("rebalance recommendation", in_s=None)
    assert _boundary(cont).notice_snapshot
    assert not _boundary(cont).save_due
    definite = source.announce("instance-action", in_s=120)
    assert _boundary(cont).notice_snapshot  # the interruption itself: snapshot again
    assert cont.notice == definite and cont.deadline() == definite.deadline


def test_callback_options_are_plain_types_for_lightningcli(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from jsonargparse import ArgumentParser

    from lightning_preempt import PreemptionCallback

    parser = ArgumentParser()
    parser.add_class_arguments(PreemptionCallback, "cb")
    for yaml, names, mode in (
        (f"cb:\n  dirpath: {tmp_path}\n  notices: [aws, gce]\n  tuning:\n    on_notice: exit\n", ["aws", "gce"], "exit"),
        (f"cb:\n  dirpath: {tmp_path}\n  notices: auto\n", ["auto"], "continue"),
        (f"cb:\n  dirpath: {tmp_path}\n", [], "continue"),
    ):
        cfg = parser.parse_string(yaml)
        cb = parser.instantiate_classes(cfg).cb
        assert list(cb.config.notices) == names and cb.engine.controller.on_notice == mode
    with pytest.raises(ValueError, match="HINT"):
        PreemptionCallback(str(tmp_path), notices=["azure"], tuning=Tuning(on_notice="later"))  # type: ignore[arg-type]
