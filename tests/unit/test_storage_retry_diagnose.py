"""The one retry loop (storage/retry.py) and the one error classification (storage/diagnose.py)."""

from __future__ import annotations

import pytest

from lightning_preempt.errors import CheckpointExistsError, CorruptCheckpointError, NotACheckpointError
from lightning_preempt.storage.diagnose import classify, describe, is_transient, redact, storage_hint
from lightning_preempt.storage.retry import Backoff, retry


class _Flaky:
    """Fails the first ``failures`` calls with ``error``."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self, attempt: int) -> str:
        self.calls += 1
        assert attempt == self.calls
        if self.calls <= self.failures:
            raise self.error
        return f"ok after {attempt}"


def test_backoff_doubles_and_reports_each_retry() -> None:
    slept: list[float] = []
    logged: list[tuple[str, int, float]] = []
    flaky = _Flaky(3, OSError("Input/output error"))
    got = retry(flaky, Backoff(4, 0.5, sleep=slept.append), on_retry=lambda e, a, d: logged.append((str(e), a, d)))
    assert got == "ok after 4" and slept == [0.5, 1.0, 2.0]
    assert logged == [("Input/output error", 1, 0.5), ("Input/output error", 2, 1.0), ("Input/output error", 3, 2.0)]


def test_retry_stops_at_the_last_attempt_a_permanent_error_or_a_deadline() -> None:
    slept: list[float] = []
    flaky = _Flaky(9, OSError("Input/output error"))
    with pytest.raises(OSError):
        retry(flaky, Backoff(3, 1.0, sleep=slept.append))
    assert flaky.calls == 3 and slept == [1.0, 2.0]

    flaky = _Flaky(9, PermissionError("denied"))
    with pytest.raises(PermissionError):
        retry(flaky, Backoff(3, 1.0, transient=is_transient, sleep=slept.append))
    assert flaky.calls == 1

    asked: list[float] = []
    flaky = _Flaky(9, OSError("Input/output error"))
    with pytest.raises(OSError):
        retry(flaky, Backoff(5, 1.0, give_up=lambda delay: asked.append(delay) or delay > 1.5, sleep=slept.append))
    assert flaky.calls == 2 and asked == [1.0, 2.0]


def test_the_decision_can_be_someone_elses_and_other_errors_pass_through() -> None:
    questions: list[bool] = []

    def rank0(question: object) -> bool:  # what agree.decide does for a group
        answer = question()  # type: ignore[operator]
        questions.append(answer)
        return False

    flaky = _Flaky(9, OSError("Input/output error"))
    with pytest.raises(OSError):
        retry(flaky, Backoff(3, sleep=lambda d: None), decide=rank0)
    assert flaky.calls == 1 and questions == [True]  # rank 0 would retry; its answer (no) wins

    flaky = _Flaky(9, KeyError("not considered"))
    with pytest.raises(KeyError):
        retry(flaky, Backoff(3, sleep=lambda d: None), retry_on=(OSError,))
    assert flaky.calls == 1


class NoCredentialsError(Exception):
    pass


class ClientConnectorError(Exception):
    pass


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (NoCredentialsError("Unable to locate credentials"), "credentials"),
        (OSError("Forbidden: 403 caller does not have storage.objects.create access"), "permission"),
        (PermissionError(13, "Permission denied"), "permission"),
        (OSError("NoSuchBucket: The specified bucket does not exist"), "no_bucket"),
        (ClientConnectorError("Cannot connect to host storage.googleapis.com"), "network"),
        (FileNotFoundError("run/step-1/manifest.json"), "not_found"),
        (ImportError("Install gcsfs to access Google Storage"), "missing_driver"),
        (ValueError("Protocol not known: nosuchprotocol"), "bad_protocol"),
        (CheckpointExistsError("manifest.json already exists"), "exists"),
        (CorruptCheckpointError("file fails its CRC32C check"), "damaged"),
        (NotACheckpointError("no committed checkpoint here"), "damaged"),
        (OSError(5, "Input/output error"), "unknown"),
    ],
)
def test_one_classification(error: BaseException, kind: str) -> None:
    assert classify(error) == kind
    assert is_transient(error) == (kind in ("network", "not_found", "unknown"))


def test_transient_looks_through_the_causes() -> None:
    try:
        try:
            raise NoCredentialsError("Unable to locate credentials")
        except NoCredentialsError as inner:
            raise OSError("upload failed") from inner
    except OSError as outer:
        assert classify(outer) == "unknown" and not is_transient(outer)
    assert not is_transient(KeyError("x"), permanent=(KeyError,))


def test_hints_follow_the_classification() -> None:
    assert "AWS_ACCESS_KEY_ID" in storage_hint("s3://b/r", NoCredentialsError("Unable to locate credentials"))
    network = storage_hint("gs://b/r", ClientConnectorError("Cannot connect to host storage.googleapis.com"))
    assert "cannot be reached" in network and "GOOGLE_APPLICATION_CREDENTIALS" in network
    assert "pip install s3fs" in storage_hint("s3://b/r", ImportError("Install s3fs"))
    assert "fsspec URL" in storage_hint("x://b/r", ValueError("Protocol not known: x"))
    assert storage_hint("/data/run", PermissionError(13, "denied")) == "Check the path and that this user may read it."


def test_describe_is_one_line_without_secrets() -> None:
    options = {"key": "AKIAXYZ", "secret": "s3cr3t", "endpoint_url": "http://h"}
    assert describe(OSError("bad key AKIAXYZ at http://h\nmore"), options) == "OSError: bad key *** at http://h"
    assert describe(CorruptCheckpointError("file 'x' is truncated", hint="delete it")) == "file 'x' is truncated"
    assert describe(RuntimeError()) == "RuntimeError"
    assert redact("secret s3cr3t", options) == "secret ***"
