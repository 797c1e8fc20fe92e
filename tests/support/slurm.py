"""A private one-node SLURM cluster for the tests (and a laptop): munged, slurmctld and slurmd
started from the installed binaries under a temporary directory, stopped by PID at the end.

Nothing is installed here: the Debian packages ``slurm-wlm`` and ``munge`` provide the
binaries (:data:`HOW_TO_GET`); without them :func:`missing` names what is absent and the
tests skip. The cluster has its own munge key and socket, its own ``slurm.conf`` (ports
picked free, state, spool and logs in the directory) and two partitions over the one node:
``low`` (preemptible: ``PreemptMode=REQUEUE`` with a ``GraceTime``) and ``high``, which
preempts ``low`` by partition priority (``PreemptType=preempt/partition_prio``). The node has
one CPU in SLURM's eyes, so a ``high`` job always needs the ``low`` job's place.

Accounting needs slurmdbd, which we do not run: :meth:`SlurmCluster.job` reads
``scontrol show job`` (state, ``Restarts``, ``ExitCode``) and :meth:`SlurmCluster.records`
the job-completion log (``JobCompType=jobcomp/filetxt``: one line per end of a run, the
requeued ones included). docs/slurm-testing.md shows the same by hand.

With ``hosts`` (a ``netns.Hosts``, root only) the cluster has one node per host instead,
``lp1``, ``lp2``, ..., each slurmd in its host's network namespace (:meth:`SlurmCluster._on`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "sinfo", "scancel")
HOW_TO_GET = (
    "SLURM is not installed; to run the SLURM tests: `apt-get update && apt-get install -y slurm-wlm munge` "
    "(Debian/Ubuntu, as root; .ci/run does this), see docs/slurm-testing.md"
)
#: Seconds SLURM keeps a requeued job pending (``Reason=BeginTime``): ``AuthInfo=cred_expire``,
#: 120 s by default. The test cluster lowers it so a requeued job starts again at once.
CRED_EXPIRE_S = 5


def missing() -> list[str]:
    """The SLURM / munge programs not found on PATH (or in /usr/sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name, path=path) is None]


def _which(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if found is None:
        raise FileNotFoundError(f"{name}: {HOW_TO_GET}")
    return found


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM when the process that started it dies (a test run
    killed without its teardown leaves no daemons behind). Linux only; elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick), for a daemon or a job's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slurm_conf(
    root: Path, *, grace_s: int, kill_wait_s: int, cred_expire_s: int | None, ctld_port: int, slurmd_port: int,
    addrs: tuple[str, ...] = ("127.0.0.1",),
) -> str:  # fmt: skip
    """The cluster's ``slurm.conf`` (see the module docstring); ``cred_expire_s=None`` keeps
    SLURM's default (120 s), as production clusters do. ``addrs``: one node ``lp<i+1>`` per
    address (slurmctld listens on the first)."""
    host = socket.gethostname().split(".")[0]
    cred = f",cred_expire={cred_expire_s}" if cred_expire_s is not None else ""
    names = ",".join(f"lp{i + 1}" for i in range(len(addrs)))
    nodes = [f"NodeName=lp{i + 1} NodeAddr={addr} NodeHostname={host} CPUs=1 State=UNKNOWN"
             for i, addr in enumerate(addrs)]  # fmt: skip
    return "\n".join([
        "ClusterName=lptest",
        f"SlurmctldHost={host}({addrs[0]})",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"AuthInfo=socket={root / 'munge' / 'munge.socket'}{cred}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}{'-%n' if len(addrs) > 1 else ''}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd'}{'-%n' if len(addrs) > 1 else ''}.pid",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd'}{'-%n' if len(addrs) > 1 else ''}.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root / 'jobcomp.txt'}",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=2",  # a requeued job starts when eligible, not up to 60 s later
        "SelectType=select/linear",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        "JobRequeue=1",
        "ReturnToService=2",
        f"KillWait={kill_wait_s}",
        "MinJobAge=3600",
        "InactiveLimit=0",
        "SlurmdTimeout=300",
        *nodes,
        f"PartitionName=low Nodes={names} Default=YES MaxTime=INFINITE PriorityTier=1 PreemptMode=REQUEUE GraceTime={grace_s} State=UP",
        f"PartitionName=high Nodes={names} MaxTime=INFINITE PriorityTier=2 PreemptMode=OFF State=UP",
        "",
    ])


class SlurmCluster:
    """A running private cluster; :meth:`start` it, :meth:`stop` it (by PID)."""

    def __init__(
        self, root: Path, *, grace_s: int = 20, kill_wait_s: int = 10, cred_expire_s: int | None = CRED_EXPIRE_S,
        hosts: Any = None,
    ) -> None:  # fmt: skip
        """``hosts``: a ``netns.Hosts``; then one node per host, each slurmd in its host's
        network namespace, slurmctld and the clients in the first (see :meth:`start`)."""
        self.root = root
        self.hosts = hosts
        self.cred_expire_s = cred_expire_s
        self.grace_s = grace_s
        self.kill_wait_s = kill_wait_s
        self.conf = root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # ---- life ---------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        for sub in ("munge", "state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o711)  # munged: not writable by others, searchable by clients
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        addrs = tuple(self.hosts.ip(i) for i in range(len(self.hosts.nodes))) if self.hosts else ("127.0.0.1",)
        self.conf.write_text(slurm_conf(self.root, grace_s=self.grace_s, kill_wait_s=self.kill_wait_s,
                                        cred_expire_s=self.cred_expire_s, ctld_port=free_port(), slurmd_port=free_port(),
                                        addrs=addrs))  # fmt: skip
        if self.hosts:
            self._name_hosts(addrs)
        munge = self.root / "munge"
        self._spawn("munged", [_which("munged"), "-F", "--force", f"--socket={munge / 'munge.socket'}",
                               f"--key-file={key}", f"--log-file={munge / 'munged.log'}",
                               f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}"])  # fmt: skip
        self._until(lambda: (munge / "munge.socket").exists(), timeout_s, "munged to open its socket")
        self._spawn("slurmctld", [*self._on(0), _which("slurmctld"), "-D", "-i", "-c", "-f", str(self.conf)])
        for i in range(len(addrs)):
            name = "slurmd" if len(addrs) == 1 else f"slurmd-lp{i + 1}"
            self._spawn(name, [*self._on(i), _which("slurmd"), "-D", "-N", f"lp{i + 1}", "-f", str(self.conf)])
        self._until(lambda: self.sinfo_states() == ["idle"] * len(addrs), timeout_s, "sinfo to show every node idle")
        return self

    def _on(self, i: int) -> list[str]:
        """The command prefix that runs a program on node ``i``: in its host's network
        namespace (``nsenter``: ``ip netns exec`` would mount a sysfs without the cgroup
        mounts slurmd needs) and a mount namespace of its own where the node's hosts file
        (:meth:`_name_hosts`) is ``/etc/hosts``."""
        if not self.hosts:
            return []
        hosts_file = self.root / f"hosts-lp{i + 1}"
        return [_which("nsenter"), f"--net=/run/netns/{self.hosts.nodes[i]}", _which("unshare"), "--mount",
                "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts_file)]  # fmt: skip

    def _name_hosts(self, addrs: tuple[str, ...]) -> None:
        """Each node's hosts file: the machine's hostname is the node's own address there (srun
        and slurmstepd tell each other addresses they can reach) and ``lp<j>`` names node j."""
        host = socket.gethostname().split(".")[0]
        for i in range(len(addrs)):
            names = "".join(f"{addr} lp{j + 1}\n" for j, addr in enumerate(addrs) if j != i)
            (self.root / f"hosts-lp{i + 1}").write_text(f"127.0.0.1 localhost\n{addrs[i]} {host} lp{i + 1}\n{names}")
            (self.root / f"spool-lp{i + 1}").mkdir(exist_ok=True)

    def stop(self) -> None:
        """Stop every daemon this cluster started, by PID (jobs first, so slurmd ends them)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run([_which("scancel"), "--user=root", "--full"], env=self.env, timeout=10,
                               capture_output=True, check=False)  # fmt: skip
        slurmds = [name for name in self.procs if name.startswith("slurmd")]
        for name in (*slurmds, "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.root / f"{name}.out", "wb")  # noqa: SIM115 (the daemon owns it)
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip
        out.close()

    def _until(self, ok: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f}s for {what}:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, tail: int = 30) -> str:
        """The last lines of every daemon log (for failure messages)."""
        parts = []
        for path in (self.root / "slurmctld.log", *sorted(self.root.glob("slurmd*.log")),
                     self.root / "munge" / "munged.log", *sorted(self.root.glob("*.out"))):  # fmt: skip
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # ---- clients ------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True) -> str:
        """Run a SLURM client against this cluster; its stdout."""
        done = subprocess.run([*self._on(0), _which(argv[0]), *argv[1:]], env=self.env, capture_output=True,
                              text=True, timeout=30, check=False)  # fmt: skip
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} -> exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sinfo_state(self) -> str:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            return self.run("sinfo", "-h", "-n", "lp1", "-o", "%T").split("\n")[0].strip().rstrip("*")
        return ""

    def sinfo_states(self) -> list[str]:
        """Every node's state, in node order (``[]`` while slurmctld does not answer)."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            lines = self.run("sinfo", "-h", "-N", "-p", "low", "-o", "%N %T").split("\n")
            return [state.rstrip("*") for _, state in sorted(line.split() for line in lines if line.strip())]
        return []

    def sbatch(self, *argv: str, env: dict[str, str] | None = None) -> str:
        """``sbatch --parsable ARGV`` (options, then the script and its arguments, or ``--wrap``);
        the job id."""
        done = subprocess.run([*self._on(0), _which("sbatch"), "--parsable", *argv], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"sbatch -> exit {done.returncode}: {done.stderr.strip()}\n{self.logs()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o JOB`` as a dict (``JobState``, ``Restarts``, ``ExitCode``, …)."""
        fields: dict[str, str] = {}
        for token in self.run("scontrol", "show", "job", "-o", job_id).split():
            key, sep, value = token.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def wait_job(self, job_id: str, ok: Callable[[dict[str, str]], bool], timeout_s: float, what: str) -> dict[str, str]:
        """Poll the job until ``ok(fields)``; its fields then."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job(job_id)
            if ok(fields):
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: waited {timeout_s:.0f}s for {what}; now {fields}\n{self.logs()}")
            time.sleep(0.3)

    def records(self, job_id: str) -> list[dict[str, str]]:
        """The job-completion log's lines for ``job_id``, oldest first (one per end of a run)."""
        path = self.root / "jobcomp.txt"
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            fields = dict(t.partition("=")[::2] for t in line.split() if "=" in t)
            if fields.get("JobId") == job_id:
                out.append(fields)
        return out


@contextlib.contextmanager
def cluster(root: Path, **kwargs: int | None) -> Iterator[SlurmCluster]:
    """A started :class:`SlurmCluster` under ``root``, stopped on exit."""
    c = SlurmCluster(root, **kwargs)
    try:
        yield c.start()
    finally:
        c.stop()
