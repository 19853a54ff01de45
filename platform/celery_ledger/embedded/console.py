"""The operator console for the embedded stack: loopback only, a login always (extra ``console``).

Unless the environment names its own (``LEDGER_CONSOLE_USERS``), one operator login is made per
start with a random password, which reaches the console through its environment and the user
through the stack's env file (never a terminal).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigurationError
from .servers import LOOPBACK, ManagedProcess, app_env, free_port, private_dir, spawn, wait_http


@dataclass
class ConsoleProcess(ManagedProcess):
    port: int
    user: str | None  # None: the logins are the environment's own
    password: str | None
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def start_console(
    app_module: str,
    data_dir: Path,
    *,
    env: Mapping[str, str],
    port: int | None = None,
    ready_timeout: float = 30.0,
) -> ConsoleProcess:
    """``celery -A APP ledger console`` on 127.0.0.1; waits until it answers."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigurationError(
            "the console is not installed: pip install 'celery-ledger[console]'"
        ) from exc
    port = port or free_port()
    child_env = app_env(env)
    user = password = None
    if not child_env.get("LEDGER_CONSOLE_USERS"):
        user, password = "operator", secrets.token_urlsafe(18)
        child_env["LEDGER_CONSOLE_USERS"] = json.dumps(
            {user: {"password": password, "role": "operator"}}
        )
    child_env.setdefault("LEDGER_CONSOLE_SECRET", secrets.token_urlsafe(48))
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app_module,
        "ledger",
        "console",
        f"--host={LOOPBACK}",
        f"--port={port}",
    ]
    private_dir(data_dir)
    log_path = data_dir / "console.log"
    running = ConsoleProcess(port, user, password, log_path, spawn(argv, log_path, child_env))
    wait_http(
        running,
        f"{running.url}/login",
        what="the console",
        log_path=log_path,
        timeout=ready_timeout,
    )
    return running
