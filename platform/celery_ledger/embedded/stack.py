"""The whole embedded stack: broker, ledger and one worker process per tier (and Flower).

Authentication is on by default: random passwords per start for valkey and SecantusDB, carried
in the URLs of ``stack.env``. Flower (optional) binds 127.0.0.1 and requires basic auth.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from celery import Celery
from cryptography.fernet import Fernet

from ..routing import TIERS, queue_name
from ..sentinel import SentinelSettings, connection_options
from .console import ConsoleProcess, start_console
from .flower import FlowerProcess, start_flower
from .servers import (
    LOOPBACK,
    ManagedProcess,
    ServerProcess,
    ServerStartError,
    app_env,
    private_dir,
    redacted,
    spawn,
    start_secantus,
    start_valkey,
    tail,
)

DEFAULT_CONCURRENCY = {"critical": 1, "default": 2, "bulk": 1}


@dataclass
class WorkerProcess(ManagedProcess):
    """A ``celery worker`` we started for one tier (or set of queues)."""

    name: str
    queues: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)
    stop_timeout: ClassVar[float] = 20.0  # a warm shutdown lets running tasks finish

    def pool_pids(self) -> list[int]:
        """PIDs of the worker's pool processes (Linux: /proc)."""
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return [int(pid) for pid in text.split()]

    def kill(self) -> None:
        """SIGKILL the worker and its pool processes (a host crash)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait(10)


@dataclass
class EmbeddedStack:
    """Servers and workers started together; ``stop()`` ends every process it started."""

    app_module: str
    data_dir: Path
    broker: ServerProcess | None = None
    ledger: ServerProcess | None = None
    workers: list[WorkerProcess] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    auth: bool = True  # random passwords for valkey and SecantusDB
    flower: FlowerProcess | None = None
    console: ConsoleProcess | None = None
    # The namespace of the app's tier queues: its name, unless LEDGER_QUEUE_NAMESPACE is set.
    queue_namespace: str = ""

    def queues_of(self, *tiers: str) -> str:
        """The ``-Q`` list of these tiers' queues (every tier by default)."""
        return ",".join(queue_name(self.queue_namespace, tier) for tier in tiers or TIERS)

    @property
    def env(self) -> dict[str, str]:
        assert self.broker is not None and self.ledger is not None
        return {
            "LEDGER_BROKER_URL": self.broker.url,
            "LEDGER_MONGO_URI": self.ledger.url,
            "LEDGER_TTL_INDEX": "false",  # SecantusDB's TTL sweep blocks writes (Ledger.expire)
            **self.extra_env,
        }

    def start_servers(
        self, *, broker_port: int | None = None, ledger_port: int | None = None
    ) -> None:
        private_dir(self.data_dir)
        broker_password = secrets.token_hex(16) if self.auth else None
        ledger_password = secrets.token_hex(16) if self.auth else None
        self.broker = start_valkey(
            self.data_dir / "valkey", port=broker_port, password=broker_password
        )
        self.ledger = start_secantus(
            self.data_dir / "secantus", port=ledger_port, password=ledger_password
        )

    def start_flower(
        self, *, port: int | None = None, user: str | None = None, password: str | None = None
    ) -> FlowerProcess:
        """Flower on 127.0.0.1 with basic auth (random credentials unless given)."""
        self.flower = start_flower(
            self.app_module, self.data_dir, env=self.env, port=port, user=user, password=password
        )
        return self.flower

    def start_console(self, *, port: int | None = None) -> ConsoleProcess:
        """The operator console on 127.0.0.1 (a random operator login unless the environment
        names the logins)."""
        self.console = start_console(self.app_module, self.data_dir, env=self.env, port=port)
        return self.console

    def start_worker(
        self,
        queues: str,
        *,
        concurrency: int = 1,
        name: str | None = None,
        pool: str = "prefork",
        extra_args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        wait: bool = True,
    ) -> WorkerProcess:
        name = name or f"{queues.replace(',', '-')}-{len(self.workers)}@{LOOPBACK}"
        log_path = self.data_dir / f"worker-{name.split('@')[0]}.log"
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app_module,
            "worker",
            "-Q",
            queues,
            "-n",
            name,
            "-c",
            str(concurrency),
            "-P",
            pool,
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *extra_args,
        ]
        worker_env = app_env(self.env, env or {})
        process = spawn(argv, log_path, worker_env)
        worker = WorkerProcess(name, queues, argv, worker_env, log_path, process)
        self.workers.append(worker)
        if wait:
            self.wait_ready(worker)
        return worker

    def start_tier_workers(
        self, concurrency: Mapping[str, int] = DEFAULT_CONCURRENCY, *, task_events: bool = False
    ) -> None:
        """A worker per tier. ``task_events``: they send task events from the start (``-E``),
        which Flower shows: without gossip and heartbeats a worker has no event dispatcher
        for Flower's ``enable_events`` to turn on later."""
        # LEDGER_METRICS_PORT=P: the tier workers serve /metrics on P, P+1, P+2.
        metrics_port = self.extra_env.get("LEDGER_METRICS_PORT") or os.environ.get(
            "LEDGER_METRICS_PORT"
        )
        for index, tier in enumerate(TIERS):
            env = {}
            if metrics_port:
                env["LEDGER_METRICS_PORT"] = str(int(metrics_port) + index)
                env["LEDGER_METRICS_ADDRESS"] = os.environ.get("LEDGER_METRICS_ADDRESS", LOOPBACK)
            self.start_worker(
                self.queues_of(tier),
                concurrency=concurrency.get(tier, 1),
                name=f"{tier}@{LOOPBACK}",
                env=env,
                wait=False,
                extra_args=("-E",) if task_events else (),
            )
        for worker in self.workers:
            self.wait_ready(worker)

    def wait_ready(self, worker: WorkerProcess, timeout: float = 60.0) -> None:
        assert self.broker is not None
        env = self.env
        probe = Celery(broker=env["LEDGER_BROKER_URL"], set_as_current=False)
        probe.conf.broker_transport_options = connection_options(  # (through Sentinel)
            SentinelSettings.model_validate(  # (the environment's strings, as settings read)
                {
                    "broker_url": env["LEDGER_BROKER_URL"],
                    "sentinel_master": env.get("LEDGER_SENTINEL_MASTER"),
                    "sentinel_username": env.get("LEDGER_SENTINEL_USERNAME"),
                    "sentinel_password": env.get("LEDGER_SENTINEL_PASSWORD"),
                    "sentinel_tls": env.get("LEDGER_SENTINEL_TLS", "false"),
                }
            )
        )
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not worker.alive():
                    raise ServerStartError(f"worker {worker.name} exited:\n{tail(worker.log_path)}")
                if probe.control.ping(destination=[worker.name], timeout=0.5):
                    return
            raise ServerStartError(
                f"worker {worker.name} not ready in {timeout}s:\n{tail(worker.log_path)}"
            )
        finally:
            probe.close()

    def stop(self) -> None:
        if self.flower is not None:
            self.flower.stop()
            self.flower = None
        if self.console is not None:
            self.console.stop()
            self.console = None
        for worker in self.workers:
            with contextlib.suppress(ProcessLookupError, OSError):
                os.kill(worker.pid, signal.SIGTERM)
        for worker in self.workers:
            worker.stop()
        self.workers.clear()
        for server in (self.ledger, self.broker):
            if server is not None:
                server.stop()

    @property
    def env_file(self) -> Path:
        return self.data_dir / "stack.env"

    def write_env_file(self) -> Path:
        """Write ``export`` lines of :attr:`env`, and of Flower's and the console's logins, to
        ``<data dir>/stack.env``, readable by its owner only: the passwords never reach a
        terminal or its scrollback. ``source`` it in another shell, and the commands that
        follow have every credential they need (see :meth:`credentials`)."""
        lines = ["# celery-ledger embedded stack: source this file to publish to it"]
        exported = {**self.env, **self.credentials()}
        lines += [f"export {name}={shlex.quote(value)}" for name, value in exported.items()]
        path = self.env_file
        path.unlink(missing_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write("\n".join(lines) + "\n")
        return path

    def credentials(self) -> dict[str, str]:
        """The logins of Flower and the console, as variables: ``FLOWER_BASIC_AUTH``
        (Flower's own, ``user:password``: ``curl -u "$FLOWER_BASIC_AUTH" "$STACK_FLOWER_URL"``)
        and ``LEDGER_CONSOLE_USERS`` (the setting: a ``ledger console`` started in that shell
        takes the same login), with ``STACK_*`` copies to read at a glance. Names outside
        ``LEDGER_*`` are no settings (the app refuses unknown ``LEDGER_*`` names) and no
        Flower options (Flower refuses unknown ``FLOWER_*`` names)."""
        found: dict[str, str] = {}
        if self.flower is not None:
            found["FLOWER_BASIC_AUTH"] = f"{self.flower.user}:{self.flower.password}"
            found["STACK_FLOWER_URL"] = self.flower.url
            found["STACK_FLOWER_USER"] = self.flower.user
            found["STACK_FLOWER_PASSWORD"] = self.flower.password
        if self.console is not None:
            found["STACK_CONSOLE_URL"] = self.console.url
            if self.console.user is not None and self.console.password is not None:
                found["LEDGER_CONSOLE_USERS"] = json.dumps(
                    {self.console.user: {"password": self.console.password, "role": "operator"}}
                )
                found["STACK_CONSOLE_USER"] = self.console.user
                found["STACK_CONSOLE_PASSWORD"] = self.console.password
        return found

    def describe(self) -> str:
        """What runs where, without a password (they are in :meth:`write_env_file`'s file)."""
        lines = []
        for server in (self.broker, self.ledger):
            if server is not None:
                lines.append(f"{server.name:<10} pid {server.pid:<7} {redacted(server.url)}")
        for worker in self.workers:
            lines.append(
                f"{'worker':<10} pid {worker.pid:<7} {worker.name} queues={worker.queues}"
                f" log={worker.log_path}"
            )
            if worker.env.get("LEDGER_METRICS_PORT"):
                port = worker.env["LEDGER_METRICS_PORT"]
                lines.append(f"{'':<22}metrics http://{LOOPBACK}:{port}/metrics")
        if self.flower is not None:
            lines.append(
                f"{'flower':<10} pid {self.flower.pid:<7} {self.flower.url}"
                f"  user={self.flower.user} (password in {self.env_file})"
            )
        if self.console is not None:
            login = (
                f"user={self.console.user} (password in {self.env_file})"
                if self.console.user is not None
                else "logins from LEDGER_CONSOLE_USERS"
            )
            lines.append(f"{'console':<10} pid {self.console.pid:<7} {self.console.url}  {login}")
        return "\n".join(lines)


@contextlib.contextmanager
def running_stack(
    app_module: str,
    data_dir: Path,
    *,
    queue_namespace: str = "",
    workers: bool = True,
    broker_port: int | None = None,
    ledger_port: int | None = None,
    concurrency: Mapping[str, int] = DEFAULT_CONCURRENCY,
    auth: bool = True,
    flower: bool = False,
    flower_port: int | None = None,
    flower_user: str | None = None,
    flower_password: str | None = None,
    console: bool = False,
    console_port: int | None = None,
) -> Iterator[EmbeddedStack]:
    """Start the stack, set ``LEDGER_*`` in this process's environment, stop it all on exit.

    The stack also signs its messages and can run sensitive tasks, as production does (with
    or without ``auth``, which is about the servers' passwords): the keys it needs and the
    environment does not set come from :func:`stack_keys`.
    """
    stack = EmbeddedStack(app_module, data_dir, auth=auth, queue_namespace=queue_namespace)
    private_dir(data_dir)
    keys = stack_keys(data_dir)
    stack.extra_env.update({k: v for k, v in keys.items() if k not in os.environ})
    saved = {
        name: os.environ.get(name)
        for name in (
            "LEDGER_BROKER_URL",
            "LEDGER_MONGO_URI",
            "LEDGER_TTL_INDEX",
            *stack.extra_env,
        )
    }
    try:
        stack.start_servers(broker_port=broker_port, ledger_port=ledger_port)
        os.environ.update(stack.env)
        if workers:
            stack.start_tier_workers(concurrency, task_events=flower)
        if flower:
            stack.start_flower(port=flower_port, user=flower_user, password=flower_password)
        if console:
            stack.start_console(port=console_port)
        yield stack
    finally:
        stack.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


STACK_KEYS = ("LEDGER_SIGNING_KEYS", "LEDGER_ENCRYPTION_KEYS", "LEDGER_KEY_SECRET")


def stack_keys(data_dir: Path) -> dict[str, str]:
    """The stack's message-signing key, Fernet key and key secret, made on its first start and
    kept in ``<data dir>/stack-keys.json`` (0600): the data they sealed outlives a restart, as
    the servers' data does. Production sets its own (``.env``, a secret store)."""
    path = data_dir / "stack-keys.json"
    try:
        found = json.loads(path.read_text())
        if isinstance(found, dict) and all(isinstance(found.get(k), str) for k in STACK_KEYS):
            return {k: found[k] for k in STACK_KEYS}
    except (OSError, ValueError):
        pass
    keys = {
        "LEDGER_SIGNING_KEYS": json.dumps([secrets.token_hex(32)]),
        "LEDGER_ENCRYPTION_KEYS": json.dumps([Fernet.generate_key().decode()]),
        "LEDGER_KEY_SECRET": secrets.token_hex(32),
    }
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(json.dumps(keys))
    return keys
