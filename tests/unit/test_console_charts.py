"""The console's charts, piece by piece: the hour's per-minute buckets and percentiles
(``console.series``), a workflow's history as timeline rows (``console.timeline``), and the
SVG each is drawn as (``console.svg``). Pure functions: no servers."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_ledger.console import series, svg, timeline

NOW = datetime(2026, 11, 29, 12, 30, 40, tzinfo=UTC)


def ended(ago_seconds: float, state: str = "succeeded", tier: str = "default", ran: float = 1.0):
    finished = NOW - timedelta(seconds=ago_seconds)
    return {
        "state": state,
        "tier": tier,
        "finished_at": finished,
        "started_at": finished - timedelta(seconds=ran),
        "created_at": finished - timedelta(seconds=ran + 5),
    }


# -- series --------------------------------------------------------------------------------------


def test_the_window_is_clock_minutes_ending_with_the_current_one() -> None:
    window = series.Window(now=NOW, minutes=60)
    assert window.start == datetime(2026, 11, 29, 11, 31, tzinfo=UTC)
    assert window.end == datetime(2026, 11, 29, 12, 31, tzinfo=UTC)
    assert window.bucket(NOW) == 59
    assert window.bucket(datetime(2026, 11, 29, 12, 30, 0, tzinfo=UTC)) == 59
    assert window.bucket(datetime(2026, 11, 29, 12, 29, 59, tzinfo=UTC)) == 58
    assert window.bucket(window.start) == 0
    assert window.bucket(window.start - timedelta(microseconds=1)) is None
    assert window.bucket(window.end) is None
    assert window.bucket(None) is None
    # a naive time is read as UTC (as pymongo returns them)
    assert window.bucket(NOW.replace(tzinfo=None)) == 59


def test_throughput_counts_each_ended_job_in_its_minute_by_tier_and_outcome() -> None:
    # Given jobs that ended now, a minute ago and outside the hour, in two tiers, one dead
    rows = [
        ended(1),
        ended(2),
        ended(30, "dead"),  # 12:30:10: the current minute
        ended(61, tier="bulk"),  # 12:29:39
        ended(3600 + 60, tier="bulk"),  # before the window
        ended(5, state="running"),  # not an outcome
    ]
    # When they are bucketed over the hour, for the tiers the app has
    counts = series.throughput(rows, series.Window(now=NOW, minutes=60), ["critical", "default"])
    # Then every tier of the app is there (zeros when idle), and a row's tier is added
    assert list(counts) == ["critical", "default", "bulk"]
    assert sum(counts["critical"]["succeeded"]) == 0 and len(counts["critical"]["dead"]) == 60
    assert counts["default"]["succeeded"][59] == 2 and counts["default"]["dead"][59] == 1
    assert counts["bulk"]["succeeded"][58] == 1 and sum(counts["bulk"]["succeeded"]) == 1


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([3.0], 99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 95, 4.0),
        ([float(i) for i in range(1, 101)], 95, 95.0),
        ([float(i) for i in range(1, 101)], 99, 99.0),
        ([5.0, 1.0, 3.0], 0, 1.0),
    ],
)
def test_percentiles_are_by_nearest_rank(values: list[float], q: float, expected: Any) -> None:
    assert series.percentile(values, q) == expected


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=200), st.floats(0, 100))
def test_a_percentile_is_one_of_the_values_and_at_least_q_percent_lie_at_or_below_it(
    values: list[float], q: float
) -> None:
    found = series.percentile(values, q)
    assert found in values
    assert sum(v <= found for v in values) >= q / 100 * len(values)


def test_latency_is_per_minute_run_time_percentiles_with_gaps_for_quiet_minutes() -> None:
    rows = [ended(1, ran=r) for r in (0.1, 0.2, 0.3, 10.0)] + [ended(61, ran=2.0)]
    rows.append({**ended(2), "started_at": None})  # no start: not counted
    rows.append({**ended(2), "started_at": NOW + timedelta(seconds=5)})  # clocks disagree
    found = series.latency(rows, series.Window(now=NOW, minutes=60))
    assert set(found) == {"p50", "p95", "p99"}
    assert found["p50"][59] == pytest.approx(0.2) and found["p99"][59] == pytest.approx(10.0)
    assert found["p50"][58] == pytest.approx(2.0)
    assert found["p50"][:58] == [None] * 58


def test_latency_by_tier_sums_up_the_hour() -> None:
    rows = [ended(1, ran=1.0), ended(100, ran=3.0), ended(5, tier="bulk", ran=7.0)]
    rows.append(ended(7200, ran=99.0))  # outside the hour
    found = series.latency_by_tier(rows, series.Window(now=NOW, minutes=60), ["critical"])
    assert found["critical"] == {"count": 0, "p50": None, "p95": None, "p99": None}
    assert found["default"]["count"] == 2 and found["default"]["p95"] == pytest.approx(3.0)
    assert found["bulk"]["p50"] == pytest.approx(7.0)


# -- timeline ------------------------------------------------------------------------------------


def event(seconds: float, name_of_event: str, **data: Any) -> dict[str, Any]:
    return {"at": NOW + timedelta(seconds=seconds), "kind": name_of_event, "data": data}


ORDER = [
    event(0, "started", workflow="order"),
    event(0.1, "scheduled", pos=0, kind="step", name="tasks.charge", job_id="j0"),
    event(0.2, "scheduled", pos=1, kind="compensation", name="tasks.refund"),
    event(2, "completed", pos=0, result='"secret result"'),
    event(2.1, "scheduled", pos=2, kind="version", name="v", version=2),
    event(2.2, "scheduled", pos=3, kind="timer", name="sleep", until=1.0),
    event(4, "fired", pos=3),
    event(4.1, "scheduled", pos=4, kind="signal", name="approved"),
    event(6, "signal", pos=4, payload='{"pin": "2468"}'),
    event(6.1, "scheduled", pos=5, kind="step", name="tasks.ship"),
    event(7, "step_failed", pos=5, error="refused: card 4111"),
    event(7.1, "code_failed", error="refused"),
    event(7.2, "compensation_scheduled", pos=1, job_id="c1"),
    event(8, "compensation_completed", pos=1),
    event(8.1, "finished", status="compensated"),
]


def test_a_workflows_history_becomes_one_row_per_command_with_a_duration() -> None:
    # Given the log of a workflow with a step, a timer, a signal, a failed step, a compensation
    line = timeline.build(ORDER, now=NOW + timedelta(hours=1))
    assert line is not None
    # Then each has a row from its start to its outcome; the version marker has none
    rows = [(r.pos, r.kind, r.name, r.outcome) for r in line.rows]
    assert rows == [
        (0, "step", "tasks.charge", "done"),
        (3, "timer", "sleep", "done"),
        (4, "signal", "approved", "done"),
        (5, "step", "tasks.ship", "failed"),
        (1, "compensation", "tasks.refund", "done"),
    ]
    assert (line.rows[0].label, line.rows[0].detail) == ("0 step charge", "0 step tasks.charge")
    compensation = line.rows[-1]
    assert compensation.start == NOW + timedelta(seconds=7.2)
    assert compensation.end == NOW + timedelta(seconds=8)
    # And it spans the workflow's life (its end, not "now"), with its failure marked
    assert (line.start, line.end, line.status) == (NOW, NOW + timedelta(seconds=8.1), "compensated")
    assert [m.label for m in line.marks] == ["code failed"]


def test_an_open_command_runs_to_now_and_a_retry_supersedes_from_its_position() -> None:
    running = [*ORDER[:2], event(1, "scheduled", pos=2, kind="signal", name="approved")]
    line = timeline.build(running, now=NOW + timedelta(seconds=30))
    assert line is not None
    assert [(r.outcome, r.end) for r in line.rows] == [("running", None), ("running", None)]
    assert line.end == NOW + timedelta(seconds=30) and line.status == "running"
    # an operator's retry from position 2: the wait there ends, superseded, and runs again
    retried = [
        *running,
        event(5, "retried", from_pos=2, generation=1),
        event(6, "scheduled", pos=2, kind="signal", name="approved"),
    ]
    line = timeline.build(retried, now=NOW + timedelta(seconds=30))
    assert line is not None
    assert [(r.pos, r.outcome) for r in line.rows] == [
        (0, "running"),
        (2, "superseded"),
        (2, "running"),
    ]
    assert timeline.build([], now=NOW) is None


def test_the_timeline_takes_names_and_times_never_results_payloads_or_errors() -> None:
    line = timeline.build(ORDER, now=NOW)
    assert line is not None
    drawn = str(
        svg.spans(
            [svg.Span(r.label, r.start, r.end, r.outcome, r.kind) for r in line.rows],
            start=line.start,
            end=line.end,
            title="order",
            chart_id="t",
        )
    )
    for secret in ("secret result", "2468", "4111"):
        assert secret not in drawn


# -- svg -----------------------------------------------------------------------------------------


def test_bars_stack_the_outcomes_of_each_minute_with_counts_and_times() -> None:
    window = series.Window(now=NOW, minutes=60)
    ok, dead = [0] * 60, [0] * 60
    ok[59], dead[59], ok[10] = 3, 2, 1
    drawn = str(svg.bars({"succeeded": ok, "dead": dead}, window=window, title="t", chart_id="c"))
    assert drawn.startswith('<svg class="chart bars" id="c"') and 'data-total="6"' in drawn
    bars = re.findall(r'<rect class="bar (\w+)"[^>]*data-minute="(\d+)" data-count="(\d+)"', drawn)
    assert bars == [("succeeded", "10", "1"), ("succeeded", "59", "3"), ("dead", "59", "2")]
    assert "12:30 UTC: 2 dead" in drawn  # the tooltip of the last minute's dead
    # the axis: every quarter hour (11:45, 12:00, 12:15, 12:30), and the legend's totals
    assert re.findall(r'class="tick x"[^>]*>([\d:]+)<', drawn) == [
        "11:45",
        "12:00",
        "12:15",
        "12:30",
    ]
    assert ">succeeded 4<" in drawn and ">dead 2<" in drawn


def test_lines_leave_a_gap_where_a_minute_has_no_value() -> None:
    window = series.Window(now=NOW, minutes=60)
    depth: list[int | None] = [None] * 60
    depth[0:3] = [1, 2, 3]
    depth[10] = 5  # alone: a dot
    depth[20:22] = [0, 0]
    drawn = str(
        svg.lines({"default": depth, "bulk": [None] * 60}, window=window, title="t", chart_id="d")
    )
    assert drawn.count("<polyline") == 2 and drawn.count("<circle") == 1
    assert 'data-series="default" data-points="6" data-last="0"' in drawn
    assert 'data-series="bulk" data-points="0" data-last=""' in drawn


def test_durations_read_in_the_unit_that_suits_them() -> None:
    assert [svg.duration(s) for s in (0.0123, 1.25, 42, 600, 7200)] == [
        "12ms",
        "1.2s",
        "42s",
        "10m",
        "2.0h",
    ]


def test_spans_place_each_row_on_a_time_axis_and_escape_labels() -> None:
    rows = [
        svg.Span("0 step <b>", NOW, NOW + timedelta(seconds=10), "done", "step"),
        svg.Span("1 timer sleep", NOW + timedelta(seconds=10), None, "running", "timer"),
    ]
    drawn = str(
        svg.spans(rows, start=NOW, end=NOW + timedelta(seconds=20), title="w", chart_id="s")
    )
    assert 'data-rows="2"' in drawn and "<b>" not in drawn and "&lt;b&gt;" in drawn
    widths = [float(w) for w in re.findall(r'<rect x="[\d.]+" y="\d+" width="([\d.]+)"', drawn)]
    assert widths[0] == pytest.approx(widths[1])  # 10 s each (the open one runs to the end)
    assert "to now" in drawn and 'data-outcome="running"' in drawn
    # ticks at a round step: 20 s gives 5 s steps, labelled to the second
    assert re.findall(r'class="tick x"[^>]*>([\d:]+)<', drawn)[:2] == ["12:30:40", "12:30:45"]


def test_a_short_timeline_is_labelled_by_offsets_and_an_empty_one_says_none() -> None:
    rows = [svg.Span("0 step a", NOW, NOW + timedelta(seconds=1), "done", "step", "0 step x.a")]
    drawn = str(
        svg.spans(rows, start=NOW, end=NOW + timedelta(seconds=1.5), title="w", chart_id="s")
    )
    assert re.findall(r'class="tick x"[^>]*>([^<]+)<', drawn)[:3] == ["+0.0s", "+0.2s", "+0.4s"]
    assert "<title>0 step x.a: done," in drawn  # the tooltip names it whole
    empty = str(svg.spans([], start=NOW, end=NOW + timedelta(hours=1), title="b", chart_id="e"))
    assert 'data-rows="0"' in empty and ">none</text>" in empty
