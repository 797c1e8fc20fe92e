"""The storage errors a new user meets first (issue 20, finding 8), as a user meets them: a real
training job (or the CLI) in its own process, on a cloud URL without credentials or network,
on a path that is a file. Each fails once, before step 1, with one error that says what to set.

This machine has no credentials for any cloud; the environment of each job is cleaned of
whatever could provide some (or an emulator), so the failure is the real one a user meets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import launch, step_of

pytestmark = pytest.mark.multiproc

_CLOUD_ENV = (
    "GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "CLOUDSDK_CONFIG", "GOOGLE_CLOUD_PROJECT",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
)  # fmt: skip


def _no_credentials_env(tmp: Path) -> dict[str, str]:
    """Our environment without any cloud credentials: an empty home (no gcloud or AWS files),
    metadata servers that refuse at once (no cloud VM answers)."""
    env = {k: v for k, v in os.environ.items() if k not in _CLOUD_ENV}
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    env.update(
        HOME=str(home),
        GCE_METADATA_HOST="127.0.0.1:9",  # google-auth's metadata probe: refused, not 15 s of retries
        GCE_METADATA_IP="127.0.0.1:9",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE=str(home / "none"),
        AWS_CONFIG_FILE=str(home / "none"),
    )
    return env


def _our_hints(out: str) -> list[str]:
    """Our HINT lines (each error's last line). Lightning's own warnings may carry an inline
    "HINT:" too (where `srun` is installed: "The `srun` command is available … HINT: …")."""
    return [line for line in out.splitlines() if line.startswith("HINT:")]


def _train(tmp: Path, dirpath: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    status = tmp / "st"
    args = ["--dirpath", dirpath, "--status", str(status), "--max-steps", "4", "--every", "2"]
    proc = launch("train_script.py", tmp, *args, env=env)
    out, _ = proc.communicate(timeout=600)
    assert step_of(status, 0) is None, out[-3000:]  # not a single step trained
    return proc.returncode, out


@pytest.mark.parametrize(
    ("url", "hint"),
    [("gs://lp-no-such-bucket-h5/run", "GOOGLE_APPLICATION_CREDENTIALS"), ("s3://lp-no-such-bucket-h5/run", "AWS_PROFILE")],
)
def test_a_cloud_dirpath_without_credentials_fails_once_before_step_1(tmp_path: Path, url: str, hint: str) -> None:
    code, out = _train(tmp_path, url, _no_credentials_env(tmp_path))
    assert code not in (0, None), out[-3000:]
    # one error, tried once (a retry cannot bring credentials), saying what to set
    assert out.count("Traceback") == 1, out[-6000:]
    assert "after 1 attempt(s)" in out and "retrying in" not in out, out[-3000:]
    hints = _our_hints(out)
    assert len(hints) == 1 and hint in hints[0], out[-3000:]
    assert "_request" not in out  # gcsfs never started its own retries


def test_a_dirpath_that_is_a_file_is_named_once_and_left_alone(tmp_path: Path) -> None:
    afile = tmp_path / "results.csv"
    afile.write_text("epoch,loss\n")
    code, out = _train(tmp_path, str(afile))
    assert code not in (0, None), out[-3000:]
    assert out.count(f"{afile} is a file, not a directory") == 1, out[-6000:]
    assert out.count("Traceback") == 1 and len(_our_hints(out)) == 1, out[-6000:]
    assert "probe_storage=False" not in out  # skipping the probe would not help
    assert afile.read_text() == "epoch,loss\n"


def _cli(tmp: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightning_preempt.cli", *args], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_cli_on_gs_without_credentials_names_them_at_once(tmp_path: Path) -> None:
    done = _cli(tmp_path, "ls", "gs://lp-no-such-bucket-h5/run", env=_no_credentials_env(tmp_path))
    assert done.returncode == 1, done.stderr
    assert "no usable Google Cloud credentials" in done.stderr and "GOOGLE_APPLICATION_CREDENTIALS" in done.stderr
    assert done.stderr.count("error:") == 1


_CONSTRUCT = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # as if the extra were not installed: importing it raises ImportError
from lightning_preempt import PreemptionCallback
out = {{}}
for url in {urls!r}:
    try:
        PreemptionCallback(url, every_n_train_steps=5)
        out[url] = "constructed"
    except Exception as err:
        out[url] = type(err).__name__ + ": " + str(err)
print("RESULT " + json.dumps(out))
"""


def test_a_missing_driver_or_an_unknown_protocol_fails_at_construction(tmp_path: Path) -> None:
    urls = ["gs://bucket/run", "s3://bucket/run", "htps://bucket/run", "nosuchproto://x"]
    code = "import json\n" + _CONSTRUCT.format(blocked=["gcsfs", "s3fs"], urls=urls)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT ") :])
    assert got["gs://bucket/run"].startswith("ImportError: dirpath 'gs://bucket/run' needs the fsspec driver for gs://")
    assert "HINT: pip install 'lightning_preempt[gcs]'" in got["gs://bucket/run"]
    assert "HINT: pip install 'lightning_preempt[s3]'" in got["s3://bucket/run"]
    assert got["htps://bucket/run"].startswith("ValueError: dirpath 'htps://bucket/run': unknown protocol 'htps'")
    assert "Did you mean https://" in got["htps://bucket/run"] and "gs, " in got["htps://bucket/run"]
    assert "unknown protocol 'nosuchproto'" in got["nosuchproto://x"]
