"""README.md stays short, and every relative link in it and in docs/*.md leads somewhere.

The README is the newcomer's five minutes; the detail lives in docs/ pages reached from it.
A page moved or a heading renamed must not leave a dead link (or a dead ``#anchor``) behind.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 200

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code removed (a ``](`` there is no link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(_INLINE_CODE.sub("", line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link targets and markup dropped, lower case, punctuation
    other than ``-`` and ``_`` removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            base = _slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            seen.setdefault(f"{base}-{n}" if n else base, 1)
    return set(seen)


def _links(page: Path) -> list[str]:
    return [m.group(1) for line in _prose_lines(page.read_text(encoding="utf-8")) for m in _LINK.finditer(line)]


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return ((page.parent / path).resolve() if path else page), anchor


def _is_relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)  # http:, https:, mailto:…


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < MAX_README_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (docs/README.md lists the pages)"
    )


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    dead = []
    for target in filter(_is_relative, _links(page)):
        path, anchor = _resolve(page, target)
        if not path.exists():
            dead.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            dead.append(f"{target}: no heading with anchor #{anchor} in {path.name}")
    assert not dead, f"dead links in {page.relative_to(ROOT)}:\n" + "\n".join(dead)


def test_every_docs_page_is_in_the_index_and_reachable_from_the_readme() -> None:
    index = DOCS / "README.md"
    listed = {_resolve(index, t)[0] for t in filter(_is_relative, _links(index))}
    pages = set(DOCS.glob("*.md")) - {index}
    assert not pages - listed, f"docs/README.md does not list {sorted(p.name for p in pages - listed)}"

    unreached = {p.resolve() for p in pages} - _reachable_from_readme()
    assert not unreached, f"not reachable from README.md: {sorted(p.name for p in unreached)}"


def _reachable_from_readme() -> set[Path]:
    """The .md pages a reader reaches by following links from README.md."""
    reached, todo = {README.resolve()}, [README.resolve()]
    while todo:
        page = todo.pop()
        for target in filter(_is_relative, _links(page)):
            path, _ = _resolve(page, target)
            if path.suffix == ".md" and path.exists() and path not in reached:
                reached.add(path)
                todo.append(path)
    return reached


def test_slug_matches_githubs() -> None:
    # the anchors this test relies on, as GitHub renders them
    assert (
        _slug("Auto-resume: how we get into Lightning's `ckpt_path`")
        == "auto-resume-how-we-get-into-lightnings-ckpt_path"
    )
    assert _slug("Many nodes, elastic: lose one, go on at N-1, take it back at N") == (
        "many-nodes-elastic-lose-one-go-on-at-n-1-take-it-back-at-n"
    )
    assert _slug("The `lightning-preempt` command, start-up") == "the-lightning-preempt-command-start-up"
