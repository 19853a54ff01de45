"""The Celery settings and task options the ledger's guarantees depend on, and their check.

``create_app`` sets Celery's configuration; an app team may change it afterwards (``app.conf``,
a configuration module, a task's options). Most changes are theirs to make. These are not: each
would lose jobs, run code from the broker, or fail every job late, far from the line that did
it. A worker refuses to start with any of them, a producer refuses its first publish, and a
task declared with one is refused where it is declared, each with this module's reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kombu.serialization import prepare_accept_content
from kombu.transport import resolve_transport
from kombu.utils.imports import symbol_by_name

from .identity import template_problem
from .sentinel import is_sentinel_url

# Celery settings create_app pins, and why each matters. (Results are not Celery's to encode:
# the ledger's backend keeps them as JSON whatever result_serializer says.)
PINNED_SETTINGS: dict[str, str] = {
    "task_serializer": (
        "messages are JSON (a sensitive task's are sealed at each publish); a worker refuses"
        " any other, so every job would end dead"
    ),
    "accept_content": (
        "a worker takes JSON and sealed bodies only: pickle or yaml would run code sent to"
        " the broker, and without the sealed type every sensitive job would end dead"
    ),
    "broker_transport": (
        "celery-ledger's transport (or a subclass) dead-letters a message kombu cannot decode,"
        " which ends a worker on kombu's"
    ),
    "worker_consumer": (
        "celery-ledger's consumer (or a subclass) keeps a message it cannot run instead of"
        " dropping it"
    ),
}
# Transport options the ledger reads or sets for its own (the unacknowledged messages' keys the
# reconciler reads, the poison list the drain records). Others (visibility_timeout, ...) are
# the app's to change.
PINNED_TRANSPORT_OPTIONS = (
    "unacked_key",
    "unacked_index_key",
    "unacked_mutex_key",
    "ledger_poison_key",
    "ledger_restore_visible",
)
_CLASS_SETTINGS = ("broker_transport", "worker_consumer")
# kombu's Redis transport options that rename its lists (see conf_problems)
_KOMBU_LIST_NAMING = ("priority_steps", "sep", "global_keyprefix")
_SET_SETTINGS = ("accept_content",)


def pinned(conf: Mapping[str, Any]) -> dict[str, Any]:
    """What ``conf`` holds of the pinned settings (create_app's values, to check against)."""
    values = {name: conf.get(name) for name in PINNED_SETTINGS}
    options = conf.get("broker_transport_options") or {}
    values["broker_transport_options"] = {
        name: options[name] for name in PINNED_TRANSPORT_OPTIONS if name in options
    }
    return values


def conf_problems(conf: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """How ``conf`` departs from ``expected`` (:func:`pinned` of create_app's), one line each;
    nothing to check against (an app not made by create_app) is no problem."""
    if not expected:
        return []
    problems = []
    for name, why in PINNED_SETTINGS.items():
        want, have = expected.get(name), conf.get(name)
        if name in _CLASS_SETTINGS:
            same = _subclass_of(have, want, transport=name == "broker_transport")
        elif name in _SET_SETTINGS:  # (names or content types, in any order)
            try:
                same = prepare_accept_content(have or ()) == prepare_accept_content(want or ())
            except Exception:  # a serializer name kombu does not know (not installed)
                same = False
        else:
            same = have == want
        if not same:
            problems.append(f"{name}={have!r} (create_app sets {want!r}): {why}")
    options = conf.get("broker_transport_options") or {}
    changed = sorted(
        name
        for name, value in (expected.get("broker_transport_options") or {}).items()
        if options.get(name) != value
    )
    if changed:
        problems.append(
            f"broker_transport_options lost or changed {', '.join(changed)}, the keys the"
            " reconciler and the poison drain use: set an option of your own on it"
            " (app.conf.broker_transport_options['visibility_timeout'] = 600) instead of"
            " replacing it"
        )
    # The reconciler, the broker view and fair dispatch (fairness.py) read kombu's lists by
    # their default names: a message pushed to a list named otherwise would be looked for
    # where it is not, or fed to a list no worker reads
    renamed = sorted(name for name in _KOMBU_LIST_NAMING if name in options)
    if renamed:
        problems.append(
            f"broker_transport_options sets {', '.join(renamed)}: celery-ledger reads kombu's"
            " queue lists by their default names (priority steps 0, 3, 6, 9; no key prefix):"
            " remove them (a separate Redis database keeps apps apart: LEDGER_BROKER_URL)"
        )
    url = conf.get("broker_url")
    if isinstance(url, str) and is_sentinel_url(url) and not options.get("master_name"):
        problems.append(
            "broker_url lists sentinels but broker_transport_options has no master_name (the"
            " primary's name): set LEDGER_SENTINEL_MASTER"
        )
    protocol = conf.get("task_protocol")
    if protocol not in (None, 2):
        problems.append(
            f"task_protocol={protocol!r}: workers take Celery's message protocol 2 only (a"
            " protocol 1 message is quarantined as poison, never run)"
        )
    return problems


def task_problems(task: Any) -> list[str]:
    """Options of a ledger task (``@app.task(...)``, or a class's attributes) that break a
    guarantee, one line each."""
    name = getattr(task, "name", None) or getattr(task, "__name__", "?")
    problems = []
    if task.acks_late is not True:
        problems.append(
            f"task {name}: acks_late={task.acks_late!r}: a message is acknowledged only once its"
            " outcome is recorded; acknowledged early, a job handed back (a requeue, a warm"
            " shutdown, a ledger outage) or whose worker dies is lost"
        )
    if task.reject_on_worker_lost is not True:
        problems.append(
            f"task {name}: reject_on_worker_lost={task.reject_on_worker_lost!r}: a job whose"
            " pool process died must go back to its queue"
        )
    if task.serializer not in (None, "json"):
        problems.append(
            f"task {name}: serializer={task.serializer!r}: messages are JSON (sensitive=True"
            " seals them); workers refuse any other, so every job would end dead"
        )
    if task.ignore_result:
        problems.append(
            f"task {name}: ignore_result=True: the ledger keeps every job's result, and"
            " AsyncResult.get() would return None at once, before the job ran"
        )
    specs = {"idempotency_key": "key_spec", "tenant": "tenant_spec"}  # (as the task gives them)
    for option, method in specs.items():
        spec = getattr(task, method, None)
        template = spec() if callable(spec) else None
        problem = template_problem(template, task.run) if isinstance(template, str) else None
        if problem is not None:
            problems.append(f"task {name}: {option}: {problem}")
    for option, least in NUMBER_OPTIONS.items():
        value = getattr(task, option, None)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if value is not None and not (number and value >= least and value == value):
            at_least = "more than 0" if least > 0 else "0 or more"
            problems.append(f"task {name}: {option}={value!r}: a number of {at_least}")
    return problems


# A ledger task's numeric options and their least value (unset: the settings' default). A lease
# of 0 or less, say, would be lost as soon as it is taken: the body would run unfenced.
NUMBER_OPTIONS: dict[str, float] = {
    "lease_seconds": 1e-3,
    "heartbeat_seconds": 0,  # (0 turns the heartbeat off)
    "max_retries": 0,
    "retry_base_seconds": 0,
    "retry_cap_seconds": 0,
    "max_age_seconds": 1e-3,
    "deadline_seconds": 1e-3,
    "slo_seconds": 1e-3,
    "max_attempts": 1,
}


def _subclass_of(have: Any, want: Any, *, transport: bool) -> bool:
    if have == want:
        return True
    try:
        wanted = symbol_by_name(want)
        found = symbol_by_name(resolve_transport(have) if transport else have)
    except Exception:  # an alias or a path that does not import: not ours
        return False
    return isinstance(found, type) and isinstance(wanted, type) and issubclass(found, wanted)
