"""MkDocs hook: put the repository's runbooks and figures into the site, and map links to them.

The runbooks (``ops/runbooks/``) and the figures the benchmarks and the console's tests write
(``ops/bench/figures/``, ``ops/otel/``, ``ops/console/``) stay where the code that makes or uses
them lives. This hook adds them to the site at the same paths (``ops/runbooks/backlog.md`` is
the page ``ops/runbooks/backlog/``), and rewrites a page's relative link to such a file, written
as it resolves in the repository (``../../ops/runbooks/backlog.md`` from ``docs/guide/``), into
its place in the site; so a link works on GitHub and in the site, and ``--strict`` checks it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("ops/runbooks/*.md", "ops/bench/figures/*.png", "ops/otel/*.png", "ops/console/*.png")
_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")


def _repo_paths() -> set[str]:
    return {str(p.relative_to(ROOT)) for pattern in SHIPPED for p in ROOT.glob(pattern)}


def on_files(files: Files, config: Any) -> Files:
    for path in sorted(_repo_paths()):
        files.append(File(path, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    shipped = _repo_paths()
    source = Path(page.file.abs_src_path).parent
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        resolved = (source / target).resolve()
        try:
            in_repo = str(resolved.relative_to(ROOT))
        except ValueError:
            return match.group(0)
        if in_repo not in shipped:
            return match.group(0)
        link = posixpath.relpath(in_repo, here or ".")
        return f"{match.group(1)}{link}{match.group(3) or ''}{match.group(4)}"

    return _LINK.sub(rewrite, markdown)
