# Sourced by _venv.sh and test_min_versions.sh: install into a venv with uv where it can,
# pip where it cannot. uv installs in seconds what pip takes minutes for (the ~130 test
# packages: 7 s against ~2 min; torch's CPU wheel: 3-8 s against 38 s, on this 2-core
# machine), but reads no pip configuration: torch comes from the wheel folders pip is
# configured with (`find-links`, where this machine keeps the CPU wheel), asked for by its
# local version `+cpu`, which no index has (an unpinned resolve would pull a multi-GB CUDA
# build); the packages installed next keep that torch (it satisfies the package's range).
# `--compile-bytecode`: pip writes the .pyc files at install, uv does not by default; where
# PYTHONDONTWRITEBYTECODE is set (this project's machines) no process writes them later, so each
# fresh interpreter compiled torch and Lightning again: `import lightning` 11.4 s -> 4.8 s, the
# install 10 s -> 28 s, and the test suite starts hundreds of interpreters.

_quiet() { grep -v "^WARNING: Location" || true; }

# install_torch VENV VERSION: the CPU wheel from pip's wheel folders through uv, else pip's
# own choice of torch==VERSION. Installs uv into VENV first.
install_torch() {
  local venv=$1 version=$2 dir links=()
  "$venv/bin/python" -m pip install -q --disable-pip-version-check uv 2>&1 | _quiet
  for dir in $("$venv/bin/python" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | sort -u); do
    links+=(--find-links "$dir")
  done
  if [ ${#links[@]} -eq 0 ] \
    || ! "$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" "${links[@]}" "torch==$version+cpu"; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$version" 2>&1 | _quiet
  fi
}

# install_rest VENV ARGS...: `pip install ARGS` through uv, through pip if uv fails.
install_rest() {
  local venv=$1
  shift
  if ! "$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" "$@"; then
    echo "uv could not install $*; falling back to pip" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | _quiet
  fi
}
