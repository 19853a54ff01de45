"""Exponential backoff with jitter, in (fractional) seconds.

Written here rather than taken from ``celery.utils.time.get_exponential_backoff_interval``:
that helper draws with ``random.randrange`` and so only works in whole seconds (a sub-second
base fails), and it has no decorrelated jitter. Both variants follow the AWS architecture
blog's "Exponential Backoff and Jitter".
"""

from __future__ import annotations

import random
from typing import Literal

Jitter = Literal["full", "decorrelated", "none"]


def backoff_seconds(
    attempt: int,
    *,
    base_seconds: float,
    cap_seconds: float,
    jitter: Jitter = "full",
    previous_seconds: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """The delay before retry number ``attempt`` (0 for the first retry).

    ``full``: uniform in ``[0, min(cap, base * 2**attempt)]``.
    ``decorrelated``: uniform in ``[base, 3 * previous]``, capped (``previous`` defaults to base).
    ``none``: ``min(cap, base * 2**attempt)``.
    """
    if attempt < 0 or base_seconds < 0 or cap_seconds < 0:
        raise ValueError("attempt, base_seconds and cap_seconds must not be negative")
    draw = (rng or random).uniform
    # 2.0**1000 is still a finite float; a product past float range is inf, so min() caps it.
    ceiling = min(cap_seconds, base_seconds * 2.0 ** min(attempt, 1000))
    if jitter == "none":
        return ceiling
    if jitter == "full":
        return draw(0.0, ceiling)
    previous = base_seconds if previous_seconds is None else previous_seconds
    return min(cap_seconds, draw(base_seconds, max(base_seconds, previous * 3.0)))
