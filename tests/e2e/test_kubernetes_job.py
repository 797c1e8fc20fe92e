"""The Kubernetes Job recipe (examples/kubernetes/job.yaml, docs/recipes.md): the manifest is
valid against the Kubernetes schemas (kubernetes-validate, offline, every version it ships
from 1.29 on), its policy fits what the callback does, and its container's command, read from
the YAML, survives the kubelet's termination: SIGTERM to the container's PID 1, then SIGKILL
once terminationGracePeriodSeconds have passed. The process must commit its snapshot and exit
by itself with an exit code the podFailurePolicy ignores (a retry that does not count)."""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from lightning_preempt import Tuning, list_checkpoints
from lightning_preempt.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "kubernetes"
GRACE_S = 15  # the test's terminationGracePeriodSeconds (the manifest's, a spot node's cap)


def _documents() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((EXAMPLE / "job.yaml").read_text()))


def _job() -> dict[str, Any]:
    (job,) = [d for d in _documents() if d["kind"] == "Job"]
    return job


def _container(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _versions() -> list[str]:
    found = sorted({v for v in kubernetes_validate.utils.all_versions()}, key=lambda v: tuple(map(int, v.split("."))))
    return [v for v in found if tuple(map(int, v.split(".")[:2])) >= (1, 29)]


def test_the_job_manifest_is_valid_against_the_kubernetes_schemas() -> None:
    job = _job()
    versions = _versions()
    assert len(versions) >= 3, versions
    documents = _documents()
    assert [d["kind"] for d in documents] == ["ServiceAccount", "Job"]
    for version in versions:
        for document in documents:
            kubernetes_validate.validate(document, version, strict=True)  # raises on any unknown or wrong field
    # the validator is strict: a misspelt field is refused
    typo = copy.deepcopy(job)
    typo["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriod"):
        kubernetes_validate.validate(typo, versions[-1], strict=True)


def test_the_failure_policy_ignores_what_a_preemption_ends_with() -> None:
    job = _job()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert spec["podReplacementPolicy"] == "Failed"  # no second pod writing dirpath meanwhile
    rules = spec["podFailurePolicy"]["rules"]
    ignored_codes = {
        c for r in rules if r["action"] == "Ignore" and "onExitCodes" in r for c in r["onExitCodes"]["values"]
    }
    exit_code = Tuning.exit_code  # the default every preempted rank exits with
    assert exit_code in ignored_codes
    assert any(
        r["action"] == "Ignore" and {"type": "DisruptionTarget", "status": "True"} in r.get("onPodConditions", [])
        for r in rules
    ), "a disrupted pod (preempted, evicted, drained) is retried whatever its exit code"
    container = _container(job)
    assert all(r["onExitCodes"].get("containerName") == container["name"] for r in rules if "onExitCodes" in r)
    # exec form: python itself is PID 1 (a shell there would swallow the SIGTERM)
    assert isinstance(container["command"], list) and container["command"][0] == "python"
    args = container["args"]
    assert float(args[args.index("--grace") + 1]) == pod["terminationGracePeriodSeconds"]
    assert 0 < spec["backoffLimit"] < 10


def test_the_pod_fits_a_spot_node_reclaim_and_has_an_identity_for_the_bucket() -> None:
    """Issue 56: a spot node's reclaim caps the pod's grace at the kubelet's graceful node
    shutdown budget for regular pods (GKE: 15 s), so the grace the callback is told must not be
    more; the pod lands on spot nodes (their label, their taint tolerated) and runs as the
    ServiceAccount that Workload Identity maps to the bucket's IAM."""
    pod = _job()["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] <= 15
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    (account,) = [d for d in _documents() if d["kind"] == "ServiceAccount"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def _argv(container: dict[str, Any], dirpath: Path) -> list[str]:
    """The container's argv, as the manifest gives it; the checkpoint bucket and the grace
    period replaced by the test's, python by this interpreter."""
    argv = [*container["command"], *container["args"]]
    argv[argv.index("--dirpath") + 1] = str(dirpath)
    argv[argv.index("--grace") + 1] = str(GRACE_S)
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


def _pid_namespaces() -> bool:
    """Whether ``unshare`` may make a PID namespace here (root, as in CI)."""
    try:
        probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _pid_one(outer: subprocess.Popen[str], timeout: float = 30.0) -> int:
    """The pid (in our namespace) of the process unshare forked as the new namespace's PID 1."""
    return _first_child(outer.pid, timeout)


def _first_child(pid: int, timeout: float = 30.0) -> int:
    """The first child of ``pid``, waiting until it has one."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = children.read_text().split() if children.exists() else []
        if pids:
            return int(pids[0])
        time.sleep(0.01)
    raise AssertionError(f"process {pid} started no child")


def test_the_containers_command_snapshots_and_exits_143_under_the_kubelets_sigterm_then_sigkill(
    tmp_path: Path,
) -> None:
    job = _job()
    container = _container(job)
    argv = _argv(container, tmp_path / "ck")
    as_pid_one = _pid_namespaces()
    if as_pid_one:
        # A container's PID 1: the kernel drops a signal to it that it has no handler for, as
        # in a pod; --kill-child: the namespace dies with unshare
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]
    env = {**os.environ, **{e["name"]: e["value"] for e in container.get("env", [])}}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        argv,
        cwd=EXAMPLE,  # the manifest's workingDir /app holds train.py
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        target = _pid_one(proc) if as_pid_one else proc.pid
        deadline = time.monotonic() + 180
        while not any(re.fullmatch(r"step ([3-9]\d|\d{3,})\n", line) for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.05)
        code, killed, took = _kubelet_stop(proc, target, GRACE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    reader.join(timeout=10)
    out = "".join(lines)
    assert not killed, f"still running {GRACE_S} s after SIGTERM: SIGKILLed (exit 137)\n{out[-3000:]}"
    # the exit code the container reports (a signal's death reads 128 + N) is one the policy ignores
    ignored = {
        c for r in job["spec"]["podFailurePolicy"]["rules"] if "onExitCodes" in r for c in r["onExitCodes"]["values"]
    }
    assert code == 143 and code in ignored, out[-3000:]
    # the snapshot of the step it was at is committed and verifies
    last_step = max(int(m) for m in re.findall(r"^step (\d+)$", out, re.M))
    committed = list_checkpoints(str(tmp_path / "ck"))
    assert committed and committed[0].step == last_step and committed[0].step >= 30, (committed, out[-2000:])
    assert committed[0].committed and cli_main(["verify", committed[0].path]) == 0  # sizes and CRC32C
    assert re.search(rf"exiting with code 143; safe to resume from: step {last_step}", out), out[-3000:]
    assert took < GRACE_S


def _kubelet_stop(proc: subprocess.Popen[str], pid_one: int, grace_s: float) -> tuple[int, bool, float]:
    """The kubelet's termination: SIGTERM to the container's PID 1, and SIGKILL to everything
    in it once ``grace_s`` have passed. Returns the exit code the container reports (a death by
    signal N reads 128 + N), whether it took the SIGKILL, and the seconds from SIGTERM to exit."""
    os.kill(pid_one, signal.SIGTERM)
    signalled = time.monotonic()
    try:
        proc.wait(timeout=grace_s)
        killed = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        killed = True
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    return code, killed, time.monotonic() - signalled


def test_a_shell_as_pid_one_swallows_the_sigterm_and_is_sigkilled() -> None:
    """Why the manifest's command is exec form: `sh -c "..."` as the container's PID 1 has no
    SIGTERM handler, so the kernel drops the kubelet's SIGTERM; the SIGKILL after the grace
    period ends it with 137, which no Ignore rule on exit codes matches."""
    if not _pid_namespaces():
        pytest.skip("no PID namespace here (unshare --pid needs root, as in CI)")
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", "sleep 60; echo done"],
        text=True,
        start_new_session=True,
    )
    try:
        pid_one = _pid_one(proc)
        _first_child(pid_one)  # sh has started its child (its SIGTERM goes nowhere then)
        code, killed, took = _kubelet_stop(proc, pid_one, 2.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert killed and code == 137 and took >= 2.0
    ignored = {
        c for r in _job()["spec"]["podFailurePolicy"]["rules"] if "onExitCodes" in r for c in r["onExitCodes"]["values"]
    }
    assert code not in ignored
