"""The /ui dashboard: sign-in with an API key (session cookie, CSRF-checked forms), the tenant's jobs with live
progress, a job submitted in the page that completes and downloads, cancel, and the admin view; driven in
headless Chromium (Debian's chromium + chromium-driver; a missing browser fails, it does not skip).

Screenshots of the main states go to tests/artifacts/ui/ (git-ignored); their paths are printed."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
from flask.testing import FlaskClient

from tests.helpers import MODEL, REPO, chat_line, jsonl, long_line

ARTIFACTS = REPO / "tests" / "artifacts" / "ui"
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


# ---- without a browser: the session, its cookie and CSRF ----------------------------------------------


def _csrf(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


def _signed_in(app, key: str) -> FlaskClient:
    client = FlaskClient(app)  # sends no Authorization header: the UI signs in with its form
    token = _csrf(client.get("/ui/login").get_data(as_text=True))
    r = client.post("/ui/login", data={"api_key": key, "csrf_token": token})
    assert r.status_code == 302 and r.headers["Location"].endswith("/ui/"), r.get_data(as_text=True)
    return client


def test_session_cookie_and_csrf(platform):
    app = platform.app()
    client = FlaskClient(app)
    r = client.get("/ui/")
    assert r.status_code == 302 and r.headers["Location"].endswith("/ui/login")
    assert client.get("/ui/jobs.json").status_code == 401
    page = client.get("/ui/login")
    assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    token = _csrf(page.get_data(as_text=True))
    # no token, or another one: refused before the key is even looked at
    assert client.post("/ui/login", data={"api_key": platform.api_key}).status_code == 400
    assert client.post("/ui/login", data={"api_key": platform.api_key, "csrf_token": "x" + token}).status_code == 400
    bad = client.post("/ui/login", data={"api_key": "pb-nope", "csrf_token": token})
    assert bad.status_code == 401 and "not valid" in bad.get_data(as_text=True)
    r = client.post("/ui/login", data={"api_key": platform.api_key, "csrf_token": token})
    assert r.status_code == 302
    cookie = r.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/ui" in cookie
    assert platform.api_key not in cookie  # only the key's hash is in the (signed, readable) cookie
    data = client.get("/ui/jobs.json").get_json()
    assert data["tenant"] == "default" and len(data["throughput"]) == 30
    # the session cookie does not authenticate the API itself (no CSRF through /v1)
    assert client.get("/v1/jobs").status_code == 401
    # forms need the new session's token (sign-in rotates it), and a POST without it changes nothing
    job = (
        platform.app()
        .test_client()
        .post(f"/v1/jobs?model={MODEL}", data=jsonl([long_line("c-0")]), content_type="application/x-ndjson")
        .get_json()
    )
    assert client.post(f"/ui/jobs/{job['id']}/cancel", data={"csrf_token": token}).status_code == 400
    assert platform.app().test_client().get(f"/v1/jobs/{job['id']}").get_json()["status"] != "cancelling"
    assert client.get("/ui/admin").status_code == 403  # tenant "default" is no admin


def test_a_revoked_key_signs_out(platform):
    from store.keys import create_key, revoke_key

    key, info = create_key(platform.settings, "revokee", name="ui")
    client = _signed_in(platform.app(), key)
    assert client.get("/ui/jobs.json").status_code == 200
    revoke_key(platform.settings, info.id)
    assert client.get("/ui/jobs.json").status_code == 401
    assert client.get("/ui/").headers["Location"].endswith("/ui/login")


def test_other_tenants_jobs_are_not_shown_or_downloadable(platform):
    other = platform.app(default_tenant="other").test_client()
    job = other.post(f"/v1/jobs?model={MODEL}", data=jsonl([chat_line("o", "x")]), content_type="application/x-ndjson")
    job_id = job.get_json()["id"]
    client = _signed_in(platform.app(), platform.api_key)
    assert job_id not in {j["id"] for j in client.get("/ui/jobs.json").get_json()["jobs"]}
    assert client.get(f"/ui/jobs/{job_id}/download/errors").status_code == 404


# ---- in the browser -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert Path(CHROMIUM).exists() and Path(DRIVER).exists(), "apt-get install chromium chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.downloads = tmp_path_factory.mktemp("downloads")
    driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(driver.downloads)})
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    yield driver
    driver.quit()


def _shot(driver, name: str) -> None:
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")


def _wait(predicate, timeout: float = 120, what: str = ""):
    """`predicate()` once truthy; the page re-renders its rows every second, so a stale element retries."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except StaleElementReferenceException:
            value = None
        except WebDriverException as exc:  # Chromium's wording when the node was replaced mid-call
            if "does not belong to the document" not in str(exc):
                raise
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {what}")
        time.sleep(0.2)


def _sign_in(driver, url: str, key: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{url}/ui/login")
    driver.find_element(By.ID, "api-key").send_keys(key)
    driver.find_element(By.ID, "sign-in").click()


def _status(driver, job_id: str) -> str | None:
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.ID, f"job-{job_id}")
    return rows[0].get_attribute("data-status") if rows else None


def _submitted(driver, not_id: str | None = None) -> tuple[str, str] | None:
    """(job id, message) from the page's "Submitted" message once it shows a job other than `not_id`."""
    from selenium.webdriver.common.by import By

    for flash in driver.find_elements(By.CSS_SELECTOR, ".flash.info"):
        found = re.search(r"Submitted (\S+):", flash.text)
        if found and found.group(1) != not_id:
            return found.group(1), flash.text
    return None


def _click(driver, css: str) -> None:
    from selenium.webdriver.common.by import By

    _wait(lambda: driver.find_element(By.CSS_SELECTOR, css).click() or True, 10, f"a click on {css}")


def _cells(driver, job_id: str) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    row = driver.find_element(By.ID, f"job-{job_id}")
    return {name: row.find_element(By.CLASS_NAME, name).text for name in ("pct", "counts", "errors", "usage")}


@pytest.mark.slow
def test_submit_watch_download_cancel_and_admin(browser, live_url, worker, tmp_path):
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(f"{live_url}/ui/")
    assert driver.current_url.endswith("/ui/login")
    _shot(driver, "01-login")
    _sign_in(driver, live_url, "pb-wrong")
    refused = _wait(lambda: driver.find_elements(By.CLASS_NAME, "flash"), 10, "the refusal")
    assert "not valid" in refused[0].text
    _shot(driver, "02-login-refused")

    _sign_in(driver, live_url, worker.api_key)
    _wait(lambda: driver.current_url.endswith("/ui/"), 10, "the jobs page")
    assert driver.find_element(By.ID, "tenant").text == "default"

    src = tmp_path / "page.jsonl"
    src.write_bytes(jsonl([chat_line(f"ui-{i}", f"question {i}", max_tokens=6) for i in range(12)] + ["not json"]))
    driver.find_element(By.ID, "file").send_keys(str(src))
    assert MODEL in [o.text for o in driver.find_elements(By.CSS_SELECTOR, "#model option")]
    driver.find_element(By.ID, "submit").click()
    job_id, message = _wait(lambda: _submitted(driver), 30, "the submitted message")
    assert message.endswith(": validating.")  # the lines are validated in the background
    _shot(driver, "03-submitted")
    # the page polls: the row turns completed with no reload
    _wait(lambda: _status(driver, job_id) == "completed", 120, "the job to complete in the page")
    cells = _wait(lambda: _cells(driver, job_id), 10, "the row")
    assert cells["pct"] == "100%" and cells["counts"].startswith("12/12 done"), cells
    assert "1 invalid line" in cells["errors"]
    usage = cells["usage"]
    assert re.fullmatch(r"[\d,]+ in · 72 out", usage), usage  # 12 requests x 6 tokens (EOS off in the tiny model)
    bars = "#chart rect.tp-bar"
    heights = _wait(lambda: [float(b.get_attribute("height")) for b in driver.find_elements(By.CSS_SELECTOR, bars)])
    assert len(heights) == 30 and any(h > 0 for h in heights)
    _shot(driver, "04-completed")

    _click(driver, f"a.download[data-job='{job_id}']")
    output = driver.downloads / f"{job_id}_output.jsonl"
    _wait(output.exists, 30, "the download")
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"ui-{i}" for i in range(12))
    assert all(line["response"]["status_code"] == 200 for line in lines)

    # a long job, cancelled from the page
    src.write_bytes(jsonl([long_line(f"long-{i}", max_tokens=400) for i in range(40)]))
    driver.find_element(By.ID, "file").send_keys(str(src))
    driver.find_element(By.ID, "submit").click()
    long_id, _ = _wait(lambda: _submitted(driver, not_id=job_id), 30, "the second job")
    _wait(lambda: _status(driver, long_id) == "in_progress", 60, "the long job to start")
    _shot(driver, "05-running")
    _click(driver, f"button.cancel[data-job='{long_id}']")
    _wait(lambda: _status(driver, long_id) in ("cancelling", "cancelled"), 30, "the cancel")
    _wait(lambda: f"Cancelling {long_id}" in driver.find_element(By.CLASS_NAME, "flash").text, 10, "the message")
    _wait(lambda: _status(driver, long_id) == "cancelled", 60, "the job to be cancelled")
    _shot(driver, "06-cancelled")

    # the admin view, signed in with an admin tenant's key
    driver.find_element(By.ID, "logout").click()
    _wait(lambda: driver.current_url.endswith("/ui/login"), 10, "signing out")
    driver.get(f"{live_url}/ui/admin")
    assert driver.current_url.endswith("/ui/login")
    _sign_in(driver, live_url, worker.key_for("admin"))
    _wait(lambda: driver.current_url.endswith("/ui/"), 10, "the admin's jobs page")
    driver.find_element(By.LINK_TEXT, "Admin").click()
    _wait(lambda: driver.current_url.endswith("/ui/admin"), 10, "the admin page")
    model_row = driver.find_element(By.CSS_SELECTOR, f"#models tr[data-model='{MODEL}']")
    assert worker.model_path in model_row.text and model_row.find_element(By.CLASS_NAME, "queue-depth").text == "0"
    workers = driver.find_elements(By.CSS_SELECTOR, "#workers tr[data-worker]")
    assert any(w.get_attribute("data-worker").startswith(f"{MODEL}-") for w in workers)
    completed = driver.find_element(By.CSS_SELECTOR, "#by-status td[data-status='completed']")
    assert int(completed.text) >= 1
    _shot(driver, "07-admin")


def test_ui_without_its_slash_redirects_to_the_dashboard(platform):
    client = FlaskClient(platform.app())
    r = client.get("/ui")
    assert r.status_code in (301, 308) and r.headers["Location"].endswith("/ui/")
    assert client.get("/ui", follow_redirects=True).request.path == "/ui/login"  # then sign-in, as for /ui/
    assert client.get("/uix").status_code == 401  # other unknown paths still answer as before
