"""The release a user installs (issue 35): one version, in ``lightning_preempt/__init__.py``,
that pyproject.toml reads and CHANGELOG.md's newest released section names; README installs
the package by its name, with the extras pyproject.toml declares. The built wheel itself is
installed and run by scripts/wheel_smoke.sh (.ci/run)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _source_version() -> str:
    tree = ast.parse((ROOT / "lightning_preempt" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
            assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            return node.value.value
    raise AssertionError("lightning_preempt/__init__.py sets no literal __version__")


def test_the_version_is_the_newest_released_changelog_section() -> None:
    import lightning_preempt

    headings = re.findall(r"^## \[([^\]]+)\](.*)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[0] == ("Unreleased", ""), "new lines go under an `## [Unreleased]` on top"
    released = headings[1]
    assert re.fullmatch(r"\d+\.\d+\.\d+", released[0]), released
    assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", released[1]), f"a release heading has its date: {released}"
    assert _source_version() == lightning_preempt.__version__ == released[0]
    # every released version appears once, newest first
    versions = [tuple(int(x) for x in v.split(".")) for v, _ in headings[1:]]
    assert versions == sorted(set(versions), reverse=True)


def test_pyproject_reads_the_version_from_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "the version has one home: lightning_preempt/__init__.py"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_preempt.__version__"}


def test_readme_installs_the_package_by_name_with_the_declared_extras() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install") :]
    install = install[: install.index("\n## ", 1)]
    assert re.search(r"^pip install lightning-preempt +#", install, re.M)
    assert 'pip install "lightning-preempt[gcs]"' in install
    assert "git+" not in install, "users install the released package, not a git URL"
    assert 'pip install -e ".[test]"' in install, "and developers find how to install a checkout"
    # a wheel file name in the README carries the current version
    for named in re.findall(r"lightning_preempt-(\d+\.\d+\.\d+)-py3-none-any\.whl", readme):
        assert named == _source_version()
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    table = set(re.findall(r"^\| `\[(\w+)\]` \|", install, re.M))
    assert table == extras, f"README's extras table vs pyproject.toml: {table ^ extras}"


def test_the_cli_extra_brings_what_lightningcli_needs() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("jsonargparse[signatures]") for req in extras["cli"])
    assert "lightning_preempt[cli]" in extras["test"], "the dev venv (scripts/_venv.sh test) gets it"


def test_the_docs_install_brings_neither_torch_nor_lightning() -> None:
    """Issue 56: ``pip install -e ".[docs]"`` pulled torch and Lightning (multi-GB) that the docs
    build does not import (tests/e2e/test_docs_site.py builds it with both blocked). An extra always
    brings the package's own dependencies, so the docs' three live in a dependency group (PEP 735),
    which installs only itself; the dev venv's ``[test]`` extra carries the same three."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "docs" not in project["project"]["optional-dependencies"], "an extra would pull torch with it"
    docs = project["dependency-groups"]["docs"]
    assert {re.split(r"[<>=]", req)[0] for req in docs} == {"mkdocs", "mkdocs-material", "mkdocstrings[python]"}
    assert set(docs) <= set(project["project"]["optional-dependencies"]["test"])


def test_the_wheel_carries_py_typed() -> None:
    """PEP 561 (issue 56): without ``py.typed`` in the wheel a user's mypy reads every name of ours
    as ``Any``. setuptools packs a non-Python file only where package-data names it; the built wheel
    is checked too, by scripts/wheel_smoke.sh."""
    assert (ROOT / "lightning_preempt" / "py.typed").is_file()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in setuptools.get("package-data", {}).get("lightning_preempt", [])
