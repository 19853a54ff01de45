"""The operator console: a web page over the ledger (``celery -A APP ledger console``).

See :mod:`celery_ledger.console.app` for how it is built and secured.
"""

from .app import create_console

__all__ = ["create_console"]
