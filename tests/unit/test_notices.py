"""Cloud notice sources against fake metadata servers on 127.0.0.1 (real HTTP, real threads).

Each source runs its real request code against tests/fake_metadata.py; waits are bounded
polls of observable state (the server's request log, the source's fields), never sleeps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_metadata import AWS_ACTION, AWS_REBALANCE, AWS_TOKEN, AZURE_EVENTS, FakeMetadata, refused_url
from log_records import package_records

from lightning_preempt.preemption.notices import (
    AutoSource,
    AWSSpotSource,
    AzureSource,
    GCESource,
    NoopSource,
    make_sources,
)
from lightning_preempt.preemption.notices.base import MetadataSource
from lightning_preempt.preemption.sources import Notice, PreemptionSource


def wait_until(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"{what} not reached within {timeout}s")


@pytest.fixture
def fake() -> Iterator[FakeMetadata]:
    with FakeMetadata() as server:
        yield server


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """Every record of our package logger at INFO and above, whatever the logging set-up."""
    with package_records(logging.INFO) as got:
        yield got


@pytest.fixture
def started() -> Iterator[list[PreemptionSource]]:
    sources: list[PreemptionSource] = []
    yield sources
    for s in sources:
        s.stop()


def _start(started: list[PreemptionSource], source: Any) -> Any:
    started.append(source)
    source.start()
    return source


def _notice(source: PreemptionSource) -> Notice:
    return wait_until(source.poll, what=f"a notice from {source.name}")


# ---- names and the factory ---------------------------------------------------------------
def test_nothing_is_built_when_notices_are_off() -> None:
    assert make_sources(None) == [] and make_sources([]) == [] and make_sources("") == []


def test_factory_builds_one_source_per_name_on_local_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LP_NOTICES_AWS_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    sources = make_sources("aws, gce,azure", endpoints={"gce": "127.0.0.1:10"})
    assert [type(s) for s in sources] == [AWSSpotSource, GCESource, AzureSource]
    assert [s.endpoint for s in sources[:2]] == ["http://127.0.0.1:9", "http://127.0.0.1:10"]  # type: ignore[attr-defined]
    assert isinstance(make_sources(["auto"])[0], AutoSource)
    (only_interruption,) = make_sources(["aws-interruption"])
    assert isinstance(only_interruption, AWSSpotSource) and not only_interruption.rebalance
    for s in sources:
        assert isinstance(s, PreemptionSource)


def test_other_local_ranks_get_noop_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    sources = make_sources(["aws", "gce"])
    assert all(isinstance(s, NoopSource) for s in sources) and len(sources) == 2
    for s in sources:
        s.start()
        assert s.poll() is None
        s.stop()
    assert isinstance(make_sources(["aws"], local_rank=0)[0], AWSSpotSource)


@pytest.mark.parametrize(
    ("notices", "message"),
    [("aws,oracle", "unknown notice source 'oracle'"), (["auto", "gce"], "'auto' already probes"), ([3], "names")],
)
def test_bad_names_fail_with_a_hint(notices: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message) as info:
        make_sources(notices)
    assert "HINT:" in str(info.value)


# ---- AWS -----------------------------------------------------------------------------------
def test_aws_interruption_notice_carries_the_deadline(fake: FakeMetadata, started: list[PreemptionSource]) -> None:
    src = _start(started, AWSSpotSource(fake.url, interval_s=0.02))
    fake.wait_for(lambda: fake.count(AWS_ACTION) >= 3)
    assert src.poll() is None  # 404: nothing planned
    fake.announce_aws("terminate", in_s=120)
    notice = _notice(src)
    assert notice.source == "aws" and "terminate" in notice.reason
    assert notice.deadline is not None and 100 < notice.deadline - notice.received_at <= 121
    wait_until(lambda: not src.running, what="the watcher to end after a definite notice")
    token_puts = [h for m, p, h in fake.log if (m, p) == ("PUT", AWS_TOKEN)]
    gets = [h for m, p, h in fake.log if m == "GET"]
    assert len(token_puts) == 1 and token_puts[0]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    assert gets and all(h.get("x-aws-ec2-metadata-token") for h in gets)  # IMDSv2: every GET carries it


def test_aws_rebalance_is_advisory_until_the_interruption_comes(
    fake: FakeMetadata, started: list[PreemptionSource]
) -> None:
    src = _start(started, AWSSpotSource(fake.url, interval_s=0.02))
    fake.announce_aws_rebalance()
    advisory = _notice(src)
    assert advisory.deadline is None and "rebalance" in advisory.reason
    assert src.running  # keeps watching for the interruption itself
    fake.announce_aws("stop", in_s=90)
    definite = wait_until(lambda: src.poll() if src.poll().deadline is not None else None, what="the upgrade")
    assert "stop" in definite.reason and definite.deadline is not None


def test_aws_interruption_only_never_asks_for_rebalance(fake: FakeMetadata, started: list[PreemptionSource]) -> None:
    (src,) = make_sources(["aws-interruption"], endpoints={"aws": fake.url}, options={"aws": {"interval_s": 0.02}})
    _start(started, src)
    fake.announce_aws_rebalance()
    fake.wait_for(lambda: fake.count(AWS_ACTION) >= 5)
    assert src.poll() is None and fake.count(AWS_REBALANCE) == 0


def test_aws_expired_token_is_renewed(fake: FakeMetadata, started: list[PreemptionSource]) -> None:
    src = _start(started, AWSSpotSource(fake.url, interval_s=0.02))
    fake.wait_for(lambda: fake.count(AWS_ACTION) >= 2)
    fake.revoke_tokens()
    fake.wait_for(lambda: fake.count(AWS_TOKEN, "PUT") >= 2)
    fake.announce_aws()
    assert _notice(src).deadline is not None
    assert src.requests_failed == 0  # a 401 is handled, not a failure


# ---- GCE -----------------------------------------------------------------------------------
def test_gce_long_polls_and_sees_preemption_at_once(fake: FakeMetadata, started: list[PreemptionSource]) -> None:
    src = _start(started, GCESource(fake.url, interval_s=0.02, wait_s=30))
    fake.wait_for(lambda: fake.held >= 2)  # both keys: a long-poll held by the server
    waits = [p for m, p, h in fake.log if "wait_for_change=true" in p]
    assert waits and all("last_etag=" in p for p in waits)
    assert all(h.get("metadata-flavor") == "Google" for _, _, h in fake.log)
    assert src.poll() is None
    fake.announce_gce("preempted", "TRUE")
    notice = _notice(src)
    assert fake.released_by_change >= 1  # the held request answered the change
    assert notice.source == "gce" and notice.deadline is not None
    assert notice.deadline - notice.received_at == pytest.approx(30.0)


def test_gce_live_migration_is_not_a_notice_but_termination_is(
    fake: FakeMetadata, started: list[PreemptionSource]
) -> None:
    src = _start(started, GCESource(fake.url, interval_s=0.02, wait_s=30))
    fake.wait_for(lambda: fake.held >= 2)
    fake.announce_gce("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
    fake.wait_for(lambda: fake.released_by_change >= 1 and fake.held >= 2)  # seen, and watching again
    assert src.poll() is None
    fake.announce_gce("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
    notice = _notice(src)
    assert "TERMINATE_ON_HOST_MAINTENANCE" in notice.reason
    assert notice.deadline is not None and notice.deadline - notice.received_at == pytest.approx(60.0)


def test_gce_preempted_already_true_at_start(fake: FakeMetadata, started: list[PreemptionSource]) -> None:
    fake.announce_gce("preempted", "TRUE")
    src = _start(started, GCESource(fake.url, interval_s=0.02, maintenance=False))
    assert _notice(src).source == "gce"


# ---- Azure ---------------------------------------------------------------------------------
def test_azure_preempt_for_this_vm_only_and_acknowledged_on_stop(fake: FakeMetadata) -> None:
    src = AzureSource(fake.url, interval_s=0.02, acknowledge=True)
    src.start()
    try:
        fake.announce_azure("Preempt", in_s=30, resources=["another-vm"])
        fake.announce_azure("Freeze", in_s=30)
        seen = fake.count(AZURE_EVENTS)
        fake.wait_for(lambda: fake.count(AZURE_EVENTS) >= seen + 3)
        assert src.poll() is None  # another VM's eviction; a freeze is no reclaim
        event_id = fake.announce_azure("Preempt", in_s=30)
        notice = _notice(src)
        assert notice.source == "azure" and event_id in notice.reason
        assert notice.deadline is not None and 25 < notice.deadline - notice.received_at <= 31
        assert all(h.get("metadata") == "true" for _, _, h in fake.log)
        assert any("api-version=2020-07-01" in p for _, p, _ in fake.log)
    finally:
        src.stop()
    assert fake.acks == [{"StartRequests": [{"EventId": event_id}]}]


def test_azure_does_not_acknowledge_by_default(fake: FakeMetadata, started: list[PreemptionSource]) -> None:
    src = _start(started, AzureSource(fake.url, interval_s=0.02))
    fake.announce_azure("Preempt", in_s=0, status="Started")
    notice = _notice(src)
    assert notice.deadline is not None and notice.deadline <= time.monotonic()
    src.stop()
    assert fake.acks == []


# ---- a server that misbehaves never disturbs the caller -----------------------------------
def _src(kind: str, url: str) -> MetadataSource:
    cls = {"aws": AWSSpotSource, "gce": GCESource, "azure": AzureSource}[kind]
    source = cls(url, interval_s=0.01, timeout_s=0.5)
    source.max_backoff_s = 0.05  # keep the test short; the backoff itself is checked below
    return source


def _announce(fake: FakeMetadata, kind: str) -> None:
    {"aws": fake.announce_aws, "gce": fake.announce_gce, "azure": fake.announce_azure}[kind]()


@pytest.mark.parametrize("kind", ["aws", "gce", "azure"])
@pytest.mark.parametrize("mode", ["garbage", "junk", "error", "vanish"])
def test_a_failing_server_warns_once_backs_off_and_recovers(
    kind: str, mode: str, records: list[logging.LogRecord], started: list[PreemptionSource]
) -> None:
    fake = FakeMetadata().start()
    try:
        port = fake.port
        if mode == "vanish":
            fake.stop()
        else:
            fake.set_mode(mode)
        src = _start(started, _src(kind, f"http://127.0.0.1:{port}"))
        wait_until(lambda: src.failures >= 4, what="four failures")
        assert src.poll() is None
        warnings = [r for r in records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "training is not affected" in warnings[0].getMessage()
        assert "HINT:" in warnings[0].getMessage()
        if mode == "vanish":
            fake = FakeMetadata().start(port)  # it comes back
        else:
            fake.set_mode("ok")
        _announce(fake, kind)
        assert _notice(src).source == kind
        assert any("answers again" in r.getMessage() for r in records)
        assert len([r for r in records if r.levelno == logging.WARNING and "failed" in r.getMessage()]) == 1
    finally:
        fake.stop()


def test_backoff_doubles_up_to_the_cap() -> None:
    src = AWSSpotSource("http://127.0.0.1:9", interval_s=1.0)
    assert [src.backoff_s(n) for n in (1, 2, 3, 5, 6, 100)] == [2.0, 4.0, 8.0, 32.0, 60.0, 60.0]


def test_a_slow_server_holds_only_the_watcher_thread(fake: FakeMetadata, started: list[PreemptionSource]) -> None:
    fake.set_mode("slow")
    src = _start(started, AWSSpotSource(fake.url, interval_s=0.02, timeout_s=30))
    fake.wait_for(lambda: fake.held >= 1)  # the watcher is stuck in a request
    assert src.poll() is None  # returns: it only reads a field
    src.stop()  # returns too: it does not join a thread stuck in a request
    assert src.running  # (still stuck: a daemon thread; it ends once the request does)
    fake.release()
    wait_until(lambda: not src.running, what="the watcher to end after stop")


# ---- auto ----------------------------------------------------------------------------------
def test_auto_probes_in_the_background_and_watches_what_answers(started: list[PreemptionSource]) -> None:
    dead, sock = refused_url()
    with FakeMetadata(("aws",)) as aws, FakeMetadata(()) as slow:
        slow.set_mode("slow")
        auto = _start(
            started,
            AutoSource({"aws": aws.url, "gce": slow.url, "azure": dead}, options={"aws": {"interval_s": 0.02}}),
        )
        slow.wait_for(lambda: slow.held >= 1)
        assert not auto.probed.is_set() and auto.poll() is None  # start() did not wait for the probes
        slow.release()  # answers 404: not GCE
        wait_until(auto.probed.is_set, what="the probes")
        assert [s.name for s in auto.found] == ["aws"]
        aws.announce_aws()
        assert _notice(auto).source == "aws"
    sock.close()


def test_auto_with_no_metadata_server_polls_nothing(
    records: list[logging.LogRecord], started: list[PreemptionSource]
) -> None:
    dead, sock = refused_url()
    auto = _start(started, AutoSource(dict.fromkeys(("aws", "gce", "azure"), dead)))
    wait_until(auto.probed.is_set, what="the probes")
    assert auto.found == [] and auto.poll() is None
    assert any("no metadata server answered" in r.getMessage() for r in records)
    assert not [r for r in records if r.levelno >= logging.WARNING]
    # no poller was started for any cloud (other tests' writer threads may still be alive)
    pollers = ("lightning_preempt-aws", "lightning_preempt-gce", "lightning_preempt-azure")
    assert not [t for t in threading.enumerate() if t.name.startswith(pollers) and t.is_alive()]
    sock.close()


def test_sources_pickle_without_their_threads(fake: FakeMetadata, started: list[PreemptionSource]) -> None:
    import pickle

    src = _start(started, AWSSpotSource(fake.url, interval_s=0.02))
    auto = AutoSource({"aws": fake.url})
    copy = pickle.loads(pickle.dumps(src))
    auto_copy = pickle.loads(pickle.dumps(auto))
    _start(started, copy)
    fake.announce_aws()
    assert _notice(copy).source == "aws" and auto_copy.found == []
