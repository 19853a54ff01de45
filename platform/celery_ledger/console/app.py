"""The operator console: overview, jobs, dead letters, breakers, workflows, the audit trail.

How it is built, and why:

- Starlette with Jinja2 templates rendered on the server: a page is HTML the moment it
  arrives, a form post is a plain HTTP POST, and nothing needs a JavaScript build step or
  fetches a library at run time. One small script of our own (``static/console.js``) refreshes
  the overview's panels and asks before destructive actions; the page works without it.
- Charts (the overview's last hour, a workflow's timeline) are SVG drawn here (``svg``) from
  numbers bucketed by pure functions (``series``, ``timeline``): no charting script, nothing
  the Content-Security-Policy has to allow, and a test can count their bars.
- It reads and acts through the library, never its own queries: ``operations`` (audited, as
  the CLI's), ``health``, ``DeadLetters``, ``Ledger``, the workflow handle.
- Security: every page needs a login (``LEDGER_CONSOLE_USERS``; no default user, and no console
  without one); the session is a signed, HTTP-only, same-site cookie; every action is a POST
  carrying the session's CSRF token (checked in constant time); a viewer reads, only an operator
  acts; a sensitive task's result, arguments and step results are never shown, as in the CLI; a
  strict Content-Security-Policy allows only our own script and style; audits say who.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .. import audit, operations
from ..crypto import Sealer
from ..deadletter import PURGE_LIMIT, group_of, since_of
from ..errors import ConfigurationError, LedgerError, LedgerUnavailable, WorkflowError
from ..identity import derive_task_id
from ..ledger.record import LedgerRecord
from ..schedules import fleet_state
from . import svg, timeline
from .overview import OverviewData

HERE = Path(__file__).parent
SESSION_COOKIE = "ledger_console"
SESSION_SECONDS = 8 * 3600
OVERVIEW_CACHE_SECONDS = 3.0
LIST_LIMIT = 1000
MAX_FORM_FIELDS = PURGE_LIMIT + 20  # a purge's confirmation carries every id it lists
SEALED = "[sealed: sensitive task]"

Handler = Callable[[Request], Awaitable[Response]]


def actor(user: str) -> audit.Actor:
    """How the audit trail names a console user."""
    return audit.Actor.of(user, "console")


class Forbidden(Exception):
    """The request may not do this (no CSRF token, or not an operator)."""


def create_console(app: Any) -> Starlette:
    """The console's ASGI app for ``app`` (a celery-ledger app)."""
    settings = app.settings
    users = dict(settings.console_users)
    if not users:
        raise ConfigurationError(
            "the console needs at least one login, and LEDGER_CONSOLE_USERS names none.\n"
            'Set it: export LEDGER_CONSOLE_USERS=\'{"alice": {"password": "<12+ characters>",'
            ' "role": "operator"}}\' (roles: viewer, operator)'
        )
    secret = (
        settings.console_secret.get_secret_value()
        if settings.console_secret is not None
        else secrets.token_urlsafe(48)
    )
    console = _Console(app, users, secret)
    app.runtime.clock_reports.role = "console"  # its entry in the fleet's clock book
    routes = [
        Route("/login", console.login_page, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/logout", console.logout, methods=["POST"]),
        Route("/", console.page(console.overview), methods=["GET"]),
        Route("/jobs", console.page(console.jobs), methods=["GET"]),
        Route("/jobs/{record_id:path}", console.page(console.job), methods=["GET"]),
        Route("/dead", console.page(console.dead), methods=["GET"]),
        Route("/dead/group/{fingerprint}", console.page(console.dead_group), methods=["GET"]),
        Route("/dead/replay", console.action(console.replay), methods=["POST"]),
        Route("/dead/purge", console.action(console.purge), methods=["POST"]),
        Route("/breakers", console.page(console.breakers), methods=["GET"]),
        Route("/breakers/{verb}", console.action(console.force_breaker), methods=["POST"]),
        Route("/workflows", console.page(console.workflows), methods=["GET"]),
        Route("/workflows/{workflow_id}", console.page(console.workflow), methods=["GET"]),
        Route(
            "/workflows/{workflow_id}/{verb}",
            console.action(console.workflow_action),
            methods=["POST"],
        ),
        Route("/schedules", console.page(console.schedules), methods=["GET"]),
        Route("/schedules/{verb}", console.action(console.schedule_action), methods=["POST"]),
        Route("/audit", console.page(console.audit_trail), methods=["GET"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = [
        Middleware(
            SessionMiddleware,
            secret_key=secret,
            session_cookie=SESSION_COOKIE,
            max_age=SESSION_SECONDS,
            same_site="strict",
            https_only=settings.console_https_only,
        )
    ]
    return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders), *middleware])


SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


class SecurityHeaders:
    """Adds the console's security headers to every response (a plain ASGI middleware)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


class _Console:
    """The console's pages and actions over one app."""

    def __init__(self, app: Any, users: dict[str, Any], secret: str) -> None:
        self.app = app
        self.users = users
        self._secret = secret.encode()
        self._failures: dict[str, list[float]] = {}  # login failures by user, recent
        self._lock = threading.Lock()  # the overview's cache
        self._login_lock = threading.Lock()
        self.templates = Environment(
            loader=FileSystemLoader(HERE / "templates"),
            autoescape=select_autoescape(["html"]),
        )
        self.templates.filters["when"] = _when
        self.templates.filters["ago"] = _ago
        self.templates.filters["spark"] = _spark
        self.templates.filters["seconds"] = lambda v: "-" if v is None else svg.duration(v)
        self.templates.filters["as_json"] = lambda value: json.dumps(value, indent=2, default=str)
        self.templates.filters["brief"] = lambda value: json.dumps(value, default=str)[:300]
        self._overview: tuple[float, dict[str, Any]] | None = None
        self.data = OverviewData(app)

    # -- plumbing --------------------------------------------------------------------------------

    def render(
        self, request: Request, name: str, status_code: int = 200, **context: Any
    ) -> Response:
        session = request.session
        html = self.templates.get_template(name).render(
            user=session.get("user"),
            role=session.get("role"),
            csrf=session.get("csrf", ""),
            path=request.url.path,
            **context,
        )
        return HTMLResponse(html, status_code=status_code)

    def missing(self, request: Request, what: str) -> Response:
        return self.render(request, "missing.html", status_code=404, what=what)

    def _tag(self, password: str) -> str:
        """A keyed tag of a login's password: a session ends when its password changes."""
        return hmac.new(self._secret, password.encode(), hashlib.sha256).hexdigest()[:32]

    def _who(self, request: Request) -> Any | None:
        """The session's login as configured now (None: logged out, removed, its password
        changed, or too old): the role is the configuration's, a demotion counts at once."""
        session = request.session
        user = self.users.get(str(session.get("user", "")))
        started = session.get("since")
        if (
            user is None
            or not isinstance(started, int | float)
            or self.app.runtime.message_time() - started > SESSION_SECONDS  # (every replica's)
            or not _same(str(session.get("tag", "")), self._tag(user.password.get_secret_value()))
        ):
            session.clear()
            return None
        session["role"] = user.role
        return user

    def page(self, view: Callable[[Request], Any]) -> Handler:
        async def handler(request: Request) -> Response:
            if self._who(request) is None:
                return RedirectResponse(f"/login?next={request.url.path}", status_code=303)
            return await _guarded(view, request)

        return handler

    def action(self, view: Callable[[Request, FormData], Any]) -> Handler:
        async def handler(request: Request) -> Response:
            user = self._who(request)
            if user is None:
                return HTMLResponse("log in first", status_code=401)
            form = await request.form(max_fields=MAX_FORM_FIELDS)
            if not _same(str(form.get("csrf", "")), str(request.session.get("csrf", ""))):
                return HTMLResponse("refused: the form's CSRF token is missing or wrong", 403)
            if user.role != "operator":
                return HTMLResponse("refused: only an operator may act (you are a viewer)", 403)
            return await _guarded(view, request, form)

        return handler

    # -- login -----------------------------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        token = request.session.setdefault("login_csrf", secrets.token_urlsafe(32))
        return self.render(
            request, "login.html", login_csrf=token, next=_local(request.query_params.get("next"))
        )

    async def login(self, request: Request) -> Response:
        form = await request.form()
        session = request.session
        if not _same(str(form.get("csrf", "")), str(session.get("login_csrf", ""))):
            return HTMLResponse("refused: the form's CSRF token is missing or wrong", 403)
        name, password = str(form.get("user", "")), str(form.get("password", ""))
        if self._throttled(name):
            return HTMLResponse(
                "too many failed logins for this user: wait a few minutes", status_code=429
            )
        user = self.users.get(name)
        # Compared in constant time, against a dummy for unknown names too.
        expected = user.password.get_secret_value() if user else secrets.token_urlsafe(16)
        if user is None or not _same(password, expected):
            self._failed(name)
            return self.render(
                request,
                "login.html",
                status_code=401,
                error="wrong user or password",
                next="/",
                login_csrf=session.get("login_csrf", ""),
            )
        session.clear()
        session.update(
            user=name,
            role=user.role,
            csrf=secrets.token_urlsafe(32),
            tag=self._tag(expected),
            since=int(self.app.runtime.message_time()),
        )
        return RedirectResponse(_local(str(form.get("next", "/"))), status_code=303)

    def _failed(self, name: str) -> None:
        with self._login_lock:
            self._failures.setdefault(name, []).append(time.monotonic())

    def _throttled(self, name: str) -> bool:
        """Five failed logins of one user within five minutes hold its logins until they age."""
        with self._login_lock:
            recent = [t for t in self._failures.get(name, []) if time.monotonic() - t < 300]
            self._failures[name] = recent
            return len(recent) >= 5

    async def logout(self, request: Request) -> Response:
        form = await request.form()
        if _same(str(form.get("csrf", "")), str(request.session.get("csrf", ""))):
            request.session.clear()
        return RedirectResponse("/login", status_code=303)

    # -- overview --------------------------------------------------------------------------------

    def overview(self, request: Request) -> Response:
        with self._lock:  # one read of the ledger and broker per few seconds, however many tabs
            now = time.monotonic()
            if self._overview is None or now - self._overview[0] > OVERVIEW_CACHE_SECONDS:
                self._overview = (now, self.data.now())
            context = self._overview[1]
        if request.query_params.get("partial"):
            return self.render(request, "overview_panels.html", **context)
        return self.render(request, "overview.html", **context)

    # -- jobs ------------------------------------------------------------------------------------

    def jobs(self, request: Request) -> Response:
        params = request.query_params
        task, key, ident = params.get("task", ""), params.get("key", ""), params.get("id", "")
        tasks = sorted(name for name, t in self.app.tasks.items() if hasattr(t, "key_of"))
        error = None
        if ident or (task and key):
            record_id = ident.strip() or derive_task_id(task, key)
            try:
                doc = self.app.ledger.resolve(record_id)
            except LedgerError as exc:
                doc, error = None, f"ledger: {exc}"
            if doc is not None:
                return RedirectResponse(f"/jobs/{doc['_id']}", status_code=303)
            error = error or "no job with that id, or that task and key"
        return self.render(
            request, "jobs.html", tasks=tasks, task=task, key=key, ident=ident, error=error
        )

    def job(self, request: Request) -> Response:
        record_id = request.path_params["record_id"]
        ledger = self.app.ledger
        doc = ledger.resolve(record_id)
        if doc is None:
            return self.missing(request, f"job {record_id}")
        sensitive = self._sensitive(doc)
        try:
            # Built from the document as stored: a sealed result is never opened here.
            record = LedgerRecord.model_validate({**doc, "result": None} if sensitive else doc)
        except ValidationError:
            return self.missing(request, f"ledger job {record_id} (a plain Celery result)")
        progress = ledger.load_progress(str(doc["_id"]))
        steps = {
            name: {
                "result": SEALED if sensitive else step.get("result"),
                "skipped": step.get("skipped"),
                "atomic": step.get("atomic"),
            }
            for name, step in (progress.get("steps") or {}).items()
        }
        return self.render(
            request,
            "job.html",
            record=record,
            doc=doc,
            sensitive=sensitive,
            result=SEALED if sensitive else _opened(self.app, doc.get("result")),
            checkpoint=None if sensitive else progress.get("checkpoint"),
            has_checkpoint=progress.get("checkpoint") is not None,
            steps=steps,
            traceback=doc.get("traceback") or "",
        )

    def _sensitive(self, doc: dict[str, Any]) -> bool:
        """Whether a record's data must not be shown: a sensitive task's or workflow's, one
        whose result is sealed, or one of a task this console does not know (fail closed)."""
        name = str(doc.get("task"))
        task = self.app.tasks.get(name)
        workflow = self.app.workflows.get(name)
        if task is None and workflow is None:
            return True
        flagged = getattr(task, "sensitive", False) or getattr(
            getattr(workflow, "definition", None), "sensitive", False
        )
        result = doc.get("result")
        return bool(flagged) or (isinstance(result, str) and Sealer.is_sealed(result))

    # -- dead letters ----------------------------------------------------------------------------

    def _filters(self, source: Any) -> dict[str, str]:
        return {name: str(source.get(name) or "") for name in ("task", "reason", "since")}

    def _dead_docs(self, filters: dict[str, str]) -> list[dict[str, Any]]:
        return list(
            self.app.dead_letters.find(
                task=filters["task"] or None,
                reason=filters["reason"] or None,
                since=since_of(filters["since"] or None, self.app.dead_letters.ledger_now),
                limit=LIST_LIMIT,
            )
        )

    def dead(self, request: Request) -> Response:
        filters = self._filters(request.query_params)
        error = None
        try:
            docs = self._dead_docs(filters)
        except (LedgerError, ValueError) as exc:  # a bad "since", the ledger down: said so
            docs, error = [], str(exc)
        groups = self.app.dead_letters.groups(docs)
        return self.render(
            request,
            "dead.html",
            groups=groups,
            filters=filters,
            total=len(docs),
            limited=len(docs) >= LIST_LIMIT,
            error=error,
        )

    def dead_group(self, request: Request) -> Response:
        fingerprint = request.path_params["fingerprint"]
        filters = self._filters(request.query_params)
        docs = [d for d in self._dead_docs(filters) if group_of(d) == fingerprint]
        if not docs:
            return self.render(
                request, "missing.html", status_code=404, what="that dead-letter group"
            )
        group = self.app.dead_letters.groups(docs)[0]
        return self.render(request, "dead_group.html", group=group, docs=docs, filters=filters)

    def _selected(self, form: FormData) -> list[dict[str, Any]]:
        """The dead records a form names: ticked ids, or a whole group under its filters."""
        ids = [str(i) for i in form.getlist("ids")]
        if ids:
            found = [self.app.dead_letters.get(i) for i in ids]
            return [d for d in found if d is not None]
        fingerprint = str(form.get("fingerprint", ""))
        if fingerprint:  # every member of the group under its filters, however many
            filters = self._filters(form)
            members = self.app.dead_letters.each(
                task=filters["task"] or None,
                reason=filters["reason"] or None,
                since=since_of(filters["since"] or None, self.app.dead_letters.ledger_now),
            )
            return [d for d in members if group_of(d) == fingerprint][:PURGE_LIMIT]
        return []

    def replay(self, request: Request, form: FormData) -> Response:
        docs = self._selected(form)
        dry_run = form.get("dry_run") == "1"
        outcomes = list(
            operations.replay_dead(
                self.app, docs, actor=actor(request.session["user"]), dry_run=dry_run
            )
        )
        return self.render(
            request,
            "replayed.html",
            outcomes=outcomes,
            dry_run=dry_run,
            form_ids=[str(d["_id"]) for d in docs],
        )

    def purge(self, request: Request, form: FormData) -> Response:
        docs = self._selected(form)
        if form.get("confirm") != "yes":
            return self.render(
                request,
                "purge_confirm.html",
                docs=docs,
                fingerprint=str(form.get("fingerprint", "")),
                filters=self._filters(form),
            )
        filters = {"fingerprint": str(form.get("fingerprint", "")) or None, **self._filters(form)}
        purged = operations.purge_dead(
            self.app, docs, actor=actor(request.session["user"]), filters=filters
        )
        return self.render(request, "purged.html", purged=purged)

    # -- breakers --------------------------------------------------------------------------------

    def breakers(self, request: Request) -> Response:
        return self.render(request, "breakers.html", statuses=self.app.breakers.statuses())

    def force_breaker(self, request: Request, form: FormData) -> Response:
        name, verb = str(form.get("name", "")), request.path_params["verb"]
        if verb not in operations.BREAKER_ACTIONS or not name:
            return HTMLResponse("unknown action or breaker", status_code=404)
        operations.force_breaker(self.app, name, verb, actor=actor(request.session["user"]))
        return RedirectResponse("/breakers", status_code=303)

    # -- schedules -------------------------------------------------------------------------------

    def schedules(self, request: Request) -> Response:
        try:
            holder, foreign, states = fleet_state(self.app)
        except ConfigurationError as exc:  # (an entry that cannot run: workers refuse it too)
            return HTMLResponse(html.escape(str(exc)), status_code=500)
        return self.render(request, "schedules.html", states=states, holder=holder, foreign=foreign)

    def schedule_action(self, request: Request, form: FormData) -> Response:
        name, verb = str(form.get("name", "")), request.path_params["verb"]
        who = actor(request.session["user"])
        try:
            if verb == "pause":
                reason = str(form.get("reason", ""))[:200]
                operations.pause_schedule(self.app, name, actor=who, reason=reason)
            elif verb == "resume":
                operations.resume_schedule(self.app, name, actor=who)
            elif verb == "trigger":
                operations.trigger_schedule(self.app, name, actor=who)
            else:
                return HTMLResponse("unknown action", status_code=404)
        except ConfigurationError as exc:  # no such entry
            return HTMLResponse(html.escape(str(exc)), status_code=404)
        return RedirectResponse("/schedules", status_code=303)

    # -- workflows -------------------------------------------------------------------------------

    def workflows(self, request: Request) -> Response:
        status = request.query_params.get("status") or None
        log = self.app.workflow_engine.log
        return self.render(
            request,
            "workflows.html",
            docs=log.listing(status=status, limit=200),
            counts=log.count_by_status(),
            status=status or "",
        )

    def workflow(self, request: Request) -> Response:
        workflow_id = request.path_params["workflow_id"]
        handle = self.app.workflow_handle(workflow_id)
        try:
            status = handle.status()
        except WorkflowError:
            return self.render(
                request, "missing.html", status_code=404, what=f"workflow {workflow_id}"
            )
        events = handle.history()
        line = timeline.build(events, now=self.app.ledger.now())
        chart = None
        if line is not None:
            chart = svg.spans(
                [
                    svg.Span(
                        label=r.label,
                        start=r.start,
                        end=r.end,
                        outcome=r.outcome,
                        kind=r.kind,
                        detail=r.detail,
                    )
                    for r in line.rows
                ],
                start=line.start,
                end=line.end,
                title=f"{status.workflow}: {status.status}",
                chart_id="workflow-timeline",
            )
        return self.render(
            request,
            "workflow.html",
            status=status,
            events=events,
            id=workflow_id,
            chart=chart,
            marks=line.marks if line else [],
        )

    def workflow_action(self, request: Request, form: FormData) -> Response:
        workflow_id, verb = request.path_params["workflow_id"], request.path_params["verb"]
        handle = self.app.workflow_handle(workflow_id)
        who = actor(request.session["user"])
        if verb == "signal":
            try:
                payload = json.loads(str(form.get("payload") or "null"))
            except ValueError as exc:
                return HTMLResponse(f"the payload is not JSON: {exc}", status_code=400)
            handle.signal(str(form.get("name", "")), payload, actor=who)
        elif verb == "cancel":
            handle.cancel(str(form.get("reason", "")), actor=who)
        elif verb == "retry":
            step = str(form.get("from_step") or "").strip()
            if step and not step.isdigit():
                return HTMLResponse("from step: a position (a whole number)", status_code=400)
            handle.retry(int(step) if step else None, actor=who)
        else:
            return HTMLResponse("unknown action", status_code=404)
        return RedirectResponse(f"/workflows/{workflow_id}", status_code=303)

    # -- audit -----------------------------------------------------------------------------------

    def audit_trail(self, request: Request) -> Response:
        entries = audit.entries(self.app.ledger, limit=200)
        shown = ("action", "target", "actor", "outcome", "at", "ended_at")
        for entry in entries:
            entry["details"] = {k: v for k, v in entry.items() if k not in shown}
        return self.render(request, "audit.html", entries=entries)


async def _guarded(view: Callable[..., Any], *args: Any) -> Response:
    """Run a view in a thread (the library's calls block on MongoDB and Redis); a ledger or
    broker that does not answer is a page saying so, not a server error."""
    from starlette.concurrency import run_in_threadpool

    try:
        result: Response = await run_in_threadpool(view, *args)
    except (LedgerUnavailable, redis.RedisError) as exc:
        return _said(503, f"Not now: {exc}. Nothing was changed unless the audit trail says so.")
    except LedgerError as exc:  # refused (a workflow not in a state for it, say)
        return _said(409, f"Refused: {exc}")
    except ValueError as exc:  # a filter or field the console cannot read
        return _said(400, f"Not understood: {exc}")
    return result


def _said(status: int, text: str) -> Response:
    return HTMLResponse(f"<p>{html.escape(text[:600])}</p>", status_code=status)


def _opened(app: Any, stored: Any) -> str | None:
    """A stored result as text (sealed ones are never passed here)."""
    return None if stored is None else str(app.runtime.sealer.open(stored))


def _same(given: str, expected: str) -> bool:
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


def _local(target: str | None) -> str:
    """A redirect target on this site only (never another host: an open redirect)."""
    if not target or not target.startswith("/") or target[1:2] in ("/", "\\"):
        return "/"
    return target


def _when(value: Any) -> str:
    if isinstance(value, datetime):
        aware = value if value.tzinfo else value.replace(tzinfo=UTC)
        return aware.strftime("%Y-%m-%d %H:%M:%S UTC")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return "" if value is None else str(value)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _spark(values: list[int], width: int = 120, height: int = 24) -> Markup:
    """An inline SVG polyline of ``values`` (drawn here: no charting script needed)."""
    if not values:
        return Markup("")
    top = max(max(values), 1)
    step = width / max(len(values) - 1, 1)
    points = " ".join(
        f"{i * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}" for i, v in enumerate(values)
    )
    return Markup(
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}"'
        f' role="img" aria-label="{sum(values)} in {len(values)} minutes">'
        f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{points}"/></svg>'
    )
