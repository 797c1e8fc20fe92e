"""When ranks agree (preemption/schedule.py on collective/groups.py), in one process: without
a process group the schedule degrades to local decisions. The same schedule across 2 real
gloo ranks: tests/multiproc/test_agreement_multirank.py."""

from __future__ import annotations

import pickle

import pytest

from lightning_preempt.collective.groups import FlagAgreement
from lightning_preempt.preemption.schedule import CALIBRATION_STEPS, AgreementSchedule


def _run(schedule: AgreementSchedule, boundaries: int, signalled_from: int, step_s: float = 0.01) -> list[bool]:
    """``at_boundary`` at boundaries 1..n, the signal raised at ``signalled_from`` and kept
    (as SignalFlag keeps it): whether the schedule said "preempt" at each."""
    return [
        schedule.at_boundary(b * step_s, signalled=b >= signalled_from, time_due=False)[0]
        for b in range(1, boundaries + 1)
    ]


def test_every_k_boundaries_a_signal_raised_between_them_is_acted_on_at_the_next() -> None:
    schedule = AgreementSchedule(3, interval_s=1.0, overlap=False)
    schedule.bind(None)
    said = _run(schedule, 9, signalled_from=4)
    assert [b for b, yes in enumerate(said, 1) if yes] == [6, 9]  # not at 4 or 5: no agreement there


def test_auto_without_a_group_agrees_every_step_and_never_calibrates() -> None:
    schedule = AgreementSchedule("auto", interval_s=1.0, overlap=False)
    schedule.bind(None)
    said = _run(schedule, CALIBRATION_STEPS + 10, signalled_from=CALIBRATION_STEPS + 5)
    assert schedule.k == 1  # nothing to amortise without a collective
    assert said.index(True) + 1 == CALIBRATION_STEPS + 5 and all(said[CALIBRATION_STEPS + 4 :])


def test_overlap_without_a_group_acts_at_the_same_boundary() -> None:
    schedule = AgreementSchedule(1, interval_s=1.0, overlap=True)
    schedule.bind(None)
    assert [schedule.at_boundary(b, signalled=b == 3, time_due=b == 4, stop=b == 5) for b in range(1, 6)] == [
        (False, False, False),
        (False, False, False),
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ]
    schedule.flush()  # nothing pending: a no-op


def test_agreeing_now_is_the_local_answer_without_a_group() -> None:
    unbound = AgreementSchedule(2, interval_s=1.0, overlap=False)
    assert unbound.now(signalled=True) == (True, False) and unbound.now(signalled=False, stop=True) == (False, True)
    unbound.bind(None)
    assert unbound.now(signalled=True, stop=True) == (True, True)


def test_a_copy_is_unbound_and_keeps_its_schedule() -> None:
    schedule = AgreementSchedule(7, interval_s=2.0, overlap=True)
    schedule.bind(None)
    copy = pickle.loads(pickle.dumps(schedule))  # ddp_spawn: the group belongs to one fit
    assert schedule.bound and not copy.bound
    assert (copy.k, copy.auto, copy.interval_s, copy.overlap) == (7, False, 2.0, True)


@pytest.mark.parametrize("every", [0, -3, 1.5, "sometimes"])
def test_a_bad_schedule_says_what_to_use(every: object) -> None:
    with pytest.raises(ValueError, match=r"positive int or 'auto'.*\nHINT:"):
        AgreementSchedule(every, interval_s=1.0, overlap=False)  # type: ignore[arg-type]


def test_flag_agreement_without_a_group_is_the_local_flags() -> None:
    flags = FlagAgreement(None, width=3)
    assert not flags.active
    assert flags.exchange([1, 0, 2]) == [1, 0, 2]
    assert flags.exchange([0, 1, 0], overlap=True) == [0, 1, 0]  # nothing to overlap with
    assert flags.flush() == [0, 0, 0] and flags.exchange_now([0, 0, 1]) == [0, 0, 1]


class _OneRank(FlagAgreement):
    """A group of one that counts as active: what each rank sees of a MAX over equal flags."""

    def __init__(self) -> None:
        super().__init__(None, width=4)
        self.exchanges = 0

    @property
    def active(self) -> bool:
        return True

    def exchange(self, flags: list[int], overlap: bool = False) -> list[int]:
        self.exchanges += 1
        return [int(v) for v in flags]


def test_the_default_auto_schedule_agrees_about_once_a_second() -> None:
    # An exchange's launch costs 1-5 ms on a busy 2-core CPU (issue 33): at the former 0.25 s
    # (k=8 for a 30 ms step) that was ~2% of every step; the default now waits ~1 s.
    from lightning_preempt.engine.config import PreemptionConfig

    config = PreemptionConfig(dirpath="memory://agree-default")
    schedule = AgreementSchedule(config.agree_every_n_steps, config.agree_interval_s, config.overlap_agreement)
    schedule._flags = flags = _OneRank()
    step_s = 0.03
    said = _run(schedule, CALIBRATION_STEPS + 200, signalled_from=CALIBRATION_STEPS + 50, step_s=step_s)
    assert schedule.k == int(1.0 / step_s) == 33
    assert flags.exchanges == CALIBRATION_STEPS + 200 // 33  # calibration, then one exchange a second
    first = said.index(True) + 1  # acted on at the next agreement: within ~1 s + one step
    assert 0 <= (first - (CALIBRATION_STEPS + 50)) * step_s <= 1.0 + step_s
