"""SecantusDB servers with authentication, started from a provisioned copy (a test-suite speed-up).

:func:`celery_ledger.embedded.servers.start_secantus` with a password starts the server twice:
once without ``--auth`` (behind a one-time TLS CA) to create the root user, then again with
``--auth``; with the stop in between that is about 4 s of a quiet machine (12 s on a busy one)
for each stack a test starts, and the suite starts well over a hundred. Here each test process
provisions one template that way, once; every later stack copies its stopped data directory
and starts once, directly with ``--auth`` (no unauthenticated window at all), then gives the
root user the password the stack asked for (``updateUser``), so each stack keeps its own random
password. What a test sees is the same: an authenticated server on its own port and data
directory, reachable only through the URL that carries that password.

The provisioning start itself stays covered where it is the subject: tests that call
``start_secantus`` directly (``test_least_privilege.py``, ``test_operations.py``,
``test_tls.py``) get the real one; only :class:`EmbeddedStack`'s ``start_servers`` (the
stacks of the fixtures and tests) is given :meth:`ProvisionedLedgers.start`.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

from pymongo import MongoClient

from celery_ledger.embedded.servers import ServerProcess, free_port, private_dir, start_secantus

TEMPLATE_PASSWORD = "template-password-0123456789abcdef"  # replaced in every copy


class ProvisionedLedgers:
    """Starts authenticated SecantusDB servers from one provisioned template (per process)."""

    def __init__(self, base: Path) -> None:
        self._base = base
        self._template: ServerProcess | None = None
        self._lock = threading.Lock()

    def _provisioned(self, ready_timeout: float) -> ServerProcess:
        with self._lock:
            if self._template is None:
                template = start_secantus(
                    self._base / "secantus-template",
                    password=TEMPLATE_PASSWORD,
                    ready_timeout=ready_timeout,
                )
                template.stop(timeout=30.0)  # waits for the exit: WiredTiger closes its files
                self._template = template
            return self._template

    def start(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        user: str | None = None,
        password: str | None = None,
        ready_timeout: float = 30.0,
        sync_on_commit: bool = True,
        tls_dir: Path | None = None,
    ) -> ServerProcess:
        """:func:`start_secantus`'s signature and result; the template's copy when it can be
        (a password for the default user, no TLS, the default sync), the real start otherwise."""
        if password is None or user not in (None, "admin") or tls_dir or not sync_on_commit:
            return start_secantus(
                data_dir,
                port=port,
                user=user,
                password=password,
                ready_timeout=ready_timeout,
                sync_on_commit=sync_on_commit,
                tls_dir=tls_dir,
            )
        template = self._provisioned(ready_timeout)
        private_dir(data_dir)
        shutil.copytree(template.data_dir / "db", data_dir / "db")
        port = port or free_port()
        argv = list(template.argv)  # the template's own command line, --auth last
        argv[argv.index("--port") + 1] = str(port)
        argv[argv.index("--storage-path") + 1] = str(data_dir / "db")
        template_url = template.url.replace(f":{template.port}/", f":{port}/")
        server = dataclasses.replace(
            template,
            port=port,
            url=template_url,
            data_dir=data_dir,
            argv=argv,
            log_path=data_dir / "secantus.log",
        )
        server.restart(ready_timeout)  # (the template's exited process is replaced by a new one)
        client: MongoClient[dict[str, Any]]
        with MongoClient(template_url, serverSelectionTimeoutMS=5000) as client:
            client.admin.command("updateUser", "admin", pwd=password)
        server.url = template_url.replace(TEMPLATE_PASSWORD, quote_plus(password), 1)
        return server
