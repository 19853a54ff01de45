"""A periodic entry's policy: which of the slots it missed run, what a slot does while the
previous run still runs, when in its slot a run starts, and the range of time it runs in.

Pure decisions on slots (unix seconds, the broker's clock) that the schedulers read;
``schedules.py`` carries them out. The names follow Temporal's schedules, the bar an app team
compares with: catch-up (with a window), overlap, jitter, start and end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from ..errors import ConfigurationError


class CatchUp(StrEnum):
    """What runs of the slots that passed while no scheduler fired (downtime, an outage)."""

    SKIP = "skip"  # none: the next slot runs when due
    LATEST = "latest"  # the latest missed slot, once (the default)
    ALL = "all"  # every missed slot within the catch-up window, oldest first


class Overlap(StrEnum):
    """What a slot does while the run of the previous slot sent is still running."""

    ALLOW_ALL = "allow_all"  # it runs too (the default: Celery's behaviour)
    SKIP = "skip"  # it is skipped (counted)
    BUFFER_ONE = "buffer_one"  # it runs once the previous ends; a further one meanwhile skips


OverlapVerdict = Literal["send", "skip", "buffer"]
RangeVerdict = Literal["before", "within", "after"]


@dataclass(frozen=True)
class SchedulePolicy:
    """An entry's policy (``beat_schedule`` entries take it as ``"policy"``, a
    ``SchedulePolicy`` or a dict of its fields; ``app.periodic`` takes its fields)."""

    catch_up: CatchUp = CatchUp.LATEST
    # Missed slots older than this are skipped whatever ``catch_up`` says
    catch_up_window_seconds: float = 24 * 3600.0
    # A slot fired later than this after it was due counts as missed: the ordinary delay of a
    # scheduler's pass, or of a takeover of its lease (10 s), stays well under it
    late_after_seconds: float = 60.0
    overlap: Overlap = Overlap.ALLOW_ALL
    # Each run starts up to this long after its slot: a fixed fraction of it per (entry,
    # slot), the same whichever scheduler sends it, so a fleet of entries due at one instant
    # spreads out and a duplicate send is still the same job
    jitter_seconds: float = 0.0
    start: datetime | None = None  # no slot before it runs
    end: datetime | None = None  # no slot after it runs

    def __post_init__(self) -> None:
        for name, kind in (("catch_up", CatchUp), ("overlap", Overlap)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                allowed = ", ".join(repr(v.value) for v in kind)
                raise ConfigurationError(
                    f"schedule policy: {name}={value!r} is not one of {allowed}"
                ) from None
        for name in ("catch_up_window_seconds", "late_after_seconds", "jitter_seconds"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"schedule policy: {name} must be >= 0, not {value!r}")
        for name in ("start", "end"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, datetime) or value.tzinfo is None):
                raise ConfigurationError(
                    f"schedule policy: {name} must be an aware datetime, not {value!r}"
                )
        if self.start is not None and self.end is not None and self.end <= self.start:
            raise ConfigurationError("schedule policy: end must come after start")

    @classmethod
    def of(cls, value: SchedulePolicy | Mapping[str, Any] | None) -> SchedulePolicy:
        """The policy a ``beat_schedule`` entry names (the default one if none)."""
        if value is None:
            return DEFAULT_POLICY
        if isinstance(value, SchedulePolicy):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ConfigurationError(
                    f"schedule policy: unknown {', '.join(unknown)}"
                    f" (known: {', '.join(sorted(known))})"
                )
            return cls(**value)
        raise ConfigurationError(
            f"schedule policy: a SchedulePolicy or a dict, not {type(value).__name__}"
        )

    def describe(self) -> str:
        """One line for ``ledger schedules list`` (only what differs from the default)."""
        parts = [
            f"{f.name}={_text(getattr(self, f.name))}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(DEFAULT_POLICY, f.name)
        ]
        return ", ".join(parts) or "default"


DEFAULT_POLICY = SchedulePolicy()


def _text(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    return str(value)


def _instant(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def in_range(policy: SchedulePolicy, slot: float) -> RangeVerdict:
    """Where ``slot`` falls against the policy's start and end (both included)."""
    start, end = _instant(policy.start), _instant(policy.end)
    if start is not None and slot < start:
        return "before"
    if end is not None and slot > end:
        return "after"
    return "within"


def jitter_of(policy: SchedulePolicy, entry: str, slot: float) -> float:
    """How long after its slot the run of ``entry`` for ``slot`` starts: a hash of the two,
    so every scheduler (and a second send of the same slot) says the same."""
    if policy.jitter_seconds <= 0:
        return 0.0
    digest = hashlib.blake2b(f"{entry}@{slot:.0f}".encode(), digest_size=8).digest()
    return policy.jitter_seconds * int.from_bytes(digest, "big") / 2**64


def catch_up(
    policy: SchedulePolicy, due: Sequence[float], now: float
) -> tuple[list[float], list[float]]:
    """Of the slots ``due`` now (oldest first: the one a scheduler is firing, and those that
    passed after it unfired), which to send and which to skip. A slot due no longer ago than
    ``late_after_seconds`` is on time and is sent; the others are missed, and ``catch_up``
    (within its window) says which of them run."""
    on_time = [slot for slot in due if now - slot <= policy.late_after_seconds]
    missed = [slot for slot in due if now - slot > policy.late_after_seconds]
    within = [slot for slot in missed if now - slot <= policy.catch_up_window_seconds]
    if policy.catch_up is CatchUp.ALL:
        chosen = within
    elif policy.catch_up is CatchUp.LATEST and within and not on_time:
        chosen = within[-1:]  # (a slot on time is later than any missed one: it stands for them)
    else:
        chosen = []
    send = sorted({*chosen, *on_time})
    sending = set(send)
    return send, [slot for slot in due if slot not in sending]


def overlap(policy: SchedulePolicy, *, previous_running: bool, buffered: bool) -> OverlapVerdict:
    """What a slot due now does, given whether the run of the entry's previous slot sent is
    still running, and whether a slot of the entry is buffered already."""
    if not previous_running or policy.overlap is Overlap.ALLOW_ALL:
        return "send"
    if policy.overlap is Overlap.BUFFER_ONE and not buffered:
        return "buffer"
    return "skip"


__all__ = [
    "DEFAULT_POLICY",
    "CatchUp",
    "Overlap",
    "SchedulePolicy",
    "catch_up",
    "in_range",
    "jitter_of",
    "overlap",
]
