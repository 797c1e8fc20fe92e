"""Real training processes warned by a fake cloud metadata server (tests/fake_metadata.py).

The server announces a reclaim at a chosen moment (a step the job reached); the checks:
the notice's snapshot commits before any SIGTERM, training goes on (``on_notice="continue"``)
or exits at once (``"exit"``), the exit code, the timeline in the log, 0 steps lost after a
restart; and a metadata server that answers garbage, hangs, then vanishes never disturbs
training.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from ckpts import committed
from fake_metadata import FakeMetadata
from jobs import launch, read, step_of, wait_for

from lightning_preempt.preemption.sources import MAX_NOTICE_HORIZON_S

pytestmark = pytest.mark.multiproc


def _env(**endpoints: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LP_NOTICES_")}
    env["LP_NOTICES_INTERVAL_S"] = "0.05"
    for cloud, url in endpoints.items():
        env[f"LP_NOTICES_{cloud.upper()}_ENDPOINT"] = url
    return env


def _launch(tmp: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    args = ["--dirpath", str(tmp / "ck"), "--status", str(tmp / "st"), *extra]
    return launch("notices_script.py", tmp, *args, env=env)


def _step(tmp: Path, rank: int = 0) -> int:
    return step_of(tmp / "st", rank) or 0


def _in_order(out: str, *needles: str) -> None:
    at = -1
    for needle in needles:
        found = out.find(needle, at + 1)
        assert found > at, f"{needle!r} missing or out of order in the log:\n{out[-4000:]}"
        at = found


def _resume(tmp: Path, env: dict[str, str], at: int, devices: int = 1) -> None:
    for f in (tmp / "st").glob("*"):
        f.unlink()
    extra = ["--devices", str(devices)] if devices > 1 else []
    again = _launch(tmp, env, "--max-steps", str(at + 3), *extra)
    out, _ = again.communicate(timeout=180)
    assert again.returncode == 0, out[-4000:]
    for r in range(devices):
        result = read(tmp / "st" / f"rank{r}.result.json") or ""
        assert f'"start_step": {at},' in result and f'"step": {at + 3},' in result, result  # 0 steps lost


def test_aws_notice_snapshots_before_sigterm_and_training_goes_on(tmp_path: Path) -> None:
    with FakeMetadata(("aws",)) as fake:
        env = _env(aws=fake.url)
        proc = _launch(tmp_path, env, "--notices", "aws", "--on-notice", "continue")
        wait_for(proc, "step 15", lambda: _step(tmp_path) >= 15)
        announced = _step(tmp_path)
        fake.announce_aws("terminate", in_s=120)
        (snap,) = wait_for(proc, "the notice's snapshot", lambda: sorted(committed(tmp_path / "ck")))  # every=1000: no other save
        assert snap >= announced
        wait_for(proc, "training past the snapshot", lambda: _step(tmp_path) >= snap + 5)
        signalled = _step(tmp_path)
        os.kill(int(read(tmp_path / "st" / "rank0.pid") or 0), signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 143, out[-4000:]
        final = sorted(committed(tmp_path / "ck"))
        assert final[0] == snap and final[-1] >= signalled and len(final) == 2, final
        _in_order(
            out,
            "[notice] aws: spot instance-action 'terminate'",
            f"aws notice: snapshot of step {snap} staged; training goes on",
            f"committed step {snap} (the aws notice's snapshot)",
            "SIGTERM after the aws notice",
            f"ranks agreed to preempt at step {final[-1]}",
            f"committed step {final[-1]}",
            "exiting with code 143",
        )
        lines = out.splitlines()
        noticed = next(line for line in lines if "aws notice: snapshot of step" in line)
        assert "s before the aws deadline" in noticed, noticed  # counts down to the notice's deadline
        exit_line = next(line for line in lines if "exiting with code 143" in line)
        assert "s before the signal's grace period ends" in exit_line, exit_line  # after SIGTERM: its grace
        polled = sum(fake.requests.values())
        _resume(tmp_path, env, final[-1])  # notices off in the rerun
        assert sum(fake.requests.values()) == polled  # nothing is polled when notices are off


def test_gce_notice_exits_at_once_on_every_rank(tmp_path: Path) -> None:
    with FakeMetadata(("gce",)) as fake:
        env = _env(gce=fake.url)
        proc = _launch(tmp_path, env, "--notices", "gce", "--on-notice", "exit", "--devices", "2")
        wait_for(proc, "step 15 on both ranks", lambda: min(_step(tmp_path, 0), _step(tmp_path, 1)) >= 15)
        fake.wait_for(lambda: fake.held >= 2)  # preempted + maintenance-event, long-polled
        announced = max(_step(tmp_path, 0), _step(tmp_path, 1))
        fake.announce_gce("preempted", "TRUE")
        out, _ = proc.communicate(timeout=90)  # no signal is sent: the notice alone ends the job
        assert proc.returncode == 143, out[-4000:]
        assert [read(tmp_path / "st" / f"rank{r}.exit") for r in (0, 1)] == ["143", "143"]
        assert fake.peak_held == 2  # only local rank 0 watched; rank 1 learnt it through the agreement
        (agreed,) = sorted(committed(tmp_path / "ck"))
        assert agreed >= announced
        _in_order(
            out,
            "[notice] gce: instance/preempted is TRUE",
            f"ranks agreed to preempt at step {agreed}",
            f"committed step {agreed}",
            "exiting with code 143",
        )
        exits = [line for line in out.splitlines() if "exiting with code 143" in line]
        assert len(exits) == 2 and any("before the gce deadline" in line for line in exits), exits  # rank 0's
        _resume(tmp_path, env, agreed)  # (on one rank: resuming at another world size is supported)


def test_azure_notice_drains_two_tiers_within_the_notices_deadline(tmp_path: Path) -> None:
    with FakeMetadata(("azure",)) as fake:
        env = _env(azure=fake.url)
        local = str(tmp_path / "local")
        proc = _launch(tmp_path, env, "--notices", "azure", "--on-notice", "exit", "--local-dirpath", local)
        wait_for(proc, "step 10", lambda: _step(tmp_path) >= 10)
        fake.announce_azure("Preempt", in_s=100)  # longer than the 30 s grace period
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 143, out[-4000:]
    (agreed,) = sorted(committed(tmp_path / "ck"))  # drained to dirpath (the remote tier) before the exit
    drain = next(line for line in out.splitlines() if f"draining step {agreed} to" in line)
    budget = float(drain.split("for at most ")[1].split("s")[0])
    assert 30.0 < budget < 100.0, drain  # the notice's deadline, not grace_period_s, bounds the drain
    _in_order(
        out, "[notice] azure: scheduled event Preempt", f"draining step {agreed}", "drained", "exiting with code 143"
    )


def test_a_notice_for_the_year_9999_drains_within_the_clamped_horizon(tmp_path: Path) -> None:
    """A deadline past ``threading.TIMEOUT_MAX`` made the drain's wait overflow: it was
    cancelled at once, the remote tier never got the snapshot. Clamped, the drain runs."""
    with FakeMetadata(("azure",)) as fake:
        env = _env(azure=fake.url)
        local = str(tmp_path / "local")
        proc = _launch(tmp_path, env, "--notices", "azure", "--on-notice", "exit", "--local-dirpath", local)
        wait_for(proc, "step 10", lambda: _step(tmp_path) >= 10)
        fake.announce_azure("Preempt", in_s=253402300799 - time.time())  # NotBefore: 31 Dec 9999
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 143, out[-4000:]
    assert "Dec 9999" in out, out[-4000:]
    (agreed,) = sorted(committed(tmp_path / "ck"))  # the remote tier has it: the drain was not cancelled
    drain = next(line for line in out.splitlines() if f"draining step {agreed} to" in line)
    budget = float(drain.split("for at most ")[1].split("s")[0])
    assert 30.0 < budget <= MAX_NOTICE_HORIZON_S, drain
    _in_order(out, f"draining step {agreed}", "drained", "exiting with code 143")


def test_a_metadata_server_that_misbehaves_never_disturbs_training(tmp_path: Path) -> None:
    fake = FakeMetadata().start()
    try:
        fake.set_mode("garbage")
        env = _env(aws=fake.url, gce=fake.url, azure=fake.url)
        proc = _launch(tmp_path, env, "--notices", "aws,gce,azure", "--max-steps", "60")
        wait_for(proc, "step 15", lambda: _step(tmp_path) >= 15)
        fake.set_mode("slow")  # hangs every request it gets
        wait_for(proc, "step 30", lambda: _step(tmp_path) >= 30)
        fake.stop()  # vanishes: connections are refused from now on
        out, _ = proc.communicate(timeout=120)
    finally:
        fake.stop()
    assert proc.returncode == 0, out[-4000:]
    result = read(tmp_path / "st" / "rank0.result.json") or ""
    assert '"start_step": 0,' in result and '"step": 60,' in result, result
    assert "[preemption]" not in out and "[notice]" not in out
    for cloud in ("aws", "gce", "azure"):
        assert out.count(f"{cloud} notices: the metadata server") == 1, out[-4000:]  # one WARNING per source
