"""Serving a task's fallback (the options of :mod:`celery_ledger.policies.fallback`).

The guard asks :meth:`Fallbacks.serve` when a fallback's trigger happens in an attempt; the
options are tried in order, and an option that cannot serve (no last good result, or one too
old; an alternate whose breaker is open or that fails) hands over to the next. The guard records
what was served. :meth:`Fallbacks.remember` keeps a task's good results for its ``LastGood``
options, in the ledger (so every worker serves the same last good result).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any

from .errors import CircuitOpen, LedgerError
from .policies.fallback import Alternate, Call, Fallback, LastGood, Option, Placeholder
from .runtime import Runtime

logger = logging.getLogger("celery_ledger.fallbacks")


@dataclass(frozen=True)
class Served:
    """A fallback's answer: the value, and which option gave it."""

    value: Any
    option: str


class Fallbacks:
    """Serves and feeds the fallbacks of one app's tasks."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def serve(
        self,
        fallback: Fallback,
        *,
        task: str,
        key: str,
        call: Call,
        sensitive: bool = False,
    ) -> Served | None:
        """The first option's answer that can be had, or None (then the job waits, retries or
        fails as it would without a fallback)."""
        for option in fallback.options:
            try:
                served = self._one(option, task=task, key=key, call=call, sensitive=sensitive)
            except CircuitOpen as exc:
                logger.info("fallback %s of %s not used: circuit %s open", option.label, task, exc)
                continue
            except Exception as exc:  # an option that fails hands over to the next
                # Its type only: the text may quote the arguments (a sensitive task's).
                logger.warning(
                    "fallback %s of %s failed (%s)", option.label, task, type(exc).__name__
                )
                continue
            if served is not None:
                return served
        return None

    def remember(
        self,
        fallback: Fallback,
        *,
        task: str,
        key: str,
        call: Call,
        stored: str,
        sensitive: bool = False,
    ) -> None:
        """Keep a good result (``stored``: its JSON as the record holds it, sealed for a
        sensitive task) for the task's ``LastGood`` options. Best effort: the job's success is
        recorded already, and a cache that missed one result serves the one before."""
        for option in fallback.options:
            if not isinstance(option, LastGood):
                continue
            try:
                cache_key = self._cache_key(option, key, call, sensitive)
                self.runtime.ledger.remember(task, cache_key, stored)
            except (LedgerError, KeyError, IndexError, ValueError, TypeError) as exc:
                logger.warning("last good result of %s not kept (%s)", task, type(exc).__name__)

    def _one(
        self,
        option: Option,
        *,
        task: str,
        key: str,
        call: Call,
        sensitive: bool,
    ) -> Served | None:
        if isinstance(option, Placeholder):
            return Served(option.value, option.label)
        if isinstance(option, Alternate):
            if option.breaker is None:
                return Served(option.call(call), option.label)
            with self.runtime.breakers[option.breaker]:  # open: CircuitOpen, the next option
                return Served(option.call(call), option.label)
        found = self.runtime.ledger.last_good(task, self._cache_key(option, key, call, sensitive))
        if found is None:
            return None
        stored, at = found
        if option.max_age_seconds is not None:
            age = (self.runtime.ledger.now() - at).total_seconds()
            if age > option.max_age_seconds:
                logger.info("last good result of %s is %.0fs old: not served", task, age)
                return None
        return Served(json.loads(self.runtime.sealer.open(stored)), option.label)

    def _cache_key(self, option: LastGood, key: str, call: Call, sensitive: bool) -> str:
        """The cache key as stored: a sensitive task's is a keyed digest (a key made from its
        arguments must not be readable in the cache, as its record's key is not)."""
        cache_key = option.cache_key(key, call)
        if not sensitive:
            return cache_key
        secret = self.runtime.settings.key_secret
        material = secret.get_secret_value().encode() if secret is not None else b""
        return "h:" + hmac.new(material, cache_key.encode(), hashlib.sha256).hexdigest()
