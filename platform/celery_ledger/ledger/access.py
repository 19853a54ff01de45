"""Least-privilege MongoDB access for the ledger: the role its processes need, and its users.

Workers, beat, producers and the operators' CLI need to read and write the ledger's records,
groups and workflows, and to *append* to the audit trail. They need nothing else: no other
database (bar the app's own data, granted by name), no user or role management, no dropping a
collection, and no rewriting or deleting an audit entry (the trail is append-only; an action's
outcome is a second entry, not an update). The role below grants exactly that, per collection:
MongoDB's privileges add up, so a grant on the whole database would include the audit trail.

:func:`provision` creates (or updates) the role and a user with it, through an administrator's
connection; it is idempotent, and a deployment runs it once per start before the workers
(``celery ledger provision-users``; the compose file's ``mongo-init`` service). The
administrator's credentials stay with that one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pymongo import MongoClient
from pymongo.errors import OperationFailure, PyMongoError

from ..errors import ConfigurationError, StoreError
from .store import Ledger

ROLE = "celery_ledger_app"
# Collections beside the records (``<collection>_<suffix>``), and what the app does with them.
READ_WRITE = ("find", "insert", "update", "remove")
INDEXES = ("createIndex", "dropIndex", "listIndexes", "createCollection", "killCursors")
COMPANIONS: dict[str, tuple[str, ...]] = {
    "groups": READ_WRITE + INDEXES,
    "workflows": READ_WRITE + INDEXES,
    "workflow_events": READ_WRITE + INDEXES,
    "cache": READ_WRITE + INDEXES,  # fallbacks' last good results (policies/fallback.py)
    "objectives": READ_WRITE + INDEXES,  # latency objectives not yet settled (escalation.py)
    "triggers": READ_WRITE + INDEXES,  # change-stream triggers' places (triggers.py)
    # Append-only: read and add entries, never change or remove one, and no index either (a
    # TTL index would have the server delete the trail): :func:`provision` makes its indexes.
    "audit": ("find", "insert", "listIndexes", "createCollection", "killCursors"),
}


def privileges(database: str, collection: str) -> list[dict[str, Any]]:
    """The role's privileges on the ledger ``collection`` of ``database`` and its companions."""
    granted = [
        {
            "resource": {"db": database, "collection": collection},
            "actions": list(READ_WRITE + INDEXES),
        }
    ]
    granted += [
        {"resource": {"db": database, "collection": f"{collection}_{suffix}"}, "actions": list(a)}
        for suffix, a in COMPANIONS.items()
    ]
    # Listing collections (pymongo's index checks) is a database-wide action on names only.
    granted.append({"resource": {"db": database, "collection": ""}, "actions": ["listCollections"]})
    return granted


def provision(
    admin_uri: str,
    *,
    database: str,
    collection: str,
    user: str,
    password: str,
    app_databases: Sequence[str] = (),
    auth_database: str = "admin",
) -> None:
    """Create or update :data:`ROLE` and ``user`` (with that role, and ``readWrite`` on each of
    ``app_databases``: the app's own data, which atomic steps write) in ``auth_database``.

    Raises:
        ConfigurationError: the administrator may not manage users, or an argument is empty.
        StoreError: the server could not be reached or refused for another reason.
    """
    if not user or not password:
        raise ConfigurationError("the ledger's user needs a name and a password")
    roles: list[Any] = [{"role": ROLE, "db": auth_database}]
    roles += [{"role": "readWrite", "db": name} for name in app_databases]
    client: MongoClient[dict[str, Any]] = MongoClient(admin_uri, serverSelectionTimeoutMS=10_000)
    try:
        admin = client[auth_database]
        wanted = privileges(database, collection)
        _create_or_update(
            admin,
            {"createRole": ROLE, "privileges": wanted, "roles": []},
            {"updateRole": ROLE, "privileges": wanted, "roles": []},
        )
        _create_or_update(
            admin,
            {"createUser": user, "pwd": password, "roles": roles},
            {"updateUser": user, "pwd": password, "roles": roles},
        )
        Ledger.ensure_audit_indexes(client[database][f"{collection}_audit"], strict=True)
    except OperationFailure as exc:
        if exc.code == 13:  # Unauthorized
            raise ConfigurationError(
                "the administrator's connection may not manage roles and users"
                f" ({exc.details.get('errmsg') if exc.details else exc})"
            ) from None
        raise StoreError(f"provisioning the ledger's user failed: {exc}") from None
    except PyMongoError as exc:
        raise StoreError(f"provisioning the ledger's user failed: {exc}") from None
    finally:
        client.close()


def _create_or_update(db: Any, create: dict[str, Any], update: dict[str, Any]) -> None:
    try:
        db.command(create)
    except OperationFailure as exc:
        if exc.code not in (
            11000,
            51002,
            51003,
        ):  # DuplicateKey / RoleAlreadyExists / UserAlreadyExists
            raise
        db.command(update)
