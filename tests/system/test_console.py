"""The web console in Debian's headless Chromium (Selenium driving /usr/bin/chromedriver, nothing
downloaded) against a real ``forkyard serve`` on gVisor: log in with the key, see a sandbox
appear, open its terminal and run a command over envd's PTY, pause/resume/snapshot it, kill it.
Screenshots of the main pages are kept in ``tests/artifacts/console/`` (git-ignored)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from e2b import Sandbox

from tests.support import REPO
from tests.support.server import ServerProcess

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = REPO / "tests" / "artifacts" / "console"
WAIT_S = 30.0
T = TypeVar("T")

pytestmark = pytest.mark.skipif(
    not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
    reason="needs Debian's chromium and chromium-driver (scripts/bootstrap.sh --test installs them)",
)


def wait_for(what: str, check: Callable[[], object], timeout: float = WAIT_S) -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: object, name: str) -> None:
    path = ARTIFACTS / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"screenshot {path} failed"  # type: ignore[attr-defined]


def settled(fn: Callable[[], T]) -> T:
    """``fn()`` again when the page was replaced under it (the list reloads itself every 5 s)."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    for _ in range(20):
        try:
            return fn()
        except StaleElementReferenceException:
            pass
        except WebDriverException as exc:  # chromedriver's other words for a replaced page
            if "does not belong to the document" not in str(exc):
                raise
        time.sleep(0.2)
    return fn()


def body_text(driver: object) -> str:
    from selenium.webdriver.common.by import By

    return settled(lambda: str(driver.find_element(By.TAG_NAME, "body").text))  # type: ignore[attr-defined]


def click_and_load(driver: object, by: str, selector: str) -> None:
    """Click what submits a form and wait until the browser has the next page."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def click() -> object:
        page = driver.find_element(By.TAG_NAME, "html")  # type: ignore[attr-defined]
        driver.find_element(by, selector).click()  # type: ignore[attr-defined]
        return page

    def replaced(_: object) -> bool:
        # ec.staleness_of, but chromedriver 156 also says "does not belong to the document".
        try:
            _ = old.tag_name  # type: ignore[attr-defined]
        except WebDriverException:
            return True
        return False

    old = settled(click)
    wait = WebDriverWait(driver, WAIT_S)
    wait.until(replaced)
    wait.until(lambda d: d.execute_script("return document.readyState") == "complete")


def test_unauthenticated_requests_are_refused(forkyard_server: ServerProcess) -> None:
    url = forkyard_server.url
    page = httpx.get(url + "/console/sandboxes", headers={"Accept": "text/html"})
    assert page.status_code == 303 and page.headers["location"] == "/console/login"
    action = httpx.post(url + "/console/sandboxes/inoexist/kill", cookies={"forkyard_console_key": "wrong"})
    assert action.status_code == 401 and action.json() == {"code": 401, "message": "invalid API key"}
    assert httpx.get(url + "/node").status_code == 401
    status = httpx.get(url + "/node", headers=forkyard_server.headers).json()
    assert status["runtime"] == "gvisor"
    history = httpx.get(url + "/node/history", headers=forkyard_server.headers).json()
    assert history["samples"], "the sampler takes one sample at start-up"


def test_console_login_sandbox_terminal_actions_kill(browser: object, forkyard_server: ServerProcess) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    d = browser
    url = forkyard_server.url
    d.get(url + "/console")  # type: ignore[attr-defined]
    assert d.current_url.endswith("/console/login")  # type: ignore[attr-defined]
    shot(d, "login")
    d.find_element(By.ID, "api_key").send_keys("wrong-key")  # type: ignore[attr-defined]
    click_and_load(d, By.ID, "login")
    assert "invalid API key" in body_text(d)
    d.find_element(By.ID, "api_key").send_keys(forkyard_server.api_key)  # type: ignore[attr-defined]
    click_and_load(d, By.ID, "login")
    assert d.current_url.endswith("/console/sandboxes")  # type: ignore[attr-defined]

    sbx = Sandbox.create(timeout=300, metadata={"suite": "console"})
    try:
        sid = sbx.sandbox_id
        # The list refreshes itself every 5 s: the new sandbox appears without a reload.
        wait_for("the sandbox in the list", lambda: d.find_elements(By.ID, f"sb-{sid}"), timeout=15)  # type: ignore[attr-defined]
        row = settled(lambda: d.find_element(By.ID, f"sb-{sid}").text)  # type: ignore[attr-defined]
        assert "running" in row and "suite=console" in row and "base" in row
        shot(d, "sandboxes")

        d.get(f"{url}/console/sandboxes/{sid}/terminal")  # type: ignore[attr-defined]
        term = d.find_element(By.ID, "terminal")  # type: ignore[attr-defined]
        wait_for(
            "the shell's prompt", lambda: term.get_attribute("data-state") == "open" and "$" in term.text
        )
        term.click()
        ActionChains(d).send_keys("echo web-$((6*7)) > /tmp/from-console; cat /tmp/from-console").send_keys(
            Keys.ENTER
        ).perform()
        wait_for("the command's output", lambda: "web-42" in term.text.replace("web-$((6*7))", ""))
        assert sbx.files.read("/tmp/from-console").strip() == "web-42"  # it ran in the sandbox
        shot(d, "terminal")

        d.get(f"{url}/console/sandboxes/{sid}")  # type: ignore[attr-defined]
        click_and_load(d, By.XPATH, "//button[text()='Pause']")
        assert f"paused {sid}" in body_text(d) and "paused (frozen)" in body_text(d)
        assert Sandbox.get_info(sid).state.value == "paused"
        click_and_load(d, By.XPATH, "//button[text()='Resume']")
        assert f"resumed {sid}" in body_text(d)
        d.find_element(By.NAME, "name").send_keys("from-console")  # type: ignore[attr-defined]
        click_and_load(d, By.XPATH, "//button[text()='Snapshot']")
        assert f"of {sid}" in body_text(d)
        shot(d, "sandbox")

        d.get(url + "/console/snapshots")  # type: ignore[attr-defined]
        text = body_text(d)
        # Its chain runs back to the template snapshot the sandbox was restored from.
        assert "from-console" in text and "← snap" in text
        shot(d, "snapshots")
        d.get(url + "/console/templates")  # type: ignore[attr-defined]
        assert d.find_elements(By.ID, "tpl-base")  # type: ignore[attr-defined]
        shot(d, "templates")
        d.get(url + "/console/node")  # type: ignore[attr-defined]
        text = body_text(d)
        assert "gvisor" in text and "create" in text and "snapshot" in text
        assert len(d.find_elements(By.CSS_SELECTOR, "svg.chart")) == 3  # type: ignore[attr-defined]
        shot(d, "node")

        d.get(url + "/console/sandboxes")  # type: ignore[attr-defined]
        click_and_load(d, By.CSS_SELECTOR, f"#sb-{sid} button[name=kill]")
        assert f"killed {sid}" in body_text(d)
        assert not d.find_elements(By.ID, f"sb-{sid}")  # type: ignore[attr-defined]
        assert sid not in [s.sandbox_id for s in Sandbox.list().next_items()]
    finally:
        sbx.kill()
    # Delete the snapshot the console took, so the session's server ends clean.
    for snap in Sandbox.list_snapshots().next_items():
        if "from-console" in (snap.names or []):
            Sandbox.delete_snapshot(snap.snapshot_id)
