"""MkDocs hook: reference pages generated from the code.

A page holds a marker where a generated part goes:

- ``<!-- generated: settings -->``: every field of :class:`celery_ledger.settings.Settings`,
  as its ``LEDGER_*`` variable, its type, its default and its description (the model's own
  ``Field(description=...)``), so the table can never miss a setting or show an old default.
- ``<!-- generated: version -->``: the package's version.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "platform") not in sys.path:
    sys.path.insert(0, str(ROOT / "platform"))


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if value is None:
        return "unset"
    if hasattr(value, "get_secret_value"):
        return "(secret)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, dict | list):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    for module in ("celery_ledger.policies.", "pydantic.types.", "celery_ledger.settings."):
        text = text.replace(module, "")
    for prefix in ("backpressure.", "breaker.", "rate_limit.", "retry."):
        text = text.replace(prefix, "")
    return text.replace("|", "\\|")


def settings_table() -> str:
    from celery_ledger.settings import Settings

    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(
            f"| `LEDGER_{name.upper()}` | {_type(field.annotation)} | {_default(field)} "
            f"| {description} |"
        )
    return "\n".join(rows)


def version() -> str:
    import tomllib

    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- generated: settings -->" in markdown:
        markdown = markdown.replace("<!-- generated: settings -->", settings_table())
    if "<!-- generated: version -->" in markdown:
        markdown = markdown.replace("<!-- generated: version -->", version())
    return markdown


_ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj):(?=<code>)")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    # The docstrings name things with Sphinx roles (":class:`Observer`"): show the name only.
    return _ROLE.sub("", html)
