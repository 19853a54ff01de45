"""The operator console on real servers, driven in a real browser (Debian's chromium through
its chromedriver, with Selenium): log in, find a job, dry-run then replay a dead-letter group
and see the job succeed once, open and close a breaker, read the audit trail; and over plain
HTTP, the refusals: no session, no CSRF token, a viewer acting, an action by GET.

Screenshots of the overview, a job and a dead-letter group are taken on every run (into the
test's directory, and into ``$CONSOLE_SCREENSHOTS`` when set: how the README's are made).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from celery_ledger import State
from celery_ledger.embedded.servers import free_port
from tasks.effects import record_effect

from .helpers import effect_count, wait_for

OPERATOR = ("olive", "operator-pass-123")
VIEWER = ("vic", "viewer-pass-1234")
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    """The console of ``app``, served by uvicorn on a free loopback port: its URL."""
    import uvicorn

    from celery_ledger.console import create_console

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_console(app), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=20, what="the console listening")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def console(app: Any) -> Iterator[str]:
    with served(app) as url:
        yield url


def logged_in(url: str, user: tuple[str, str]) -> tuple[httpx.Client, str]:
    """An HTTP client with a session of ``user``, and the session's CSRF token."""
    client = httpx.Client(base_url=url, follow_redirects=False, timeout=20)
    page = client.get("/login").text
    token = re.search(r'name="csrf" value="([^"]+)"', page)
    assert token is not None
    response = client.post(
        "/login", data={"user": user[0], "password": user[1], "csrf": token[1], "next": "/"}
    )
    assert response.status_code == 303, response.text
    home = client.get("/breakers").text
    csrf = re.search(r'name="csrf" value="([^"]+)"', home)
    assert csrf is not None
    return client, csrf[1]


def test_every_page_needs_a_login_and_every_action_a_token_and_an_operator(
    app: Any, console: str, token: str
) -> None:
    name = f"console-{token}"
    breaker = app.breakers[name]
    breaker.record_success()  # the breaker has state: it is listed
    anonymous = httpx.Client(base_url=console, follow_redirects=False, timeout=20)
    for page in ("/", "/jobs", "/dead", "/breakers", "/workflows", "/audit", "/jobs/x"):
        response = anonymous.get(page)
        assert response.status_code == 303 and response.headers["location"].startswith("/login")
    assert anonymous.post("/breakers/open", data={"csrf": "x", "name": name}).status_code == 401
    # a wrong password is refused, and says nothing of which part was wrong
    page = anonymous.get("/login").text
    login_token = re.search(r'name="csrf" value="([^"]+)"', page)
    assert login_token is not None
    wrong = anonymous.post(
        "/login",
        data={"user": OPERATOR[0], "password": "guess-guess-guess", "csrf": login_token[1]},
    )
    assert wrong.status_code == 401 and "wrong user or password" in wrong.text
    # a login without the login form's token is refused
    forged = httpx.post(f"{console}/login", data={"user": OPERATOR[0], "password": OPERATOR[1]})
    assert forged.status_code == 403

    operator, csrf = logged_in(console, OPERATOR)
    assert operator.post("/breakers/open", data={"name": name}).status_code == 403
    forged = {"csrf": "forged", "name": name}
    assert operator.post("/breakers/open", data=forged).status_code == 403
    assert breaker.status().state.value == "closed"
    assert operator.get("/breakers/open").status_code == 405  # no action by GET
    assert operator.get("/dead/replay").status_code == 405

    viewer, viewer_csrf = logged_in(console, VIEWER)
    refused = viewer.post("/breakers/open", data={"csrf": viewer_csrf, "name": name})
    assert refused.status_code == 403 and "viewer" in refused.text
    assert breaker.status().state.value == "closed"

    done = operator.post("/breakers/open", data={"csrf": csrf, "name": name})
    assert done.status_code == 303
    assert breaker.status().state.value == "open" and breaker.status().forced
    entry = next(e for e in app.ledger.audit_entries(limit=50) if e["target"] == f"breaker:{name}")
    assert (entry["action"], entry["actor"], entry["outcome"]) == (
        "forced open",
        f"{OPERATOR[0]} [console]",
        "done",
    )
    breaker.reset()
    # pages say what the security headers say
    headers = operator.get("/").headers
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY"


class _Configured:
    """The test app as the console sees it, with other settings (its other parts shared)."""

    def __init__(self, app: Any, settings: Any) -> None:
        self._app = app
        self.settings = settings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._app, name)


def _login(client: httpx.Client, user: tuple[str, str]) -> int:
    page = client.get("/login").text
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None
    data = {"user": user[0], "password": user[1], "csrf": found[1]}
    return int(client.post("/login", data=data).status_code)


def test_a_session_ends_when_its_login_is_removed_and_guessing_is_held(app: Any) -> None:
    from pydantic import SecretStr

    # Given an operator's session cookie from a console configured with that operator
    both = app.settings.model_copy(update={"console_secret": SecretStr("s" * 48)})
    viewer_only = both.model_copy(update={"console_users": {"vic": both.console_users["vic"]}})
    with served(_Configured(app, both)) as url:
        first = httpx.Client(base_url=url, follow_redirects=False, timeout=20)
        assert _login(first, OPERATOR) == 303
        assert first.get("/audit").status_code == 200
        stolen = first.cookies.get("ledger_console")
        assert stolen

    # When a console with the same cookie key no longer has that login (removed on a
    # restart), the cookie is worth nothing there: back to the login page
    with served(_Configured(app, viewer_only)) as url:
        second = httpx.Client(base_url=url, follow_redirects=False, timeout=20)
        second.cookies.set("ledger_console", stolen)
        assert second.get("/audit").status_code == 303
        assert second.post("/breakers/open", data={"name": "x"}).status_code == 401

    # And five wrong passwords of a login hold its logins for a while, right or wrong
    with served(_Configured(app, both)) as url:
        third = httpx.Client(base_url=url, follow_redirects=False, timeout=20)
        for attempt in range(5):
            assert _login(third, (VIEWER[0], f"guess-number-{attempt}")) == 401
        assert _login(third, VIEWER) == 429


def test_a_sensitive_tasks_result_is_never_shown(app: Any, console: str, token: str) -> None:
    from tests.integration.ledger_app import reject_card, store_card

    card = "4111111111111111"
    stored = store_card.delay(token, card)
    assert stored.get(timeout=30)["echo"] == card  # the caller gets it: the console does not
    rejected = reject_card.delay(f"{token}-r", card)
    wait_for(
        lambda: (r := app.ledger.get_by_id(rejected.id)) is not None and r.state is State.DEAD,
        what="the card rejected",
    )
    operator, _ = logged_in(console, OPERATOR)
    for page in (
        operator.get(f"/jobs/{stored.id}"),
        operator.get(f"/jobs/{rejected.id}"),
        operator.get(f"/dead?task={reject_card.name}"),
    ):
        assert page.status_code == 200
        assert card not in page.text
    assert "[sealed: sensitive task]" in operator.get(f"/jobs/{stored.id}").text

    # nor a sensitive workflow's (its own record holds its result, sealed)
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["vault"].start(f"{token}-wf", card)
    wait_for(lambda: handle.status().waiting, what="the workflow waiting for its pin")
    handle.signal("pin", "2468")
    assert handle.result(timeout=60)["card"] == card
    for page in (
        operator.get(f"/jobs/{handle.id}"),
        operator.get(f"/workflows/{handle.id}"),
    ):
        assert page.status_code == 200
        assert card not in page.text and "2468" not in page.text


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        if os.environ.get("REQUIRE_BROWSER_TESTS"):
            pytest.fail(
                "chromium and chromedriver are required (apt-get install chromium chromium-driver)"
            )
        pytest.skip("no chromium/chromedriver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


def shoot(driver: Any, tmp_path: Path, name: str) -> None:
    driver.save_screenshot(str(tmp_path / name))
    target = os.environ.get("CONSOLE_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(target) / name))


def test_an_operator_finds_a_job_replays_a_dead_group_and_forces_a_breaker(
    app: Any, console: str, browser: Any, token: str, tmp_path: Path
) -> None:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from tests.integration.ledger_app import fails_until_fixed, record

    wait = WebDriverWait(browser, 30)

    def text_of(selector: str) -> str:
        return str(wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, selector))).text)

    # Given a job that succeeded and one that died
    done = record.delay(f"{token}-ok")
    done.get(timeout=30)
    doomed = fails_until_fixed.delay(f"{token}-dead")
    wait_for(
        lambda: (r := app.ledger.get_by_id(doomed.id)) is not None and r.state is State.DEAD,
        what="the job dead",
    )

    # When the operator logs in, the overview shows every tier and the health checks
    browser.get(f"{console}/")
    wait.until(seen.url_contains("/login"))
    browser.find_element(By.ID, "user").send_keys(OPERATOR[0])
    browser.find_element(By.ID, "password").send_keys(OPERATOR[1])
    browser.find_element(By.ID, "login").click()
    wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, "#tiers tbody tr")))
    tiers = [
        row.get_attribute("data-tier")
        for row in browser.find_elements(By.CSS_SELECTOR, "#tiers tbody tr")
    ]
    assert tiers == list(app.tiers.names)
    assert "ledger" in text_of("#health")
    assert text_of("#who") == f"{OPERATOR[0]} (operator)"
    shoot(browser, tmp_path, "console-overview.png")

    # It finds the job by task and key
    browser.get(f"{console}/jobs")
    Select(browser.find_element(By.ID, "task")).select_by_visible_text(record.name)
    browser.find_element(By.ID, "key").send_keys(f"{token}-ok")
    browser.find_element(By.ID, "find").click()
    assert text_of("#job-status") == "succeeded"
    assert text_of("#job-key") == f"{token}-ok"
    assert text_of("#job-attempts") == "1"
    shoot(browser, tmp_path, "console-job.png")

    # It opens the dead job's group (filtered to it), dry-runs the group: nothing is sent
    browser.get(f"{console}/dead?task={fails_until_fixed.name}&reason={token}-dead")
    wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR, "a.group"))).click()
    assert doomed.id in text_of("#records")
    shoot(browser, tmp_path, "console-dead-letters.png")
    browser.find_element(By.ID, "dry-run-group").click()
    assert "would replay" in text_of("#outcomes")
    assert text_of("#summary") == "1 of 1 would be replayed"
    time.sleep(1.0)
    assert app.ledger.get_by_id(doomed.id).state is State.DEAD
    assert effect_count("fixed_run", f"{token}-dead") == 0

    # Then, the cause fixed, it replays the group (confirming): the job succeeds, once
    record_effect("fixed", f"{token}-dead")
    browser.back()
    wait.until(seen.element_to_be_clickable((By.ID, "replay-group"))).click()
    wait.until(seen.alert_is_present()).accept()
    assert text_of("#summary") == "1 of 1 replayed"
    assert doomed.get(timeout=30) == "fixed"
    time.sleep(1.0)
    assert effect_count("fixed_run", f"{token}-dead") == 1

    # It forces a breaker open, then clears it
    name = f"console-{token}"
    app.breakers[name].record_success()
    browser.get(f"{console}/breakers")
    row = f'tr[data-breaker="{name}"]'
    wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR, f"{row} button.open"))).click()
    # (the click posts a form and the page loads again: an element found in the page before
    # may be gone by the time its text is read, which Chromium reports as an unknown error,
    # not a stale element; so these waits look again on any WebDriver error until they time out)
    reloading = WebDriverWait(browser, 30, ignored_exceptions=(WebDriverException,))
    state = (By.CSS_SELECTOR, f"{row} td.state")
    reloading.until(seen.text_to_be_present_in_element(state, "open"))
    assert app.breakers[name].status().forced
    reloading.until(seen.element_to_be_clickable((By.CSS_SELECTOR, f"{row} button.clear"))).click()
    wait.until(lambda _: not app.breakers[name].status().forced)

    # And the audit page shows each action, by this user, done
    browser.get(f"{console}/audit")
    trail = text_of("#audit")
    assert f"replay {doomed.id}" in trail
    assert f"forced open breaker:{name}" in trail and f"force cleared breaker:{name}" in trail
    assert f"{OPERATOR[0]} [console]" in trail
    app.breakers[name].reset()


def test_a_viewer_sees_the_dead_letters_but_no_actions(
    app: Any, console: str, browser: Any, token: str
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.integration.ledger_app import fails_until_fixed

    doomed = fails_until_fixed.delay(token)
    wait_for(
        lambda: (r := app.ledger.get_by_id(doomed.id)) is not None and r.state is State.DEAD,
        what="the job dead",
    )
    wait = WebDriverWait(browser, 30)
    browser.get(f"{console}/login")
    browser.find_element(By.ID, "user").send_keys(VIEWER[0])
    browser.find_element(By.ID, "password").send_keys(VIEWER[1])
    browser.find_element(By.ID, "login").click()
    wait.until(seen.presence_of_element_located((By.ID, "tiers")))
    browser.get(f"{console}/dead?task={fails_until_fixed.name}&reason={token}")
    wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR, "a.group"))).click()
    wait.until(seen.presence_of_element_located((By.ID, "records")))
    assert "Viewers cannot replay or purge." in browser.page_source
    assert browser.find_elements(By.ID, "replay-group") == []
    browser.get(f"{console}/breakers")
    assert browser.find_elements(By.CSS_SELECTOR, "button.open") == []


def test_an_operator_follows_a_workflow_and_signals_it_from_its_page(
    app: Any, console: str, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["order"].start(token, steps=1, signal="approved")
    wait_for(lambda: handle.status().waiting, what="the workflow waiting for its signal")
    operator, csrf = logged_in(console, OPERATOR)
    listing = operator.get("/workflows?status=running").text
    assert handle.id in listing
    page = operator.get(f"/workflows/{handle.id}").text
    assert "running" in page and "approved" in page  # what it waits for, in its timeline too

    sent = operator.post(
        f"/workflows/{handle.id}/signal",
        data={"csrf": csrf, "name": "approved", "payload": '{"by": "olive"}'},
    )

    assert sent.status_code == 303
    result = handle.result(timeout=60)
    assert result["signal"] == {"by": "olive"}
    assert "completed" in operator.get(f"/workflows/{handle.id}").text
    entry = next(e for e in app.ledger.audit_entries(limit=50) if e["target"] == handle.id)
    assert (entry["action"], entry["actor"]) == ("workflow signal", f"{OPERATOR[0]} [console]")


def test_a_purge_asks_first_then_deletes_what_it_listed_and_audits_it(
    app: Any, console: str, token: str
) -> None:
    from tests.integration.ledger_app import fails_until_fixed

    doomed = fails_until_fixed.delay(token)
    wait_for(
        lambda: (r := app.ledger.get_by_id(doomed.id)) is not None and r.state is State.DEAD,
        what="the job dead",
    )
    operator, csrf = logged_in(console, OPERATOR)

    asked = operator.post("/dead/purge", data={"csrf": csrf, "ids": doomed.id})
    assert asked.status_code == 200 and "for good?" in asked.text
    assert app.ledger.get_by_id(doomed.id) is not None  # nothing deleted yet

    done = operator.post("/dead/purge", data={"csrf": csrf, "ids": doomed.id, "confirm": "yes"})
    assert done.status_code == 200 and "Purged 1 dead records" in done.text
    assert app.dead_letters.get(doomed.id) is None or app.dead_letters.get(doomed.id).get(
        "purged_at"
    )
    entry = next(e for e in app.ledger.audit_entries(limit=50) if e["action"] == "purge")
    assert entry["actor"] == f"{OPERATOR[0]} [console]" and doomed.id in entry["record_ids"]


def test_an_operator_pauses_resumes_and_triggers_a_schedule_from_its_page(
    app: Any, console: str, token: str
) -> None:
    name = f"console-{token}"
    saved = dict(app.conf.beat_schedule or {})
    app.conf.beat_schedule = {
        **saved,
        name: {
            "task": "tests.integration.ledger_app.record",
            "schedule": 3600.0,
            "args": (f"sched-{token}",),
        },
    }
    try:
        operator, csrf = logged_in(console, OPERATOR)
        assert f'data-schedule="{name}"' in operator.get("/schedules").text
        paused = operator.post(
            "/schedules/pause", data={"csrf": csrf, "name": name, "reason": "maintenance"}
        )
        assert paused.status_code == 303
        assert f"by {OPERATOR[0]} [console]: maintenance" in operator.get("/schedules").text
        viewer, viewer_csrf = logged_in(console, VIEWER)
        refused = viewer.post("/schedules/resume", data={"csrf": viewer_csrf, "name": name})
        assert refused.status_code == 403
        assert "maintenance" in operator.get("/schedules").text  # still paused
        assert (
            operator.post("/schedules/resume", data={"csrf": csrf, "name": name}).status_code == 303
        )
        assert "maintenance" not in operator.get("/schedules").text
        # "run now": one run of the entry, through the workers
        assert (
            operator.post("/schedules/trigger", data={"csrf": csrf, "name": name}).status_code
            == 303
        )
        wait_for(lambda: effect_count("record", f"sched-{token}") == 1, what="the triggered run")
        unknown = operator.post("/schedules/pause", data={"csrf": csrf, "name": "no-such"})
        assert unknown.status_code == 404 and "no schedule entry" in unknown.text
        actions = [
            (e["action"], e["actor"])
            for e in app.ledger.audit_entries(limit=50)
            if e["target"] == f"schedule:{name}"
        ]
        for action in ("schedule paused", "schedule resumed", "schedule triggered"):
            assert (action, f"{OPERATOR[0]} [console]") in actions
    finally:
        app.conf.beat_schedule = saved


def test_the_overview_charts_the_last_hour_and_a_workflow_page_draws_its_timeline(
    app: Any, console: str, browser: Any, token: str, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    from celery_ledger.errors import WorkflowFailed
    from tests.integration.ledger_app import WORKFLOWS, fails_until_fixed, record

    wait = WebDriverWait(browser, 40)

    def counted(chart: str, outcome: str) -> int:
        bars = browser.find_elements(By.CSS_SELECTOR, f"#{chart} rect.bar.{outcome}")
        return sum(int(bar.get_attribute("data-count")) for bar in bars)

    # Given three jobs that succeeded and two that died, in this hour
    done = [record.delay(f"{token}-ok{i}") for i in range(3)]
    for result in done:
        result.get(timeout=30)
    doomed = [fails_until_fixed.delay(f"{token}-dead{i}") for i in range(2)]
    for result in doomed:
        wait_for(
            lambda r=result: (
                (d := app.ledger.get_by_id(r.id)) is not None and d.state is State.DEAD
            ),
            what="the job dead",
        )
    tier = app.ledger.get_by_id(done[0].id).tier
    assert app.ledger.get_by_id(doomed[0].id).tier == tier
    # and a workflow with steps, a timer, a signal, a failed step and its compensation
    handle = WORKFLOWS["order"].start(
        token, steps=1, sleep=1.0, signal="approved", fail_at_end=True
    )
    wait_for(lambda: "approved" in " ".join(handle.status().waiting), what="the signal wait")
    handle.signal("approved", {"by": "olive"})
    with pytest.raises(WorkflowFailed, match="compensated"):
        handle.result(timeout=60)

    # and a breaker held open
    from celery_ledger.policies.breaker import BreakerState

    breaker = f"charts-{token}"
    app.breakers[breaker].force(BreakerState.OPEN)

    # When the operator opens the overview
    browser.set_window_size(1400, 2300)
    browser.get(f"{console}/login")
    browser.find_element(By.ID, "user").send_keys(OPERATOR[0])
    browser.find_element(By.ID, "password").send_keys(OPERATOR[1])
    browser.find_element(By.ID, "login").click()
    wait.until(seen.presence_of_element_located((By.ID, "hour")))

    # Then a throughput chart per tier, and the jobs' tier's counts them (the panels refresh
    # every 5 s; the hour's read is cached for 10)
    charts = [
        figure.get_attribute("data-tier")
        for figure in browser.find_elements(By.CSS_SELECTOR, "#throughput figure")
    ]
    assert charts == list(app.tiers.names)
    chart = f"chart-throughput-{tier}"
    wait.until(lambda _: counted(chart, "succeeded") >= 3 and counted(chart, "dead") >= 2)
    ticks = [t.text for t in browser.find_elements(By.CSS_SELECTOR, f"#{chart} text.tick.x")]
    assert len(ticks) == 4 and all(re.fullmatch(r"\d\d:(00|15|30|45)", t) for t in ticks)
    # a line of queue depth per tier, each with a sample this minute (the page's, the workers')
    depth_lines = browser.find_elements(By.CSS_SELECTOR, "#chart-depth g.line")
    assert [g.get_attribute("data-series") for g in depth_lines] == list(app.tiers.names)
    assert all(int(g.get_attribute("data-points")) >= 1 for g in depth_lines)
    # run-time percentiles with a value, and the tier's row of the latency table
    latency = {
        g.get_attribute("data-series"): g.get_attribute("data-last")
        for g in browser.find_elements(By.CSS_SELECTOR, "#chart-latency g.line")
    }
    assert set(latency) == {"p50", "p95", "p99"} and all(latency.values())
    row = browser.find_element(By.CSS_SELECTOR, f'#latency tr[data-tier="{tier}"]')
    assert int(row.find_elements(By.TAG_NAME, "td")[1].text) >= 5
    # and the breaker, open since it was forced
    opened = browser.find_elements(
        By.CSS_SELECTOR, f'#chart-breakers g.span[data-label="{breaker}"]'
    )
    assert [g.get_attribute("data-outcome") for g in opened] == ["forced"]
    shoot(browser, tmp_path, "console-overview-charts.png")
    app.breakers[breaker].reset()

    # And the workflow's page draws a row for each step, the timer, the signal wait and the
    # compensation's run, coloured by outcome
    browser.set_window_size(1400, 1400)
    browser.get(f"{console}/workflows/{handle.id}")
    wait.until(seen.presence_of_element_located((By.ID, "workflow-timeline")))
    spans = browser.find_elements(By.CSS_SELECTOR, "#workflow-timeline g.span")
    rows = [
        (
            s.get_attribute("data-kind"),
            s.get_attribute("data-label"),
            s.get_attribute("data-outcome"),
        )
        for s in spans
    ]
    kinds = [kind for kind, _, _ in rows]
    assert kinds.count("timer") == 1 and kinds.count("signal") == 1
    assert kinds.count("compensation") == 1 and kinds.count("step") == 4  # s0, g0, g1, last
    assert [
        (label.split(" ", 1)[1], outcome)
        for kind, label, outcome in rows
        if kind in ("timer", "signal")
    ] == [("timer sleep", "done"), ("signal approved", "done")]
    failed = [label for kind, label, outcome in rows if outcome == "failed"]
    assert len(failed) == 1 and "wf_refuse" in failed[0]
    assert all(outcome in ("done", "failed") for _, _, outcome in rows)
    compensation = next(label for kind, label, _ in rows if kind == "compensation")
    assert "wf_undo" in compensation
    assert "code failed" in browser.find_element(By.CSS_SELECTOR, "figure.timeline-chart").text
    assert "olive" not in browser.find_element(By.ID, "workflow-timeline").get_attribute(
        "outerHTML"
    )  # the signal's payload is not drawn
    shoot(browser, tmp_path, "console-workflow-timeline.png")


def test_the_depth_history_keeps_each_minutes_highest_sample_and_the_workers_sample_it(
    app: Any, token: str
) -> None:
    from celery_ledger.depth_history import DepthHistory, depths_key

    # Given samples of one minute from several samplers, in any order, and a minute with none
    history = DepthHistory(app.runtime.redis, namespace=f"test-{token}")
    minute = 29_000_000 * 60.0  # (a minute of its own: nothing else writes there)
    history.record({"default": 3, "bulk": 0}, at=minute + 1)
    history.record({"default": 7}, at=minute + 20)
    history.record({"default": 5, "bulk": 2}, at=minute + 40)
    history.record({"default": 1}, at=minute + 120)
    # When the window is read
    found = history.window(minutes=4, now=minute + 150)
    # Then each minute keeps its highest depth, and a minute no one sampled is None, not 0
    assert found == {"bulk": [None, 2, None, None], "default": [None, 7, None, 1]}
    assert 0 < app.runtime.redis.ttl(depths_key(f"test-{token}", 29_000_000)) <= 65 * 60

    # And the session's worker samples its app's tiers by itself (every 15 s)
    runtime = app.runtime
    ours = runtime.depth_history
    now = runtime.message_time()
    keys = [depths_key(ours.namespace, int(now // 60) + i) for i in (0, 1)]
    app.runtime.redis.delete(*keys)
    wait_for(
        lambda: any(app.runtime.redis.exists(k) for k in keys),
        timeout=40,
        what="a worker's sample of the queue depths",
    )
    sampled = ours.window(minutes=2, now=runtime.message_time())
    assert set(app.tiers.names) <= set(sampled)
