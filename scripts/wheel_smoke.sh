#!/usr/bin/env bash
# The release a user installs (issue 35): build the sdist and, from it, the wheel (`python -m
# build`), install the *wheel* (not editable) into a fresh venv with only its declared
# dependencies (`[gcs,cli]`; torch==2.13.0, the dev pin, a CPU wheel), then run the LightningCLI
# example and the operator CLI against it from a folder outside the checkout. Catches a module
# or package-data file left out of the wheel, an import of a test-only dependency, a version
# that disagrees with CHANGELOG.md. .ci/run runs it in the background while the suite runs.
# LP_WHEEL_DIR keeps the venv and dist/ there (default: a temporary folder, removed).
set -euo pipefail
cd "$(dirname "$0")/.."
# Nothing of the checkout on the path: with it there pip could take the checkout's egg-info for
# an installed lightning_preempt and skip the wheel.
unset PYTHONPATH
repo=$PWD
work=${LP_WHEEL_DIR:-$(mktemp -d)}
[ -n "${LP_WHEEL_DIR:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work"
py=${PYTHON:-python3}
t0=$SECONDS
# Build from a copy of the files git would commit: `build` writes an egg-info into its source
# tree, and .ci/run's editable installs must not race with it (their egg-info is the tree's).
rm -rf "$work/src" "$work/dist"
mkdir -p "$work/src"
git ls-files -z -co --exclude-standard | (cd "$repo" && xargs -0 cp --parents -t "$work/src" 2>/dev/null || true)
[ -f "$work/src/pyproject.toml" ] || { echo "could not copy the checkout into $work/src" >&2; exit 1; }
# pip runs outside the checkout too: `python -m pip` puts the working directory on sys.path, and
# an editable install's lightning_preempt.egg-info there would read as installed already.
cd "$work"
[ -x "$work/build-venv/bin/python" ] || "$py" -m venv "$work/build-venv"
# pip's minutes here ran beside the suite in .ci/run and slowed it (issue 35's smoke test took
# ~300 s, mostly pip): uv installs the same metadata's resolution in seconds (scripts/_install.sh;
# pip wherever uv fails), and `build` makes its isolated environment with uv too.
. "$repo/scripts/_install.sh"
"$work/build-venv/bin/python" -m pip install -q --disable-pip-version-check "build[uv]>=1.2" >"$work/pip-build.log" 2>&1 \
  || { cat "$work/pip-build.log"; exit 1; }
installer=pip
[ -x "$work/build-venv/bin/uv" ] && installer=uv
PATH="$work/build-venv/bin:$PATH" "$work/build-venv/bin/python" -m build --installer "$installer" -o "$work/dist" "$work/src" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/lightning_preempt-*.tar.gz)
wheel=$(ls "$work"/dist/lightning_preempt-*-py3-none-any.whl)
echo "built $(basename "$sdist") and $(basename "$wheel") in $((SECONDS - t0)) s"
# A clean venv: only what the wheel's metadata asks for.
rm -rf "$work/venv"
"$py" -m venv "$work/venv"
{ install_torch "$work/venv" 2.13.0 && install_rest "$work/venv" "$wheel[gcs,cli]"; } >"$work/pip.log" 2>&1 \
  || { cat "$work/pip.log"; exit 1; }
# uv itself came in with install_torch: out again, so the venv holds what the wheel asks for.
# What a user's pip would check too: the installed set is consistent.
"$work/venv/bin/python" -m pip uninstall -y -q uv >>"$work/pip.log" 2>&1
"$work/venv/bin/python" -m pip check >>"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
echo "installed the wheel into a clean venv at $((SECONDS - t0)) s"
run=$work/run
rm -rf "$run"
mkdir -p "$run"
cp "$repo/examples/train_cli.py" "$repo/examples/config.yaml" "$run/"
cd "$run"
# Outside the checkout, so nothing of it is importable (PYTHONPATH is unset above).
"$work/venv/bin/python" - "$repo" <<'EOF'
import importlib
import importlib.metadata
import pkgutil
import re
import sys
from pathlib import Path

import lightning_preempt

repo = Path(sys.argv[1])
where = Path(lightning_preempt.__file__).resolve()
assert repo not in where.parents, f"imported from the checkout, not the wheel: {where}"
released = re.search(r"^## \[(\d+\.\d+\.\d+)\]", (repo / "CHANGELOG.md").read_text(), re.M)
assert released, "CHANGELOG.md names no released version"
version = importlib.metadata.version("lightning_preempt")
assert version == lightning_preempt.__version__ == released.group(1), (version, lightning_preempt.__version__)
# Every module imports with the runtime dependencies alone (a test-only import fails here).
names = [m.name for m in pkgutil.walk_packages(lightning_preempt.__path__, "lightning_preempt.")]
for name in names:
    importlib.import_module(name)
# Every module of the checkout is in the wheel.
ours = {p.relative_to(repo).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
        for p in (repo / "lightning_preempt").rglob("*.py")}
missing = sorted(ours - set(names) - {"lightning_preempt"})
assert not missing, f"modules left out of the wheel: {missing}"
# PEP 561: without py.typed a user's type checker treats every name of ours as Any.
assert (where.parent / "py.typed").is_file(), "py.typed left out of the wheel"
print(f"lightning_preempt {version} from {where.parent}: {len(names)} modules import")
EOF
sed -i "s#dirpath: checkpoints/cli-demo#dirpath: $run/ck#" config.yaml
"$work/venv/bin/python" train_cli.py fit --config config.yaml --trainer.max_steps 40 >first.log 2>&1 \
  || { cat first.log; exit 1; }
"$work/venv/bin/python" train_cli.py fit --config config.yaml >second.log 2>&1 || { cat second.log; exit 1; }
grep -q "resuming from .*(step 40)" second.log || { cat second.log; echo "the second run did not resume from step 40" >&2; exit 1; }
lp=$work/venv/bin/lightning-preempt
"$lp" ls "$run/ck" | tee ls.log
grep -q "60" ls.log
"$lp" verify "$run/ck/step-0000000060"
"$lp" report "$run/ck" | head -n 3
echo "wheel smoke test passed in $((SECONDS - t0)) s"
