"""`make ui` in a real browser: Debian's headless Chromium, driven by Selenium through
`chromium-driver`, walks the README's "Prefect and MLflow" steps as a new user would.

The stack (`python -m flows.ui`) runs in a copy of the project on free loopback ports — never the
default 4200/5000, so the UI must follow the port it is served on. Its MLflow store gets a few RL
stage runs first (through `parallel_r1.tracking`, as the RL stage logs them), nested under one
`make run` parent run. Screenshots go to reports/screenshots/ (gitignored): look at them.
Skips, saying why, when chromium or chromedriver is not installed (`.ci/run` installs both).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from conftest import REPO, copy_repo
from parallel_r1 import tracking
from parallel_r1.reward_schedule_report import build_report

pytestmark = [pytest.mark.slow, pytest.mark.server]

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1600,1000"]
SCREENSHOTS = REPO / "reports" / "screenshots"
START_TIMEOUT_S, PAGE_TIMEOUT_S = 300, 60
# The RL runs the MLflow test finds: (rl_runs configuration, its reward schedule).
RL_RUNS = [("parallel_r1_unseen_s1", "accuracy"), ("parallel_r1_unseen_s2", "alternating"),
           ("parallel_r1_unseen_parallel_only", "parallel_only"), ("scaffold", "scaffold")]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def log_rl_runs(root: Path) -> None:
    """One `make run` parent run with an RL stage run per schedule (3 steps each) and an evaluate run."""
    params = {"profile": "tiny"}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        for name in ("MLFLOW_EXPERIMENT_NAME", "DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME", tracking.SWITCH_ENV):
            env.delenv(name, raising=False)
        with tracking.parent_run("make-run@all", params, tags={"flow": "make-run"}) as parent:
            env.setenv(tracking.PARENT_ENV, parent)  # type: ignore[arg-type]
            for config, schedule in RL_RUNS:
                with tracking.stage_run("rl", config, params, {tracking.TAG_REWARD_SCHEDULE: schedule}):
                    for step in (1, 2, 3):
                        tracking.log_metrics({"reward": 0.1 * step, "accuracy": 0.05 * step}, step=step)
            with tracking.stage_run("evaluate", "parallel_r1_unseen_s1", params,
                                    {tracking.TAG_REWARD_SCHEDULE: "accuracy"}):
                tracking.log_metrics({"aime25.mean_at_k": 0.0})


@pytest.fixture(scope="module")
def stack(tmp_path_factory, mirror):
    """`python -m flows.ui` in a project copy on two free ports; yields its addresses and output."""
    root = copy_repo(tmp_path_factory.mktemp("ui") / "project", mirror)
    log_rl_runs(root)
    ports = {"prefect": free_port(), "mlflow": free_port()}
    env = dict(os.environ, PARALLEL_R1_PREFECT_PORT=str(ports["prefect"]),
               PARALLEL_R1_MLFLOW_PORT=str(ports["mlflow"]), PYTHONPATH=str(root))
    env.pop("MLFLOW_TRACKING_URI", None)  # the Makefile's points at this checkout's mlflow.db
    output = root / "ui.log"
    with open(output, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "flows.ui"], cwd=root, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ctrl-C stops everything" not in output.read_text(errors="replace"):
            assert process.poll() is None, output.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "flows.ui did not start in time"
            time.sleep(1)
        yield {"root": root, "process": process, "output": output.read_text(),
               **{name: f"http://127.0.0.1:{port}" for name, port in ports.items()}}
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver;"
                    " .ci/run does this)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))  # no Selenium Manager download
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def wait_for(driver, condition, what: str, timeout: float = PAGE_TIMEOUT_S):
    """`condition(driver)` once truthy; on time-out a screenshot and the page's text say what was there."""
    from selenium.common.exceptions import TimeoutException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, ignored_exceptions=[WebDriverException]).until(condition)
    except TimeoutException:
        driver.save_screenshot(str(SCREENSHOTS / "timeout.png"))
        pytest.fail(f"{what}: not seen within {timeout:.0f} s at {driver.current_url}; page text:\n"
                    f"{page_text(driver)[:1500]}")


def page_text(driver) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.TAG_NAME, "body").text


def click(driver, xpath: str, what: str) -> None:
    from selenium.webdriver.common.by import By

    wait_for(driver, lambda d: d.find_element(By.XPATH, xpath).is_displayed(), what)
    driver.find_element(By.XPATH, xpath).click()


def add_list_item(driver, parameter: str, value: str) -> None:
    """In Prefect's run form: the list parameter's "Add item", then type into the new field."""
    from selenium.webdriver.common.by import By

    section = driver.find_element(By.XPATH, f"//span[@class='schema-form-property__label' and starts-with("
                                            f"normalize-space(), '{parameter}')]/ancestor::div[contains("
                                            "concat(' ', @class, ' '), ' schema-form-property ')][1]")
    fields = len(section.find_elements(By.TAG_NAME, "textarea"))
    section.find_element(By.XPATH, ".//button[normalize-space()='Add item']").click()
    wait_for(driver, lambda d: len(section.find_elements(By.TAG_NAME, "textarea")) > fields,
             f"a new {parameter} field")
    section.find_elements(By.TAG_NAME, "textarea")[-1].send_keys(value)


def prefect_api(stack, path: str, body: bytes = b"{}"):
    import json

    request = urllib.request.Request(f"{stack['prefect']}/api/{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def test_prefect_ui_on_a_custom_port_lists_both_deployments_as_ready(browser, stack):
    with urllib.request.urlopen(f"{stack['prefect']}/ui-settings", timeout=30) as answer:
        assert f'"api_url":"{stack["prefect"]}/api"' in answer.read().decode()
    browser.get(f"{stack['prefect']}/deployments")
    # the flow names under each deployment load after the rows: wait for them too
    wait_for(browser, lambda d: page_text(d).count("Ready") == 2 and "reproduce" in page_text(d)
             and "sweep" in page_text(d), "both deployments Ready, with their flows")
    text = page_text(browser)
    browser.save_screenshot(str(SCREENSHOTS / "prefect_deployments.png"))
    assert "2 Deployments" in text and "reproduce" in text and "sweep" in text
    assert "Can't connect to Server API" not in text


def test_sweep_started_from_the_run_dialog_appears_in_runs_and_cancels(browser, stack):
    from selenium.webdriver.common.by import By

    browser.get(f"{stack['prefect']}/deployments")
    click(browser, "//tr[.//a[normalize-space()='sweep']]//a[contains(@class, 'deployment-list__name')]",
          "the sweep deployment")
    click(browser, "//button[normalize-space()='Run']", "the Run button")
    click(browser, "//button[normalize-space()='Custom run']", "Run -> Custom run")
    wait_for(browser, lambda d: "reward_schedules" in page_text(d), "the run form")
    add_list_item(browser, "configurations", "parallel_r1_unseen_s1")
    add_list_item(browser, "reward_schedules", "accuracy")
    add_list_item(browser, "reward_schedules", "alternating")
    run_name = browser.find_element(By.CSS_SELECTOR, ".flow-run-name-input input").get_attribute("value")
    browser.save_screenshot(str(SCREENSHOTS / "prefect_sweep_run_form.png"))
    click(browser, "//button[normalize-space()='Submit']", "Submit")
    wait_for(browser, lambda d: f"{run_name} scheduled to start now" in page_text(d), "the scheduled notice")

    click(browser, "//a[normalize-space()='Runs']", "Runs in the side bar")
    row = f"//div[contains(@class, 'flow-run-list-item')][.//a[normalize-space()='{run_name}']]"
    wait_for(browser, lambda d: "Running" in d.find_element(By.XPATH, row).text,
             f"{run_name} Running in Runs")
    browser.save_screenshot(str(SCREENSHOTS / "prefect_runs_sweep_running.png"))
    (flow_run,) = prefect_api(stack, "flow_runs/filter",
                              f'{{"flow_runs": {{"name": {{"any_": ["{run_name}"]}}}}}}'.encode())
    assert flow_run["parameters"]["configurations"] == ["parallel_r1_unseen_s1"]
    assert flow_run["parameters"]["reward_schedules"] == ["accuracy", "alternating"]

    click(browser, f"{row}//a[normalize-space()='{run_name}']", "the run's page")
    click(browser, "//button[normalize-space()='Cancel']", "Cancel")
    click(browser, "//button[normalize-space()='Confirm']", "Confirm")
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    while prefect_api(stack, f"flow_runs/{flow_run['id']}", None)["state_type"] != "CANCELLED":
        assert time.monotonic() < deadline, "the sweep run did not reach Cancelled"
        time.sleep(2)
    browser.refresh()
    wait_for(browser, lambda d: "Cancelled" in d.find_element(By.CSS_SELECTOR, ".state-badge").text,
             "Cancelled on the run's page")
    browser.save_screenshot(str(SCREENSHOTS / "prefect_sweep_cancelled.png"))
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    while left := dvc_experiments(stack["root"]):
        assert time.monotonic() < deadline, f"dvc exp processes outlived the cancelled sweep: {left}"
        time.sleep(2)


def dvc_experiments(root: Path) -> list[list[str]]:
    """Command lines of the `dvc exp run` processes working in `root`."""
    return [process.info["cmdline"] for process in psutil.process_iter(["cmdline", "cwd"])
            if (process.info["cwd"] or "").startswith(str(root)) and "exp" in (process.info["cmdline"] or [])]


def test_rl_runs_link_printed_by_make_ui_groups_runs_by_reward_schedule(browser, stack):
    from selenium.webdriver.common.by import By

    (link,) = re.findall(r"^RL runs: +(http\S+)", stack["output"], flags=re.M)
    assert link.startswith(f"{stack['mlflow']}/#/experiments/")  # the port actually served
    browser.get(link)
    search = (By.CSS_SELECTOR, "input[data-testid='search-box']")
    wait_for(browser, lambda d: d.find_element(*search).get_attribute("value") == "tags.stage = 'rl'",
             "the RL filter in the search box")
    click(browser, "//button[contains(normalize-space(), 'Group by')]", "Group by")
    click(browser, "//*[normalize-space()='reward_schedule' and not(*)]", "Group by -> reward_schedule")
    wait_for(browser, lambda d: all(f"Group: {schedule}" in page_text(d) for _, schedule in RL_RUNS),
             "one group per reward schedule")
    text = page_text(browser)
    browser.save_screenshot(str(SCREENSHOTS / "mlflow_rl_runs_by_reward_schedule.png"))
    assert all(f"rl@{config}" in text for config, _ in RL_RUNS)
    assert "evaluate@" not in text  # tagged with a schedule too, but not an RL run

    with pytest.MonkeyPatch.context() as env:  # the report links each run it compares
        env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{stack['root'] / 'mlflow.db'}")
        env.setenv("PARALLEL_R1_MLFLOW_PORT", stack["mlflow"].rsplit(":", 1)[1])
        runs = build_report(stack["root"] / "reward_schedules.md", stack["root"] / "reward_schedules.png")
    assert f"[rl@scaffold]({runs[-1].url})" in (stack["root"] / "reward_schedules.md").read_text()
    browser.get(runs[-1].url)
    wait_for(browser, lambda d: "rl@scaffold" in page_text(d) and "reward_schedule" in page_text(d),
             "the scaffold run's page")
    browser.save_screenshot(str(SCREENSHOTS / "mlflow_report_link_scaffold_run.png"))
