"""The console (services/gateway/console/) in headless Chromium on the real stack with the tiny
model: log in with a key, a run's curves, publishing a checkpoint, chatting in the Playground
(streamed), downloading a session's trace (checked against the kept rows), the audit log, the
operator's cluster page for an admin key, and one tenant seeing nothing of another's. Screenshots
are saved under tests/artifacts/."""

from __future__ import annotations

import json
import time

import pytest

from fixtures_browser import Console, start_browser
from fixtures_stack import png_bytes, raw_stub, sft_datum
from temper.client import AdamParams, ModelInput, SamplingParams, convert
from temper.localstack import LocalStack
from selenium.webdriver.common.by import By  # the dev extra (make venv installs it): missing fails, never skips
from selenium.webdriver.support.ui import Select
from temper.v1 import records_pb2, service_pb2, types_pb2

LORA = types_pb2.LoraConfig(rank=4, alpha=8.0, seed=3, train_attn=True, train_mlp=True, train_unembed=False)
STEPS = 10
PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]  # the same example each step: the loss falls


def _train(stub, model: str, steps: int, name: str) -> tuple[str, str, str]:
    """A session with one run trained ``steps`` steps and a sampler checkpoint ``name``; the run's id,
    its session and the checkpoint's path."""
    session_id = stub.CreateSession(service_pb2.CreateSessionRequest()).session_id
    run = stub.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(session_id=session_id, base_model=model, lora_config=LORA))
    seq = 1
    for _ in range(steps):
        stub.ForwardBackward(service_pb2.ForwardBackwardRequest(
            training_run_id=run.training_run_id, seq_id=seq, data=[convert.datum_to_proto(sft_datum(PATTERN))],
            loss_fn="cross_entropy"))
        stub.OptimStep(service_pb2.OptimStepRequest(training_run_id=run.training_run_id, seq_id=seq + 1,
                                                    adam_params=convert.adam_to_proto(AdamParams(learning_rate=2e-2))))
        seq += 2
    saved = stub.SaveWeights(service_pb2.SaveWeightsRequest(training_run_id=run.training_run_id, seq_id=seq, name=name,
                                                            kind=types_pb2.CHECKPOINT_KIND_SAMPLER))
    return run.training_run_id, session_id, saved.checkpoint.path


def _sample(stub, session_id: str, path: str, times: int) -> None:
    sampler = stub.CreateSamplingClient(service_pb2.CreateSamplingClientRequest(session_id=session_id, model_path=path))
    for _ in range(times):
        stub.Sample(service_pb2.SampleRequest(
            sampler_id=sampler.sampler_id, prompt=convert.model_input_to_proto(ModelInput.from_ints([5, 6, 7, 8])),
            num_samples=2, sampling_params=convert.sampling_params_to_proto(SamplingParams(max_tokens=6, seed=1))))


@pytest.fixture(scope="module")
def world(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_console")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("console"), database_url=url, num_threads=1, gateway=True) as stack:
        stack.address = stack.start()  # raw_stub reads it
        from temper.scheduler.admin import create_key

        alice, bob = raw_stub(stack, "alice"), raw_stub(stack, "bob")
        a_run, a_session, a_path = _train(alice, tiny_model_dir, STEPS, "final")
        _sample(alice, a_session, a_path, 3)
        temporary = alice.SaveWeights(service_pb2.SaveWeightsRequest(  # save_weights_for_sampler without a path
            training_run_id=a_run, seq_id=2 * STEPS + 2, name=f"ephemeral-{2 * STEPS + 2}",
            kind=types_pb2.CHECKPOINT_KIND_SAMPLER, ephemeral=True)).checkpoint.path
        b_run, b_session, b_path = _train(bob, tiny_model_dir, 1, "bob-final")
        yield {"stack": stack, "url": stack.gateway_url, "model": tiny_model_dir, "alice": alice,
               "keys": {"alice": stack.key_for("alice"), "bob": stack.key_for("bob"),
                        "ops": create_key(url, "ops", label="console test", is_admin=True)},
               "a_run": a_run, "a_session": a_session, "a_path": a_path, "a_temporary": temporary,
               "b_run": b_run, "b_session": b_session, "b_path": b_path}


@pytest.fixture(scope="module")
def downloads(tmp_path_factory):
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def driver(downloads):
    browser = start_browser(downloads)
    yield browser
    browser.quit()


@pytest.fixture
def console(driver, world):
    return Console(driver, world["url"])


def test_log_in_and_open_a_run_with_curves(console, world):
    console.login(world["keys"]["alice"])
    assert "alice" in console.driver.find_element(By.ID, "who").text
    assert console.driver.execute_script("return location.href").find("tml-") < 0  # the key is never in the URL
    runs = console.text()
    assert world["a_run"] in runs and world["model"] in runs
    console.driver.find_element(By.LINK_TEXT, world["a_run"]).click()
    console.wait(lambda: console.driver.find_elements(By.CSS_SELECTOR, "#run-charts .chart canvas"), what="the curves")
    loss = console.driver.find_element(By.CSS_SELECTOR, "#run-charts [data-chart='loss (sum)']")
    points = console.driver.execute_script("return arguments[0].plot.data[1].length", loss)
    assert points == STEPS  # one point per forward_backward kept
    steps = console.driver.execute_script("return Array.from(arguments[0].plot.data[0])", loss)
    assert steps == list(range(STEPS))  # each forward_backward before its step's optim_step
    assert console.driver.find_elements(By.CSS_SELECTOR, "[data-chart='grad norm'] canvas")
    assert console.driver.find_elements(By.CSS_SELECTOR, "[data-chart='learning rate'] canvas")
    console.screenshot("run_curves")
    Select(console.driver.find_element(By.ID, "curve-axis")).select_by_value("time")
    over_time = console.wait(lambda: console.driver.execute_script(
        "const c = document.querySelector(\"#run-charts [data-chart='loss (sum)']\");"
        "return c && c.plot.data[0][0] > 1e9 ? Array.from(c.plot.data[0]) : null"), what="the curves over time")
    rows = [r for r in world["alice"].ListRunMetrics(records_pb2.ListRunMetricsRequest(
        training_run_id=world["a_run"], page_size=1000)).metrics if r.kind == "forward_backward"]
    assert over_time == [r.answered_unix_ms / 1000 for r in rows]  # x: when each was answered


def test_publish_a_checkpoint(console, world):
    console.login(world["keys"]["alice"])
    console.open("checkpoints", "checkpoints")
    row = console.driver.find_element(By.XPATH, f"//tr[td/code[text()='{world['a_path']}']]")
    assert row.find_element(By.CSS_SELECTOR, "button.publish").text == "Publish"
    row.find_element(By.CSS_SELECTOR, "button.publish").click()
    console.wait(lambda: "published" in console.driver.find_element(By.ID, "checkpoint-status").text, what="the answer")
    checkpoint = world["alice"].GetCheckpoint(service_pb2.GetCheckpointRequest(path=world["a_path"]))
    assert checkpoint.published
    console.wait(lambda: console.driver.find_element(
        By.XPATH, f"//tr[td/code[text()='{world['a_path']}']]//button[contains(@class,'publish')]").text == "Unpublish")
    row = console.driver.find_element(By.XPATH, f"//tr[td/code[text()='{world['a_path']}']]")
    row.find_element(By.CSS_SELECTOR, "input.ttl").send_keys("3600")
    before = time.time() * 1000
    row.find_element(By.XPATH, ".//button[text()='Set TTL']").click()
    console.wait(lambda: "TTL set" in console.driver.find_element(By.ID, "checkpoint-status").text, what="the TTL")
    expires = world["alice"].GetCheckpoint(service_pb2.GetCheckpointRequest(path=world["a_path"])).expires_unix_ms
    assert before + 3600 * 1000 <= expires <= time.time() * 1000 + 3600 * 1000
    console.screenshot("checkpoints")
    # the temporary snapshot is listed, marked, with when it goes if unused; it is not published or kept
    row = console.driver.find_element(By.XPATH, f"//tr[td/code[text()='{world['a_temporary']}']]")
    assert "(temporary)" in row.text and "if unused" in row.text and "temporary" in row.get_attribute("class")
    assert not row.find_elements(By.CSS_SELECTOR, "button.publish") and row.find_elements(By.CSS_SELECTOR, "button.delete")


def test_chat_in_the_playground(console, world, tmp_path):
    console.login(world["keys"]["alice"])
    console.open("playground", "playground")
    options = [o.get_attribute("value") for o in console.driver.find_elements(By.CSS_SELECTOR, "#pg-model option")]
    assert world["model"] in options and world["a_path"] in options and world["b_path"] not in options
    Select(console.driver.find_element(By.ID, "pg-model")).select_by_value(world["a_temporary"])  # usable until collected
    console.driver.find_element(By.ID, "pg-input").send_keys("Which attempt is better?")
    console.driver.find_element(By.ID, "pg-send").click()
    answer = console.wait(lambda: console.driver.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done=true]"),
                          timeout=120, what="the streamed answer")
    assert answer.text.strip() and int(answer.get_attribute("data-chunks")) >= 1
    console.screenshot("playground")
    # an attached image goes as an image_url part (a data: URL); this tiny model is text-only: the gateway's 400
    image = tmp_path / "red.png"
    image.write_bytes(png_bytes("red"))
    console.driver.find_element(By.ID, "pg-image").send_keys(str(image))
    console.driver.find_element(By.ID, "pg-input").send_keys("What colour is it?")
    console.driver.find_element(By.ID, "pg-send").click()
    error = console.wait(lambda: console.driver.find_element(By.CSS_SELECTOR, "#chat p.error"), timeout=60,
                         what="the refusal of an image")
    assert "takes no images" in error.text and "text-only model" in error.text, error.text
    assert console.driver.find_element(By.CSS_SELECTOR, ".msg.user img.pg-thumb").get_attribute("src").startswith(
        "data:image/png;base64,")


def _trace_file(downloads, session_id, timeout=60.0):
    name = f"temper-trace-{session_id.replace(':', '_')}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = downloads / name
        if path.exists() and path.stat().st_size and not (downloads / (name + ".crdownload")).exists():
            return json.loads(path.read_text())
        time.sleep(0.2)
    raise AssertionError(f"no {name} in {sorted(p.name for p in downloads.iterdir())}")


def test_download_a_trace_and_check_it_against_the_rows(console, world, downloads):
    console.login(world["keys"]["alice"])
    console.open(f"session/{world['a_session']}", "session")
    console.wait(lambda: console.driver.find_elements(By.CSS_SELECTOR, "#session-charts .chart canvas"), what="Session Metrics")
    console.driver.find_element(By.ID, "download-trace").click()
    trace = _trace_file(downloads, world["a_session"])
    rows = world["alice"].ListRunMetrics(records_pb2.ListRunMetricsRequest(training_run_id=world["a_run"], page_size=1000)).metrics
    requests = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "request"]
    assert len(requests) == len(rows) == 2 * STEPS + 2
    for row in rows:
        [span] = [s for s in requests if s["args"]["seq_id"] == row.seq_id]
        assert span["ts"] == row.created_unix_ms * 1000 and span["dur"] == (row.answered_unix_ms - row.created_unix_ms) * 1000
        children = sorted((e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in ("queued", "running")
                           and e["tid"] == span["tid"] and e["args"]["seq_id"] == row.seq_id), key=lambda e: e["ts"])
        assert [c["cat"] for c in children] == ["queued", "running"]
        assert children[0]["ts"] == span["ts"] and children[1]["ts"] == row.started_unix_ms * 1000
        assert children[1]["ts"] + children[1]["dur"] == span["ts"] + span["dur"]
        assert children[1]["args"]["trainer"] == row.trainer and children[1]["args"]["cycle"] == row.cycle
    sampling = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "sampling"]
    kept = world["alice"].GetSessionSamplingMetrics(records_pb2.GetSessionSamplingMetricsRequest(
        session_id=world["a_session"], page_size=1000)).records
    assert len(kept) == 3
    assert sorted((s["ts"], s["dur"], s["args"]["tokens_sampled"]) for s in sampling) == sorted(
        (r.started_unix_ms * 1000, (r.answered_unix_ms - r.started_unix_ms) * 1000, r.tokens_sampled) for r in kept)
    console.driver.find_element(By.ID, "show-timeline").click()
    console.wait(lambda: console.driver.find_elements(By.CSS_SELECTOR, "#timeline canvas"), what="the timeline")
    labels = console.driver.execute_script(  # every track's label whole: nothing cut off by its column
        "return Array.from(document.querySelectorAll('#timeline .tl-label'), e => [e.textContent, e.scrollWidth, e.clientWidth])")
    assert "counter › tokens trained per second" in [text for text, _, _ in labels], labels
    assert all(0 < inner <= shown for _, inner, shown in labels), labels
    console.screenshot("session")
    console.driver.find_element(By.ID, "timeline").screenshot(str(console.screenshot("trace_timeline")))


def test_read_the_audit_log(console, world):
    console.login(world["keys"]["alice"])
    console.open("audit", "audit")
    console.wait(lambda: console.driver.find_elements(By.CSS_SELECTOR, "#audit-table tbody tr"), what="audit rows")
    text = console.text()
    assert "session.open" in text and world["a_session"] in text
    assert "bob" not in text and world["b_session"] not in text
    console.screenshot("audit")


def test_create_and_revoke_a_key(console, world):
    console.login(world["keys"]["alice"])
    console.open("keys", "keys")
    console.driver.find_element(By.ID, "key-label").send_keys("made in the console")
    console.driver.find_element(By.CSS_SELECTOR, "#create-key button[type=submit]").click()
    made = console.wait(lambda: console.driver.find_element(By.ID, "new-key").text, what="the new key")
    assert made.startswith("tml-")
    row = console.wait(lambda: console.driver.find_element(By.XPATH, "//tr[td[text()='made in the console']]"))
    row.find_element(By.CSS_SELECTOR, "button.revoke").click()
    console.wait(lambda: "revoked" in console.driver.find_element(By.XPATH, "//tr[td[text()='made in the console']]").text,
                 what="the key revoked")
    [info] = [k for k in world["alice"].ListApiKeys(service_pb2.ListApiKeysRequest()).keys if k.label == "made in the console"]
    assert info.revoked_unix_ms > 0 and made.startswith(info.prefix)
    console.driver.execute_script("sessionStorage.clear()")
    console.driver.refresh()
    console.driver.find_element(By.ID, "login-key").send_keys(made)
    console.driver.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
    console.wait(lambda: console.driver.find_element(By.ID, "login-error").text, what="the refusal")
    assert console.driver.find_element(By.ID, "login").is_displayed()


def test_one_tenant_sees_nothing_of_another(console, world):
    console.login(world["keys"]["bob"])
    for page in ("runs", "checkpoints", "sessions", "usage", "audit", "keys"):
        assert console.open(page, page) is None
        text = console.text()
        for alices in (world["a_run"], world["a_session"], world["a_path"], "alice"):
            assert alices not in text, (page, alices)
    assert console.open("runs", "runs") is None and world["b_run"] in console.text()  # bob's own are there
    for hash_path, page in ((f"run/{world['a_run']}", "run"), (f"session/{world['a_session']}", "session")):
        error = console.open(hash_path, page)
        assert error is not None and "alice" not in error
    status = console.driver.execute_script(
        "return fetch(arguments[0], {headers: {'X-API-Key': sessionStorage.getItem('temper.console.apiKey')}})"
        ".then(r => r.status)", f"/api/v1/sessions/{world['a_session']}/trace")
    assert status == 404
    assert not console.driver.find_element(By.ID, "nav-operator").is_displayed()
    assert console.open("operator", "operator") is not None  # a tenant key: PERMISSION_DENIED


def test_the_operator_sees_the_workers(console, world):
    console.login(world["keys"]["ops"])
    assert console.driver.find_element(By.ID, "nav-operator").is_displayed()
    assert console.open("operator", "operator") is None
    workers = console.driver.find_element(By.ID, "workers-table").text
    assert "trainer" in workers and "sampler" in workers and "up" in workers
    assert world["stack"].service("trainer").address.split(":")[-1] in workers
    console.screenshot("operator_workers")


STEP_TICKS = """
const done = arguments[arguments.length - 1];
const ticks = (chart) => Array.from(chart.plot.axes[0]._values || []);
import("/console/static/js/charts.js").then((charts) => {
  const few = charts.lineChart("two steps", [0, 1], [{ label: "y", values: [2, 1] }], { integerX: true, xLabel: "step" });
  document.body.append(few);
  requestAnimationFrame(() => requestAnimationFrame(() => {
    done({ run: ticks(document.querySelector("#run-charts [data-chart='loss (sum)']")), few: ticks(few) });
    few.remove();
  }));
});
"""


def test_cosmetics_nav_ticks_and_unknown_routes(console, world):
    console.driver.get(f"{world['url']}/console/")
    console.driver.execute_script("sessionStorage.clear()")
    console.driver.refresh()
    console.wait(lambda: console.driver.find_element(By.ID, "login").is_displayed(), what="the login form")
    assert not console.driver.find_element(By.ID, "nav").is_displayed()  # logged out: no nav
    assert console.driver.execute_script("return getComputedStyle(document.getElementById('nav')).display") == "none"
    console.login(world["keys"]["alice"])
    assert console.driver.find_element(By.ID, "nav").is_displayed()
    for route in ("runs/nobody:train:7", f"run/{world['a_run']}x", "no-such-page", "usage/extra"):
        error = console.open(route, "none")
        assert error and console.driver.find_elements(By.ID, "not-found"), (route, error)
        assert not console.driver.find_elements(By.ID, "runs-table"), route  # never the list in its place
    assert console.open(f"runs/{world['a_run']}", "run") is None  # #/runs/<id> is the run's page
    console.wait(lambda: console.driver.find_elements(By.CSS_SELECTOR, "#run-charts .chart canvas"), what="the curves")
    requests = console.driver.execute_script(  # kind, loss, loss / Σ weights of each request shown
        "return Array.from(document.querySelectorAll('#requests-table tbody tr'), tr => [1, 4, 5].map(i => tr.cells[i].textContent))")
    assert {kind for kind, _, _ in requests} >= {"forward_backward", "optim_step"}
    for kind, loss, per_weight in requests:  # a row without a loss shows none (not 0)
        if kind == "forward_backward":
            assert float(loss) > 0 and float(per_weight) > 0, (kind, loss, per_weight)
        else:
            assert loss == per_weight == "—", (kind, loss, per_weight)
    cards = console.driver.find_element(By.CSS_SELECTOR, ".cards").text
    assert "family" in cards and "qwen3" in cards
    console.driver.set_script_timeout(30)
    ticks = console.driver.execute_async_script(STEP_TICKS)
    for name, labels in ticks.items():  # whole steps only: no 0.5
        shown = [t for t in labels if t != ""]
        assert len(shown) >= 2 and all(t.lstrip("-").isdigit() for t in shown), (name, labels)
