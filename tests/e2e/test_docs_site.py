"""The docs site (mkdocs.yml, issue 35): ``mkdocs build --strict`` passes (no broken link or
anchor, every page in the nav, the API reference generated from the docstrings), fails on a
broken link, and the built site renders in a real headless browser (the distribution's
chromium, driven by playwright through its executable path) without a console error or a
failed request."""

from __future__ import annotations

import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
APT = "apt-get install -y chromium"


# The build with torch, Lightning and the package itself unimportable (issue 56): the docs group
# installs none of them, so mkdocstrings must read the docstrings from the source alone.
_WITHOUT_TORCH = """
import runpy, sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_preempt"}:
            raise ImportError(f"the docs build imported {name}")
sys.meta_path.insert(0, _Blocked())
sys.argv[0] = "mkdocs"
runpy.run_module("mkdocs", run_name="__main__")
"""


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=config.parent,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = _build(ROOT / "mkdocs.yml", out)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out


def test_the_site_builds_strictly_with_every_page_and_the_api(site: Path) -> None:
    docs = sorted(p.stem for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    for page in [*docs, "contents", "changelog"]:
        assert (site / page / "index.html").is_file(), page
    home = (site / "index.html").read_text()
    assert "pip install lightning-preempt" in html.unescape(re.sub(r"<[^>]+>", "", home))
    assert 'href="strategies/#never-a-silent-fresh-start"' in home and 'src="img/demo-timeline.png"' in home  # docs/… rewritten
    api = (site / "api" / "index.html").read_text()
    # generated from the docstrings: each option's, under its field in engine/config.py
    assert 'id="lightning_preempt.PreemptionCallback"' in api and 'id="lightning_preempt.Tuning"' in api
    assert "every_n_train_steps" in api and "Save every N optimizer steps." in api
    assert "The first retry delay (doubles per attempt)." in api
    assert not re.search(r":(class|meth|func):<code>", api), "Sphinx roles shown as code (scripts/mkdocs_hooks.py)"
    assert (
        'id="lightning_preempt.ShardedAsyncCheckpointIO"' in api and 'id="lightning_preempt.fabric.Preemption"' in api
    )


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    for name in ("mkdocs.yml", "README.md", "CHANGELOG.md", "LICENSE.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for tree in ("docs", "lightning_preempt", "benchmarks", "examples"):
        shutil.copytree(ROOT / tree, tmp_path / tree, ignore=shutil.ignore_patterns("__pycache__", "*.py[co]"))
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "mkdocs_hooks.py", tmp_path / "scripts")
    page = tmp_path / "docs" / "cli.md"
    page.write_text(page.read_text() + "\nSee [the gone page](gone.md).\n")
    broken = _build(tmp_path / "mkdocs.yml", tmp_path / "broken")
    assert broken.returncode != 0
    # the link is what failed it (the unbroken tree builds: the fixture above)
    assert re.search(r"WARNING .*cli\.md.*gone\.md", broken.stdout + broken.stderr), broken.stderr[-2000:]


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.skipif(CHROMIUM is None, reason=f"no chromium to open the site in: {APT}")
def test_home_guide_and_api_render_in_chromium_without_console_errors(served: str) -> None:
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
            for path, heading, text in [
                ("", "lightning_preempt", "pip install lightning-preempt"),
                ("guide/", "Guide: what the package does, in detail", "every_n_train_steps"),
                ("api/", "API reference", "every_n_train_steps"),
            ]:
                response = page.goto(served + path)
                assert response is not None and response.status == 200, path
                page.wait_for_load_state("networkidle")
                assert page.locator("article h1").first.inner_text().rstrip("¶").strip() == heading
                assert text in page.locator("article").inner_text()
                # the theme's script ran: the navigation and the search box are there
                assert page.locator("nav.md-nav--primary").count() > 0
                assert page.locator("input.md-search__input").count() == 1
            # the home page's figure loaded (a path rewritten from docs/img/…)
            page.goto(served)
            page.wait_for_load_state("networkidle")
            image = page.locator("article img").first
            assert image.evaluate("i => i.complete && i.naturalWidth > 0")
            # the client-side search answers from the built index
            search = page.locator("input.md-search__input")
            search.click(force=True)
            search.press_sequentially("SIGTERM", delay=20)  # typed: the theme listens to key events
            page.locator(".md-search-result__item").first.wait_for(timeout=10_000)
            assert page.locator(".md-search-result__item").count() > 0
        finally:
            browser.close()
    assert problems == []
