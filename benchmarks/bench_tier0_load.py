"""Tier 0's restart, the checkpoint load alone (issue 31): where a resume's time goes, tier 0
against the local disk tier, warm and cold.

The same state at the same step is written once to the disk tier and once to tier 0 (a fit of
``bench_tier0.py``'s model, Adam; the tier-0 copy sealed, docs/tier0.md). Then each restart
runs in a fresh process, the kinds interleaved round by round, and the package's own resume
path is timed phase by phase (wrappers around the real functions, nothing mocked):

* **choose**: ``ResumeResolver.target`` (listing the tiers, manifests and sizes, the newest
  valid one across them);
* **load**: ``CheckpointIO.load_checkpoint`` (the manifest, the seal check, the skeleton's
  unpickling, ``.metadata``, the shard files read into tensors with their CRC32C), split
  into its parts below;
* **into the model / the optimizer**: Lightning's ``load_model_state_dict`` (a copy into the
  parameters) and ``load_optimizer_state_dict`` (Adam keeps the loaded tensors);
* **the resume's load** = choose + load + into the model + into the optimizer: the row that
  isolates the checkpoint load from Lightning's own set-up and the first step's compute;
* **`fit` to first step** and **the first step** for scale.

Kinds: tier 0 (/dev/shm, sealed); the disk warm (its pages in the page cache); the disk
cold (``sync; echo 3 > /proc/sys/vm/drop_caches`` before the process starts when run as
root, else ``posix_fadvise(DONTNEED)`` on the checkpoint's files). On a VM, "cold" means
"not in this guest's page cache": the hypervisor may still cache the virtual disk, so a cold
read here can come back at near memory speed; the major-fault and read-time columns say how
cold it was.

    python benchmarks/bench_tier0_load.py --mb 32 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import bench_tier0
from _common import machine_notes, table

# (phase, wall start, wall end, process CPU, minor faults, major faults) of every timed call
_spans: list[tuple[str, float, float, float, int, int]] = []


def _timed(owner: Any, attr: str, phase: str) -> None:
    """Wrap ``owner.attr`` (a class's method or a module's function) to record its span."""
    fn = getattr(owner, attr)

    def wrapper(*a: Any, **k: Any) -> Any:
        r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            t1, c1, r1 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            _spans.append((phase, t0, t1, c1 - c0, r1.ru_minflt - r0.ru_minflt, r1.ru_majflt - r0.ru_majflt))

    setattr(owner, attr, wrapper)


def instrument() -> None:
    """Time the resume's phases on the package's own code path."""
    import lightning.pytorch.strategies.strategy as strategy

    from lightning_preempt.catalog import loader
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
    from lightning_preempt.read import load, tensors
    from lightning_preempt.resume.resolver import ResumeResolver

    _timed(ResumeResolver, "target", "choose")
    _timed(ShardedAsyncCheckpointIO, "load_checkpoint", "load")
    _timed(loader.Loader, "_resolve", "load: resolve the path")
    _timed(load, "read_manifest", "load: manifest")
    _timed(load, "sealed", "load: seal check")
    _timed(load, "check_files", "load: sizes")
    _timed(load, "load_skeleton", "load: skeleton (read + unpickle)")
    _timed(load, "read_verified_bytes", "load: small files read (skeleton, .metadata)")
    _timed(load, "dcp_metadata", "load: .metadata unpickle")
    _timed(load, "read_tensors", "load: shard files into tensors")
    _timed(tensors, "new_tensor", "load: allocate tensors")
    _timed(strategy.Strategy, "load_model_state_dict", "into the model")
    _timed(strategy.Strategy, "load_optimizer_state_dict", "into the optimizer")


def child(argv: list[str]) -> None:
    instrument()
    if "--no-into" in argv:  # the tier-0 load as before: into fresh tensors, then Lightning's copy
        argv.remove("--no-into")
        from lightning_preempt.lightning import callback

        callback._model_tensors = lambda module: {}  # type: ignore[assignment]
    from lightning.pytorch import Callback, Trainer

    first: dict[str, float] = {}

    class FirstStep(Callback):
        def on_train_batch_start(self, trainer: Trainer, *a: Any) -> None:
            first.setdefault("start", time.perf_counter())

        def on_train_batch_end(self, trainer: Trainer, *a: Any) -> None:
            first.setdefault("end", time.perf_counter())

    original_init = Trainer.__init__

    def init(self: Any, *a: Any, callbacks: list[Any], **k: Any) -> None:
        original_init(self, *a, callbacks=[*callbacks, FirstStep()], **k)

    Trainer.__init__ = init  # type: ignore[method-assign]
    fit_t = {}
    original_fit = Trainer.fit

    def fit(self: Any, *a: Any, **k: Any) -> Any:
        fit_t["t"] = time.perf_counter()
        return original_fit(self, *a, **k)

    Trainer.fit = fit  # type: ignore[method-assign]
    sys.argv = [bench_tier0.__file__, *argv]
    bench_tier0.main()  # prints bench_tier0's RESULT line
    print("PHASES " + json.dumps({"spans": _spans, "fit": fit_t["t"], "first": first}), flush=True)


def run_restart(dirpath: Path, args: argparse.Namespace, memory: str | None, *, into: bool = True) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", "--mb", str(args.mb), "--steps", str(args.step + 1),
            "--step-sleep", "0", "--dirpath", str(dirpath), "--stop-at-first-step", "--tier0", "off"]  # fmt: skip
    if memory is not None:
        argv[argv.index("off")] = str(10**6)  # tier 0 on (its copy read), never copying again
        argv += ["--memory", memory] + ([] if into else ["--no-into"])
    import subprocess

    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if " " in ln}
    if proc.returncode != 0 or "PHASES" not in lines:
        raise RuntimeError(f"restart failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    got: dict[str, Any] = json.loads(lines["PHASES"])
    got["resumed_from"] = json.loads(lines["RESULT"])["resumed_from"]
    return got


def summarize(got: dict[str, Any]) -> dict[str, float]:
    """Per phase: the wall seconds (outermost calls only), CPU, faults."""
    out: dict[str, float] = {}
    ends: dict[str, float] = {}
    for phase, t0, t1, cpu, minflt, majflt in got["spans"]:
        if t0 < ends.get(phase, -1.0):
            continue  # nested in a call of the same phase
        ends[phase] = t1
        for key, value in ((phase, t1 - t0), (f"{phase} [cpu]", cpu), (f"{phase} [minflt]", minflt),
                           (f"{phase} [majflt]", majflt)):  # fmt: skip
            out[key] = out.get(key, 0.0) + value
    out["the resume's load"] = sum(out.get(p, 0.0) for p in LOAD_PHASES)
    out["the resume's load [cpu]"] = sum(out.get(f"{p} [cpu]", 0.0) for p in LOAD_PHASES)
    out["`fit` to first step"] = got["first"]["end"] - got["fit"]
    out["the first step"] = got["first"]["end"] - got["first"]["start"]
    return out


LOAD_PHASES = ("choose", "load", "into the model", "into the optimizer")


def drop_caches() -> str:
    """Evict the page cache: the whole guest's (root), else nothing (the caller falls back)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        return ""


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=32, help="MB of parameters (Adam: 3x that in the state)")
    p.add_argument("--rounds", type=int, default=5, help="restarts of each kind, interleaved")
    p.add_argument("--step", type=int, default=4, help="the step the checkpoints are taken at")
    p.add_argument("--cold", choices=("drop_caches", "fadvise"), default="drop_caches")
    p.add_argument("--disk", default=tempfile.gettempdir())
    p.add_argument("--json", default="")
    args = p.parse_args()
    tag = uuid.uuid4().hex[:8]
    disk = Path(args.disk) / f"lp-bench-tier0-load-{tag}"
    memory = f"/dev/shm/lp-bench-tier0-load-{tag}"
    try:
        report(args, disk, memory)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)


def report(args: argparse.Namespace, disk: Path, memory: str) -> None:
    load0 = os.getloadavg()
    ns = argparse.Namespace(mb=args.mb, steps=args.step, step_sleep=0.0)
    bench_tier0.run_child(ns, dirpath=disk / "r-disk", every=args.step)
    bench_tier0.run_child(ns, dirpath=disk / "r-mem", tier0=str(args.step), memory=memory)
    kinds = ("tier 0", "tier 0, not into the model", "disk cold", "disk warm")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    resumed: dict[str, str] = {}
    how_cold = args.cold
    for i in range(args.rounds):
        order = kinds if i % 2 == 0 else kinds[::-1]
        for kind in order:
            if kind == "disk cold":
                if args.cold != "drop_caches" or not drop_caches():
                    how_cold = "fadvise"
                    bench_tier0.evict(str(disk / "r-disk"))
            elif kind == "disk warm":  # read once so its pages are cached
                for root, _, files in os.walk(disk / "r-disk"):
                    for name in files:
                        Path(root, name).read_bytes()
            tier0 = kind.startswith("tier 0")
            got = run_restart(disk / ("r-mem" if tier0 else "r-disk"), args, memory if tier0 else None,
                              into=kind == "tier 0")  # fmt: skip
            runs[kind].append(summarize(got))
            resumed[kind] = str(got["resumed_from"])
    load1 = os.getloadavg()
    med = {k: {key: statistics.median(r.get(key, 0.0) for r in v) for key in v[0]} for k, v in runs.items()}
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "median": med, "load": [load0, load1]}, indent=1))
    phases = ["choose", "load", "load: resolve the path", "load: manifest", "load: seal check", "load: sizes",
              "load: skeleton (read + unpickle)", "load: small files read (skeleton, .metadata)", "load: .metadata unpickle",
              "load: shard files into tensors", "load: allocate tensors", "into the model", "into the optimizer",
              "the resume's load", "`fit` to first step", "the first step"]  # fmt: skip
    rows = []
    for phase in phases:
        cells = [f"{med[k].get(phase, 0.0):.4f}" for k in kinds]
        faults = [f"{med[k].get(phase + ' [minflt]', 0):.0f}/{med[k].get(phase + ' [majflt]', 0):.0f}" for k in kinds]
        rows.append([phase, *cells, *faults])
    print(
        f"{args.mb} MB of parameters + Adam, {args.rounds} rounds (kinds interleaved), cold = {how_cold}; "
        f"load {load0[0]:.1f} at the start, {load1[0]:.1f} at the end"
    )
    print(f"resumed from: {json.dumps(resumed)}\n")
    print("Phases, wall seconds (median of the rounds) and minor/major page faults:\n")
    print(table(["phase", *kinds, *(f"faults {k}" for k in kinds)], rows))
    ratio_rows = []
    old = "tier 0, not into the model"
    pairs = [("tier 0", "disk cold"), ("tier 0", "disk warm"), (old, "disk cold"), (old, "disk warm"), ("tier 0", old)]
    for mine, other in pairs:
        for key, label in (("the resume's load", "wall"), ("the resume's load [cpu]", "process CPU")):
            a, b = med[mine][key], med[other][key]
            each = sorted(t[key] / o[key] for t, o in zip(runs[mine], runs[other], strict=True))  # same round
            ratio_rows.append([f"the resume's load (choosing the checkpoint to the state in the model and optimizer), "
                               f"{label}, {mine} / {other}", f"{a:.4f} / {b:.4f} s", f"{a / b:.2f}",
                               f"{each[0]:.2f}-{each[-1]:.2f}", "<= 0.5" if "disk" in other else "-"])  # fmt: skip
    for other in ("disk cold", "disk warm"):
        a, b = med["tier 0"]["`fit` to first step"], med[other]["`fit` to first step"]
        ratio_rows.append([f"`fit` to first step, tier 0 / {other}", f"{a:.3f} / {b:.3f} s", f"{a / b:.2f}", "", "-"])
    print()
    print(table(["", "measured (median)", "ratio", "range of the rounds' ratios", "target"], ratio_rows))
    print("\n" + machine_notes())


if __name__ == "__main__":
    main()
