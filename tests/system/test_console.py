"""The web console at `meshnet serve`'s `/`, in a real headless Chromium (Debian's, driven
by Selenium): it shows the route of a 2-worker cluster, a chat message streams an answer,
and after kill -9 of a worker that has a spare the page shows the resume. With
MESHNET_SCREENSHOTS=DIR the page's screenshots are kept there (the evidence run's)."""

import os
import shutil
import signal
import subprocess
import sys
import time

import openai
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException

from conftest import THREADS, serving, stop_group, track
from peers import free_port

MODEL = "smollm2"
KEY = "console-key-" + os.urandom(4).hex()
WAIT_S = 120.0


def worker(address, layers, path):
    return track(subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "worker", "--coordinator", address,
                                   "--layers", layers, "--threads", str(THREADS), "--model", path],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))


# CI (.ci/run, and most CI services, set CI=true) must run the console test; a user's machine
# without a browser skips it, saying how to get one
IN_CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")


@pytest.fixture
def browser():
    if not shutil.which("chromium") or not shutil.which("chromedriver"):
        why = ("the console test needs a headless Chromium and its driver: `sudo apt-get install chromium "
               "chromium-driver` on Debian (.ci/run installs them)")
        if IN_CI:
            pytest.fail(f"{why}; CI=true: required here")
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    try:
        yield driver
    finally:
        driver.quit()


def until(driver, what, check):
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            found = check()
        except StaleElementReferenceException:   # (the page redrew an element between its find and its read)
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"the page never showed {what}: {driver.find_element('tag name', 'body').text}"
        time.sleep(0.2)


def shot(driver, name):
    where = os.environ.get("MESHNET_SCREENSHOTS")
    if where:
        os.makedirs(where, exist_ok=True)
        driver.save_screenshot(os.path.join(where, f"{name}.png"))


def test_the_console_shows_the_route_streams_a_chat_and_shows_a_resume(smollm2_path, browser):
    address = f"tcp://127.0.0.1:{free_port()}"
    first = {"0:15": worker(address, "0:15", smollm2_path), "15:30": worker(address, "15:30", smollm2_path)}
    spare = None
    try:
        with serving("--coordinator", address, "--insecure", "--resume-wait", "30",   # its workers: keyless, on loopback
                     env=dict(os.environ, MESHNET_API_KEY=KEY)) as (url, *_):
            browser.get(f"{url}/#key={KEY}")
            stages = until(browser, "the route's two stages", lambda: [
                e.text for e in browser.find_elements("css selector", ".stage:not(.out)")] if len(
                browser.find_elements("css selector", ".stage:not(.out)")) == 2 else None)
            assert stages[0].startswith("[0,15)") and stages[1].startswith("[15,30)")
            assert until(browser, "the status", lambda: browser.find_element("id", "status").text == "ready")
            shot(browser, "console-route")

            browser.find_element("id", "message").send_keys("What is the capital of France?")
            browser.find_element("id", "send").click()
            answer = until(browser, "a streamed answer", lambda: next(
                (e for e in browser.find_elements("css selector", ".assistant") if e.get_attribute("data-done")), None))
            assert answer.text.strip()
            shot(browser, "console-chat")

            spare = worker(address, "15:30", smollm2_path)
            # (it shows as soon as it connects, with its bar while it loads: it is a spare once loaded)
            until(browser, "the spare, loaded", lambda: len(browser.find_elements("css selector", ".stage")) == 3
                  and not browser.find_elements("css selector", ".stage .bar"))
            client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
            stream = client.chat.completions.create(model=MODEL, stream=True, max_tokens=200,
                                                    messages=[{"role": "user", "content": "Tell me a long story."}])
            chunks = iter(stream)
            for _ in range(4):   # the session is under way on the stages
                next(chunks)
            os.kill(first["15:30"].pid, signal.SIGKILL)
            rest = list(chunks)   # it goes on, resumed on the spare, to its end
            assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason] in (
                ["stop"], ["length"])
            failover = until(browser, "the resume", lambda: [e.text for e in browser.find_elements("css selector",
                                                                                                   ".failover")])
            assert "[15,30)" in failover[0] and "resumed in" in failover[0]
            assert browser.find_element("id", "resumes").text == "1"
            shot(browser, "console-resume")
    finally:
        for process in [*first.values(), spare]:
            if process is not None:
                stop_group(process)
