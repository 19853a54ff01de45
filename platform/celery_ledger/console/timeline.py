"""A workflow's history as timeline rows (pure: no I/O, no clock), as Temporal's UI draws one.

The history is the workflow's event log (:mod:`celery_ledger.workflow.history` names the
events). Each command with a duration becomes a row: a step or a child workflow from its
scheduling to its outcome, a timer from its start to its firing, a signal wait from its start to
the signal (or its timeout), and a compensation from the start of its run to its outcome (a
compensation only registered, never run, has no row). Version markers have no duration and no
row. A row with no end yet runs to the timeline's end, outcome ``running``; an operator's retry
from a position ends the rows from there on as ``superseded`` (the commands run again, in new
rows). Only names, kinds and times are taken: never a step's result, a signal's payload or an
error text (a sensitive workflow's data stays out of the page).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# The outcome of each ending event (the CSS class of its bar is ``outcome-<outcome>``).
ENDINGS = {
    "completed": "done",
    "step_failed": "failed",
    "fired": "done",
    "signal": "done",
    "timed_out": "timed-out",
}
ROW_KINDS = ("step", "child", "timer", "signal")


@dataclass
class Row:
    """One bar of the timeline."""

    pos: int
    kind: str  # step | child | timer | signal | compensation
    name: str
    start: datetime
    end: datetime | None = None
    outcome: str = "running"  # running | done | failed | timed-out | superseded

    @property
    def label(self) -> str:
        """Position, kind and the name's last part (``3 step charge``)."""
        return f"{self.pos} {self.kind} {self.name.rsplit('.', 1)[-1]}"

    @property
    def detail(self) -> str:
        """Position, kind and the whole name."""
        return f"{self.pos} {self.kind} {self.name}"


@dataclass
class Mark:
    """A moment on the timeline with no duration (the code failed, a cancel asked)."""

    at: datetime
    label: str


@dataclass
class Timeline:
    """The rows of one workflow between ``start`` and ``end``."""

    start: datetime
    end: datetime
    status: str = "running"
    rows: list[Row] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)


def build(events: Iterable[Any], *, now: datetime) -> Timeline | None:
    """The timeline of ``events`` (oldest first; mappings or objects with ``at``, ``kind``
    and ``data``), ending at the workflow's end or at ``now``; None without events."""
    ordered = [_event(e) for e in events]
    if not ordered:
        return None
    line = Timeline(start=ordered[0][0], end=_aware(now))
    open_rows: dict[int, Row] = {}  # the current row of each position
    compensations: dict[int, str] = {}  # registered compensations' names, by position
    ended: datetime | None = None
    for at, kind, data in ordered:
        pos = _pos(data)
        if kind == "started":
            line.start = at
        elif kind == "scheduled" and pos is not None:
            command = str(data.get("kind", ""))
            if command == "compensation":
                compensations[pos] = str(data.get("name", ""))
            elif command in ROW_KINDS:
                row = Row(pos=pos, kind=command, name=str(data.get("name", "")), start=at)
                open_rows[pos] = row
                line.rows.append(row)
        elif kind in ENDINGS and pos is not None and pos in open_rows:
            _close(open_rows.pop(pos), at, ENDINGS[kind])
        elif kind == "compensation_scheduled" and pos is not None:
            name = compensations.get(pos, "")
            row = Row(pos=pos, kind="compensation", name=name, start=at)
            open_rows[-1 - pos] = row  # (a key of its own beside the command's)
            line.rows.append(row)
        elif kind in ("compensation_completed", "compensation_failed") and pos is not None:
            row_of = open_rows.pop(-1 - pos, None)
            if row_of is not None:
                _close(row_of, at, "done" if kind == "compensation_completed" else "failed")
        elif kind == "code_failed":
            line.marks.append(Mark(at, "cancelled" if data.get("cancelled") else "code failed"))
        elif kind == "cancel_requested":
            line.marks.append(Mark(at, "cancel asked"))
        elif kind == "retried":
            line.marks.append(Mark(at, "retried"))
            ended, line.status = None, "running"
            from_pos = data.get("from_pos")
            for key in list(open_rows):
                if from_pos is not None and open_rows[key].pos >= int(from_pos):
                    _close(open_rows.pop(key), at, "superseded")
        elif kind == "finished":
            ended, line.status = at, str(data.get("status", "finished"))
        elif kind == "stuck":
            line.status = "stuck"
    if ended is not None:
        line.end = ended
    line.end = max(line.end, line.start)
    return line


def _close(row: Row, at: datetime, outcome: str) -> None:
    row.end, row.outcome = at, outcome


def _event(event: Any) -> tuple[datetime, str, Mapping[str, Any]]:
    if isinstance(event, Mapping):
        at, kind, data = event.get("at"), event.get("kind"), event.get("data")
    else:
        at, kind, data = event.at, event.kind, event.data
    return _aware(at), str(kind), data if isinstance(data, Mapping) else {}


def _pos(data: Mapping[str, Any]) -> int | None:
    value = data.get("pos")
    return int(value) if isinstance(value, int | str) and str(value).isdigit() else None


def _aware(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    return datetime.fromtimestamp(0, UTC)
