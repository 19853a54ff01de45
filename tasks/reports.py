"""Reports: a bulk rebuild of a daily report (default key: hash of the arguments)."""

from __future__ import annotations

import hashlib
import time

from .celery import app
from .effects import record_effect


@app.task(tier="bulk")
def rebuild_report(report: str, day: str) -> dict[str, str]:
    """Rebuild one report for one day (a few ms of CPU)."""
    digest = hashlib.sha256(f"{report}:{day}".encode()).hexdigest()
    time.sleep(0.005)
    record_effect("report", f"{report}:{day}")
    return {"report": report, "day": day, "digest": digest[:12]}
