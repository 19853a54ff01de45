"""A waterfall picture of one job's trace from the span files ``LEDGER_TRACING_DIR`` collects
(``spans-<pid>.jsonl``, one JSON span per line): what the README shows, and a quick look at a
trace without a trace viewer.

    python -m ops.otel.trace_picture SPANS_DIR OUT.png [--trace TRACE_ID]

Without ``--trace`` it draws the trace with the most spans. Needs matplotlib (extra ``bench``).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any


def load(directory: Path) -> list[dict[str, Any]]:
    spans = []
    for path in sorted(directory.glob("spans-*.jsonl")):
        for line in path.read_text().splitlines():
            span = json.loads(line)
            span["trace"] = span["context"]["trace_id"].removeprefix("0x")
            span["id"] = span["context"]["span_id"].removeprefix("0x")
            span["parent"] = (span.get("parent_id") or "").removeprefix("0x") or None
            span["pid"] = path.stem.removeprefix("spans-")
            span["t0"] = datetime.fromisoformat(span["start_time"].replace("Z", "+00:00"))
            span["t1"] = datetime.fromisoformat(span["end_time"].replace("Z", "+00:00"))
            spans.append(span)
    return spans


def in_tree_order(spans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(depth, span), each span after its parent, siblings by start time."""
    ids = {s["id"] for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        parent = span["parent"] if span["parent"] in ids else None
        children.setdefault(parent, []).append(span)
    ordered: list[tuple[int, dict[str, Any]]] = []

    def visit(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s["t0"]):
            ordered.append((depth, span))
            visit(span["id"], depth + 1)

    visit(None, 0)
    return ordered


def label(span: dict[str, Any]) -> str:
    name = str(span["name"]).replace("tests.integration.ledger_app.", "")
    outcome = span["attributes"].get("ledger.outcome")
    return f"{name}  [{outcome}]" if outcome else name


def draw(spans: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = in_tree_order(spans)
    start = min(s["t0"] for s in spans)
    processes = sorted({s["pid"] for s in spans})
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 0.28 * len(rows) + 1.2))
    for row, (depth, span) in enumerate(rows):
        left = (span["t0"] - start).total_seconds() * 1000
        width = max((span["t1"] - span["t0"]).total_seconds() * 1000, 0.3)
        colour = colours(processes.index(span["pid"]) % 10)
        ax.barh(row, width, left=left, color=colour, height=0.7)
        ax.text(left + width + 4, row, "  " * depth + label(span), va="center", fontsize=7)
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the web request began (colour: process)")
    ax.set_title(f"one job, one trace: {spans[0]['trace']}", fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spans_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--trace")
    args = parser.parse_args()
    spans = load(args.spans_dir)
    trace = args.trace or Counter(s["trace"] for s in spans).most_common(1)[0][0]
    draw([s for s in spans if s["trace"] == trace], args.out)
    print(f"{args.out}: trace {trace}")


if __name__ == "__main__":
    main()
