"""mkdocs hooks for the docs site (mkdocs.yml): the pages that live outside docs/.

The Markdown is written to read well on the repository's web view, where a page links
``../README.md`` or ``../CHANGELOG.md`` and the project README links
``docs/guide.md``. On the site those files are pages too: the project README is the home
page, ``docs/README.md`` (the list of pages) is ``contents.md``, CHANGELOG is a page of its
own. Every relative link is resolved against the repository path of the page it is on and
pointed at the site's page for that file; any other repository file a page links (an
example, a manifest) is copied into the site under ``repo/``. A link to a file that does
not exist stays as written, so ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]

# repository path -> page on the site
PAGES = {
    "README.md": "index.md",
    "docs/README.md": "contents.md",
    "CHANGELOG.md": "changelog.md",
}
_SOURCE = {page: repo_path for repo_path, page in PAGES.items()}

# [text](target) and ![alt](target); the target has no spaces (ours never do)
_LINK = re.compile(r"(\]\()([^)\s]+)(\))")
_FENCED = re.compile(r"^(```|~~~).*?^\1|`[^`\n]*`", re.M | re.S)  # fenced blocks, inline code


def _repo_path(src_uri: str) -> str:
    return _SOURCE.get(src_uri, "docs/" + src_uri)


def _is_relative(target: str) -> bool:
    return not (target.startswith(("#", "/")) or re.match(r"^[a-z][a-z0-9+.-]*:", target))


def _site_path(repo_path: str) -> str:
    """The site's file for a repository file."""
    if repo_path in PAGES:
        return PAGES[repo_path]
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    return "repo/" + repo_path


def _links(markdown: str) -> list[re.Match[str]]:
    """The relative links outside code (pure ``#anchor`` links need nothing)."""
    code = [m.span() for m in _FENCED.finditer(markdown)]
    return [
        m for m in _LINK.finditer(markdown) if _is_relative(m.group(2)) and not any(a <= m.start() < b for a, b in code)
    ]


def _resolve(src_uri: str, target: str) -> tuple[str, str]:
    path, _, anchor = target.partition("#")
    here = posixpath.dirname(_repo_path(src_uri))
    return posixpath.normpath(posixpath.join(here, path)), anchor


def on_files(files: Files, config: Any) -> Files:
    """The outside pages in, docs/README.md renamed, linked repository files copied."""
    contents = files.get_file_from_path("README.md")
    if contents is not None:
        files.remove(contents)
    for repo_path, page in PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(REPO / repo_path)))
    wanted: set[str] = set()
    for page in [f.src_uri for f in files.documentation_pages()]:
        text = (REPO / _repo_path(page)).read_text(encoding="utf-8")
        for match in _links(text):
            path, _ = _resolve(page, match.group(2))
            if not path.startswith("docs/") and path not in PAGES and (REPO / path).is_file():
                wanted.add(path)
    for path in sorted(wanted):
        files.append(File.generated(config, "repo/" + path, abs_src_path=str(REPO / path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Every relative link pointed at the site's file for the repository file it names."""
    src_uri = page.file.src_uri
    here = posixpath.dirname(src_uri) or "."

    def rewrite(match: re.Match[str]) -> str:
        path, anchor = _resolve(src_uri, match.group(2))
        site = posixpath.relpath(_site_path(path), here)
        return match.group(1) + site + ("#" + anchor if anchor else "") + match.group(3)

    out, last = [], 0
    for match in _links(markdown):
        out.append(markdown[last : match.start()])
        out.append(rewrite(match))
        last = match.end()
    out.append(markdown[last:])
    return "".join(out)


# Sphinx roles in the docstrings (``:class:`~a.b.C` ``) arrive on the API page as
# ``:class:<code>~a.b.C</code>``: shown as the code alone, ``~`` keeping the last name as Sphinx does.
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):<code>(~?)([^<]*)</code>")


def _role(match: re.Match[str]) -> str:
    name = match.group(2).rsplit(".", 1)[-1] if match.group(1) else match.group(2)
    return f"<code>{name}</code>"


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """The API page's Sphinx roles as plain code."""
    return _ROLE.sub(_role, html)
