"""The embedded default: valkey-server and SecantusDB started as local processes (dev, tests)."""

from .servers import ServerProcess, free_port, start_secantus, start_valkey

__all__ = ["ServerProcess", "free_port", "start_secantus", "start_valkey"]
