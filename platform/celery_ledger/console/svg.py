"""The console's charts, drawn on the server as inline SVG (pure: values in, markup out).

Why SVG from here rather than a charting script: the page is a chart the moment it arrives,
works offline and under the console's Content-Security-Policy (no inline script or style: the
colours are CSS classes in ``static/console.css``), refreshes with the overview's panels, and a
test can count its bars and read its labels. Three shapes cover the console:

- :func:`bars`: stacked bars per minute (jobs ended, by outcome);
- :func:`lines`: one line per series per minute (queue depths, latency percentiles), broken
  where a minute has no value rather than drawn through an invented zero;
- :func:`spans`: horizontal bars on a time axis, one row each (a workflow's timeline, the open
  breakers).

Every element a reader or a test looks for carries a class and ``data-*`` attributes (the
series, the minute, the count); every bar has a ``<title>`` (the browser's tooltip).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from html import escape

from markupsafe import Markup

from .series import Window

WIDTH = 720
HEIGHT = 150
LEFT, RIGHT, TOP, BOTTOM = 48, 12, 22, 22
LABELS = 210  # the spans' label column
ROW = 18  # a span row's height
TICK_STEPS = (
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    15,
    30,
    60,
    120,
    300,
    600,
    900,
    1800,
    3600,
    7200,
    21600,
    86400,
)


@dataclass(frozen=True)
class Span:
    """One row of :func:`spans`: a bar from ``start`` to ``end`` (None: to the chart's end)."""

    label: str
    start: datetime
    end: datetime | None
    outcome: str  # the bar's class: ``outcome-<outcome>``
    kind: str = ""
    detail: str = ""  # the tooltip's name, when longer than the label


def bars(
    series: Mapping[str, Sequence[int]], *, window: Window, title: str, chart_id: str
) -> Markup:
    """Stacked bars, one per minute of ``window``: each series a layer (class its name)."""
    top = _nice_top(
        max((sum(s[i] for s in series.values()) for i in range(window.minutes)), default=0)
    )
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / window.minutes
    parts = [_y_axis(top, plot_h, _count), _minute_axis(window, plot_h)]
    totals = {name: sum(values) for name, values in series.items()}
    for i in range(window.minutes):
        base = 0
        minute = window.start + timedelta(minutes=i)
        for name, values in series.items():
            count = values[i]
            if not count:
                continue
            y0, y1 = _y(base, top, plot_h), _y(base + count, top, plot_h)
            parts.append(
                f'<rect class="bar {_cls(name)}" data-series="{_attr(name)}" data-minute="{i}"'
                f' data-count="{count}" x="{LEFT + i * slot + 0.5:.1f}" y="{y1:.1f}"'
                f' width="{max(slot - 1, 1):.1f}" height="{max(y0 - y1, 0.5):.1f}">'
                f"<title>{minute:%H:%M} UTC: {count} {escape(name)}</title></rect>"
            )
            base += count
    parts.append(_legend([(name, f"{name} {totals[name]}") for name in series]))
    return _svg("bars", chart_id, title, parts, HEIGHT, {"total": sum(totals.values())})


def lines(
    series: Mapping[str, Sequence[float | None]],
    *,
    window: Window,
    title: str,
    chart_id: str,
    seconds: bool = False,
) -> Markup:
    """One line per series over the minutes of ``window``; ``None`` leaves a gap. ``seconds``:
    the values are durations (the axis says ms or s)."""
    values = [v for s in series.values() for v in s if v is not None]
    top = _nice_top(max(values, default=0.0), fractional=seconds)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / window.minutes
    fmt = duration if seconds else _count
    parts = [_y_axis(top, plot_h, fmt), _minute_axis(window, plot_h)]
    legend = []
    for n, (name, points) in enumerate(series.items()):
        shown = [v for v in points if v is not None]
        last = shown[-1] if shown else None
        legend.append((f"s{n}", f"{name} {fmt(last) if last is not None else '-'}"))
        segments: list[list[tuple[float, float]]] = [[]]
        for i, value in enumerate(points):
            if value is None:
                segments.append([])
                continue
            segments[-1].append((LEFT + (i + 0.5) * slot, _y(value, top, plot_h)))
        drawn = []
        for segment in (s for s in segments if s):
            if len(segment) == 1:
                x, y = segment[0]
                drawn.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2"/>')
            else:
                coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in segment)
                drawn.append(f'<polyline points="{coords}"/>')
        parts.append(
            f'<g class="line s{n}" data-series="{_attr(name)}" data-points="{len(shown)}"'
            f' data-last="{"" if last is None else _attr(fmt(last))}">'
            f"<title>{escape(name)}</title>{''.join(drawn)}</g>"
        )
    parts.append(_legend(legend))
    return _svg("lines", chart_id, title, parts, HEIGHT, {"series": len(series)})


def spans(
    rows: Sequence[Span], *, start: datetime, end: datetime, title: str, chart_id: str
) -> Markup:
    """A row per span: its label on the left, its bar on a time axis from ``start`` to
    ``end`` (a span with no end runs to ``end``)."""
    start, end = _aware(start), _aware(end)
    if end <= start:
        end = start + timedelta(seconds=1)
    height = TOP + ROW * max(len(rows), 1) + BOTTOM
    plot_w, plot_h = WIDTH - LABELS - RIGHT, height - TOP - BOTTOM
    total = (end - start).total_seconds()

    def x(when: datetime) -> float:
        offset = min(max((_aware(when) - start).total_seconds(), 0.0), total)
        return LABELS + offset / total * plot_w

    parts = [_time_axis(start, end, x, plot_h)]
    if not rows:
        parts.append(f'<text class="empty" x="{LABELS - 6}" y="{TOP + ROW - 5}">none</text>')
    for n, row in enumerate(rows):
        y = TOP + n * ROW
        x0, x1 = x(row.start), x(row.end or end)
        until = row.end.strftime("%H:%M:%S") if row.end else "now"
        took = ((row.end or end) - row.start).total_seconds()
        parts.append(
            f'<g class="span outcome-{_cls(row.outcome)}" data-kind="{_attr(row.kind)}"'
            f' data-label="{_attr(row.label)}" data-outcome="{_attr(row.outcome)}">'
            f'<text class="label" x="{LABELS - 6}" y="{y + ROW - 5}">{escape(_short(row.label))}'
            f"</text>"
            f'<rect x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 2):.1f}" height="{ROW - 6}">'
            f"<title>{escape(row.detail or row.label)}: {escape(row.outcome)},"
            f" {row.start:%H:%M:%S} to {until} ({duration(took)})</title></rect></g>"
        )
    return _svg("spans", chart_id, title, parts, height, {"rows": len(rows)})


# -- the pieces ------------------------------------------------------------------------------


def _svg(
    kind: str,
    chart_id: str,
    title: str,
    parts: list[str],
    height: int,
    data: Mapping[str, object],
) -> Markup:
    attrs = "".join(f' data-{k}="{_attr(str(v))}"' for k, v in data.items())
    return Markup(
        f'<svg class="chart {kind}" id="{_attr(chart_id)}" viewBox="0 0 {WIDTH} {height}"'
        f' width="{WIDTH}" height="{height}" role="img" aria-label="{_attr(title)}"{attrs}>'
        f"<title>{escape(title)}</title>"
        f'<text class="heading" x="{LEFT}" y="14">{escape(title)}</text>'
        f"{''.join(parts)}</svg>"
    )


def _y(value: float, top: float, plot_h: float) -> float:
    return TOP + plot_h - (value / top) * plot_h if top else TOP + plot_h


def _y_axis(top: float, plot_h: float, label: Callable[[float], str]) -> str:
    ticks = []
    for value in (0.0, top / 2, top):
        y = _y(value, top, plot_h)
        ticks.append(
            f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick y" x="{LEFT - 4}" y="{y + 4:.1f}">{escape(label(value))}</text>'
        )
    return f'<g class="axis y">{"".join(ticks)}</g>'


def _minute_axis(window: Window, plot_h: float) -> str:
    """Ticks every 15 minutes of the window (every 5 in a short one), labelled HH:MM."""
    plot_w = WIDTH - LEFT - RIGHT
    slot = plot_w / window.minutes
    every = 15 if window.minutes > 30 else 5
    ticks = []
    for i in range(window.minutes):
        minute = window.start + timedelta(minutes=i)
        if minute.minute % every:
            continue
        x = LEFT + i * slot
        ticks.append(
            f'<line class="tick" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP + plot_h}"'
            f' y2="{TOP + plot_h + 4}"/>'
            f'<text class="tick x" x="{x:.1f}" y="{TOP + plot_h + 16}">{minute:%H:%M}</text>'
        )
    base = TOP + plot_h
    return (
        f'<g class="axis x"><line class="base" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{base}"'
        f' y2="{base}"/>{"".join(ticks)}</g>'
    )


def _time_axis(
    start: datetime, end: datetime, place: Callable[[datetime], float], plot_h: float
) -> str:
    """Ticks at a round step giving at most eight of them, labelled with the time of day (or,
    under a second apart, the offset from ``start``)."""
    total = (end - start).total_seconds()
    step = next((s for s in TICK_STEPS if total / s <= 8), TICK_STEPS[-1])
    relative = step < 1  # within a second or two: offsets from the start read better
    first = start.timestamp() if relative else math.ceil(start.timestamp() / step) * step
    ticks = []
    moment = float(first)
    while moment <= end.timestamp() + 1e-9:
        when = datetime.fromtimestamp(moment, UTC)
        at = place(when)
        if relative:
            label = f"+{moment - first:.1f}s"
        else:
            label = f"{when:%H:%M:%S}" if step < 60 else f"{when:%H:%M}"
        ticks.append(
            f'<line class="grid" x1="{at:.1f}" x2="{at:.1f}" y1="{TOP}" y2="{TOP + plot_h}"/>'
            f'<text class="tick x" x="{at:.1f}" y="{TOP + plot_h + 16}">{label}</text>'
        )
        moment += step
    return f'<g class="axis x">{"".join(ticks)}</g>'


def _legend(items: Sequence[tuple[str, str]]) -> str:
    """Swatches and labels along the top right: (class, text) each."""
    out: list[str] = []
    x = float(WIDTH - RIGHT)
    for cls, text in reversed(items):
        width = 22 + 6.2 * len(text)  # (a system font at 11 px: about 6 px a character)
        x -= width
        out.append(
            f'<g class="key {_cls(cls)}"><rect x="{x:.1f}" y="5" width="9" height="9"/>'
            f'<text x="{x + 12:.1f}" y="14">{escape(text)}</text></g>'
        )
    return f'<g class="legend">{"".join(out)}</g>'


def _nice_top(value: float, *, fractional: bool = False) -> float:
    """The axis' top: ``value`` rounded up to 1, 2 or 5 times a power of ten (at least 1 for
    counts, and 2 so that the half-way tick is a whole number)."""
    if value <= 0:
        return 1.0 if fractional else 2.0
    power = 10 ** math.floor(math.log10(value))
    for factor in (1, 2, 5, 10):
        if value <= factor * power:
            top = factor * power
            return float(top) if fractional else max(float(math.ceil(top)), 2.0)
    return float(10 * power)  # (unreachable: value <= 10 * power)


def _count(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _short(label: str, limit: int = 30) -> str:
    return label if len(label) <= limit else label[: limit - 1] + "…"


def _cls(name: str) -> str:
    """A name as a CSS class (letters, digits, dashes)."""
    return "".join(c if c.isalnum() else "-" for c in name.lower())


def _attr(value: str) -> str:
    return escape(value, quote=True)


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)
