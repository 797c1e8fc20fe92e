"""When ranks agree (preemption/schedule.py on collective/groups.py), in one process: without
a process group the schedule degrades to local decisions. The same schedule across 2 real
gloo ranks: tests/multiproc/test_agreement_multirank.py."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterator

import pytest

from lightning_preempt.collective.groups import FlagAgreement
from lightning_preempt.preemption.schedule import CALIBRATION_STEPS, MAX_K, AgreementSchedule, auto_k


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
    """A group of one that counts as active: what each rank sees of a MAX over equal flags.
    An overlapped launch is read at the next :meth:`flush`, as over a real group."""

    def __init__(self) -> None:
        super().__init__(None, width=5)
        self.exchanges = 0
        self._launched: list[int] | None = None

    @property
    def active(self) -> bool:
        return True

    @property
    def pending(self) -> bool:
        return self._launched is not None

    def launch(self, flags: list[int]) -> None:
        assert self._launched is None
        self.exchanges += 1
        self._launched = [int(v) for v in flags]

    def flush(self) -> list[int]:
        launched, self._launched = self._launched, None
        return launched if launched is not None else [0] * self.width

    def exchange_now(self, flags: list[int]) -> list[int]:
        self.exchanges += 1
        return [max(a, int(b)) for a, b in zip(self.flush(), flags, strict=True)]


def _ticks(cost_s: float) -> Callable[[], float]:
    """A clock that advances ``cost_s`` per reading: every exchange the schedule times costs that."""
    counter = itertools.count()
    return lambda: next(counter) * cost_s


@pytest.mark.parametrize(
    ("step_s", "cost_s", "interval_s", "overlap", "k"),
    [
        (0.5, 0.001, 0.3, True, 1),  # 0.2% of a step: every step
        (0.05, 0.0001, 0.3, True, 1),  # 0.2%
        (0.05, 0.001, 0.3, True, 4),  # 2%: every 4th step, 0.5% of each
        (0.05, 0.01, 0.3, True, 5),  # 20%: as wide as a 0.3 s wait allows (5 + 1 steps)
        (0.05, 0.01, 0.3, False, 6),  # read at once: 6 steps
        (0.005, 1.0, 10.0, False, 1000),  # never wider than MAX_K
        (1.0, 1.0, 0.3, True, 1),  # steps longer than the wait: every step, whatever it costs
    ],
)
def test_auto_takes_the_cheapest_cadence_the_latency_bound_allows(
    step_s: float, cost_s: float, interval_s: float, overlap: bool, k: int
) -> None:
    assert auto_k(step_s, cost_s, interval_s, overlap) == k
    # the bound the docs state: a signal waits k + overlap steps, within max(1 + overlap steps, interval_s)
    assert k + overlap <= max(1 + overlap, round(interval_s / step_s)) or k == MAX_K


@pytest.mark.parametrize(("step_s", "cost_s", "k"), [(0.05, 0.002, 5), (0.05, 0.0005, 2), (0.5, 0.002, 1)])
def test_at_a_settled_cadence_a_signal_just_after_an_exchange_waits_k_plus_one_steps(
    step_s: float, cost_s: float, k: int
) -> None:
    # overlapped: the exchange launched at a boundary is read at the next one, not one exchange
    # later (issue 58: up to 2k steps, 1.1-1.9 s at k=7)
    from lightning_preempt.engine.config import PreemptionConfig
    from lightning_preempt.preemption.controller import AGREE_INTERVAL_S

    config = PreemptionConfig(dirpath="memory://agree-default")
    schedule = AgreementSchedule(config.agree_every_n_steps, AGREE_INTERVAL_S, config.overlap_agreement,
                                 clock=_ticks(cost_s))  # fmt: skip
    schedule._flags = flags = _OneRank()
    settled = CALIBRATION_STEPS + 3 * k
    arrives = settled + (k - settled % k) + 1  # seen at the boundary just after a launch
    said = _run(schedule, arrives + 3 * k, signalled_from=arrives, step_s=step_s)
    assert schedule.k == k and schedule.latency_steps == k + 1
    # every boundary while calibrating, then every k-th: one exchange per k steps
    assert flags.exchanges == CALIBRATION_STEPS + len(said) // k - CALIBRATION_STEPS // k
    acted = said.index(True) + 1
    assert schedule.signal_steps == acted - (arrives - 1)  # what the ledger records (issue 58)
    # the signal arrived during step `arrives` (after step arrives - 1 ended)
    assert acted - (arrives - 1) == k + 1 <= max(2, round(AGREE_INTERVAL_S / step_s))
    assert (acted - (arrives - 1)) * step_s <= max(2 * step_s, AGREE_INTERVAL_S) + 1e-9


def test_auto_counts_an_exchanges_spikes_but_not_the_groups_warm_up() -> None:
    # the budget is a share of every step: one 20 ms launch among 0.1 ms ones (issue 33's spikes)
    # costs 1.3 ms an exchange on average, 2.5% of a 0.05 s step; the median (0.1 ms) would say 0.2%
    costs = [0.05, 0.05] + [0.0001] * 8 + [0.02] + [0.0001] * 8 + [0.0001]  # boundaries 1..20

    def readings() -> Iterator[float]:
        t = 0.0
        for cost in costs:  # the schedule reads the clock before and after each exchange
            yield t
            t += cost
            yield t
        while True:
            yield t

    ticks = readings()
    schedule = AgreementSchedule("auto", interval_s=0.3, overlap=True, clock=lambda: next(ticks))
    schedule._flags = _OneRank()
    _run(schedule, CALIBRATION_STEPS + 2, signalled_from=10**6, step_s=0.05)
    assert schedule.k == 5  # ceil(1.3 ms / 0.25 ms) = 6, capped by the 0.3 s wait (5 + 1 steps)
    assert auto_k(0.05, 0.0001, 0.3, True) == 1  # what the median would have chosen
