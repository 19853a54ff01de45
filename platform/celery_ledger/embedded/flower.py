"""Flower for the embedded stack: loopback only, basic auth always (extra ``flower``).

Credentials are random per start unless given, and reach Flower through its environment
(``FLOWER_BASIC_AUTH``), not its command line. Flower still serves ``/metrics`` and
``/healthcheck`` without credentials (Flower 2.2, measured), hence the loopback address.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigurationError
from .servers import LOOPBACK, ManagedProcess, app_env, free_port, private_dir, spawn, wait_http


@dataclass
class FlowerProcess(ManagedProcess):
    port: int
    user: str
    password: str
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def start_flower(
    app_module: str,
    data_dir: Path,
    *,
    env: Mapping[str, str],
    port: int | None = None,
    user: str | None = None,
    password: str | None = None,
    ready_timeout: float = 30.0,
) -> FlowerProcess:
    """``celery -A APP flower`` on 127.0.0.1 with basic auth; waits until it answers."""
    try:
        import flower  # noqa: F401
    except ImportError as exc:
        raise ConfigurationError(
            "Flower is not installed: pip install 'celery-ledger[flower]'"
        ) from exc
    port = port or free_port()
    user = user or "flower"
    password = password or secrets.token_urlsafe(18)
    if ":" in user or "," in user or "," in password:
        raise ConfigurationError("Flower credentials may not contain ',' (nor ':' in the user)")
    child_env = {k: v for k, v in app_env(env).items() if not k.startswith("FLOWER_")}
    child_env["FLOWER_BASIC_AUTH"] = f"{user}:{password}"
    child_env["LEDGER_RESTORE_UNACKED"] = "false"  # as in compose: the workers restore
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app_module,
        "flower",
        f"--address={LOOPBACK}",
        f"--port={port}",
    ]
    private_dir(data_dir)
    log_path = data_dir / "flower.log"
    running = FlowerProcess(port, user, password, log_path, spawn(argv, log_path, child_env))
    wait_http(
        running,
        f"{running.url}/healthcheck",
        what="flower",
        log_path=log_path,
        timeout=ready_timeout,
    )
    return running
