"""The one retry loop (storage/retry.py) and the one error classification (storage/diagnose.py)."""

from __future__ import annotations

import socket
import traceback
from pathlib import Path

import chaos_fs
import google.auth.exceptions as google_auth
import pytest

from lightning_preempt.collective import agree
from lightning_preempt.errors import (
    CheckpointExistsError,
    CheckpointWriteError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from lightning_preempt.resume.resolver import ResumeResolver
from lightning_preempt.save.preflight import check_writable
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
        # DNS: "no such name" is an answer, "temporary failure" is a blip
        (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "no_host"),
        (ClientConnectorError("Cannot connect to host storage.googleapis.com:443 [Name or service not known]"), "no_host"),
        (socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"), "network"),
        # google.auth's own errors, whatever their text (a missing metadata server included)
        (google_auth.DefaultCredentialsError("Your default credentials were not found."), "credentials"),
        (google_auth.TransportError("Failed to retrieve http://metadata.google.internal/computeMetadata"), "credentials"),
        (google_auth.RefreshError("Compute Engine Metadata server unavailable"), "credentials"),
        (OSError("Anonymous caller does not have storage.objects.list access to the bucket."), "credentials"),
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
    assert "pip install 'lightning_preempt[s3]'" in storage_hint("s3://b/r", ImportError("Install s3fs"))
    assert "pip install 'lightning_preempt[gcs]'" in storage_hint("gs://b/r", ImportError("Install gcsfs"))
    assert "Did you mean https://" in storage_hint("htps://b/r", ValueError("Protocol not known: htps"))
    assert "s3, s3a" in storage_hint("x://b/r", ValueError("Protocol not known: x"))  # the known ones
    no_host = storage_hint("gs://b/r", socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert "does not resolve (DNS)" in no_host
    assert storage_hint("/data/run", PermissionError(13, "denied")) == "Check the path and that this user may read it."


def test_describe_is_one_line_without_secrets() -> None:
    options = {"key": "AKIAXYZ", "secret": "s3cr3t", "endpoint_url": "http://h"}
    assert describe(OSError("bad key AKIAXYZ at http://h\nmore"), options) == "OSError: bad key *** at http://h"
    assert describe(CorruptCheckpointError("file 'x' is truncated", hint="delete it")) == "file 'x' is truncated"
    assert describe(RuntimeError()) == "RuntimeError"
    assert redact("secret s3cr3t", options) == "secret ***"


# ---- who retries: only what a retry can fix (issue 20) ---------------------------------------
def test_the_resume_listing_is_not_retried_when_no_retry_can_help(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    resolver = ResumeResolver("nosuchproto://x", {}, retries=4, backoff_s=1.0, sleep=slept.append)
    peeked = resolver.peek()
    assert slept == [] and peeked.error is not None  # one attempt, no waiting
    assert "after 1 attempt(s)" in peeked.error.message and "Protocol not known" in peeked.error.message
    assert peeked.error.hint is not None and "known protocols:" in peeked.error.hint
    # a listing that may come back is still retried
    (tmp_path / "ck").mkdir()
    flaky = ResumeResolver(f"chaos://{tmp_path}/ck", {}, retries=3, backoff_s=0.5, sleep=slept.append)
    monkeypatch.setenv("LP_CHAOS_DIR", str(tmp_path / "ctl"))
    chaos_fs.set_fault(tmp_path / "ctl", "list", times=2)  # EIO twice: a retry can help
    assert flaky.peek().error is None and slept == [0.5, 1.0]


def test_an_agreed_error_of_ours_is_told_once_on_the_rank_where_it_happened(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointWriteError) as info:
        agree.agree(lambda: check_writable(str(afile)), None, what="probing the storage")
    text = "".join(traceback.format_exception(info.value))
    assert text.count("is a file, not a directory") == 1 and text.count("HINT:") == 1, text
    assert "check_writable" in text  # where it was raised is still in the traceback
    # a foreign error keeps its own traceback, chained
    with pytest.raises(agree.RankFailedError) as foreign:
        agree.agree(lambda: {}["missing"], None, what="looking up")
    assert isinstance(foreign.value.__cause__, KeyError)
