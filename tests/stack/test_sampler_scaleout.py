"""Two samplers behind one scheduler, on the real processes and Postgres: concurrent sampling is
spread over both, a checkpoint's requests stay on the sampler that holds its adapter, and a sampler
killed with requests in flight loses none of them (the other sampler answers, the same greedy tokens),
then comes back as a new incarnation without its adapters and serves again."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fixtures_stack import sft_datum
from temper.client import AdamParams, ModelInput, SamplingParams

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
PROMPTS = [[3, 14, 15, 92], [65, 35, 89], [79, 32, 38, 46, 26], [43, 38, 32]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, stop=[])  # exactly 12 tokens each
WAIT_SECONDS = 180  # how long a condition may take to come true on a busy machine before the test fails


@pytest.fixture(scope="module")
def scaleout_stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_sampler_scaleout")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("scaleout"), database_url=url, num_threads=1, num_samplers=2) as local:
        local.address = local.start()
        yield local


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    return {name + (str(sorted(labels.items())) if labels else ""): value
            for family in text_string_to_metric_families(text) for name, labels, value, *_ in family.samples}


def tokens_sampled(stack) -> dict[str, float]:
    """Sampler name -> tokens it generated (its own metrics endpoint)."""
    return {s.name: scrape(s.metrics_url).get("temper_sampler_tokens_sampled_total", 0.0) for s in stack.services_of("sampler")}


def scheduler_series(stack, name: str, address: str) -> float:
    return scrape(stack.service("scheduler").metrics_url).get(f"{name}{[('sampler', address)]}", 0.0)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)


def trained_sampler(client, tiny_model_dir, name: str):
    run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=11)
    for _ in range(2):
        run.forward_backward([sft_datum(PATTERN)]).result()
        run.optim_step(AdamParams(learning_rate=5e-2)).result()
    return run.save_weights_and_get_sampling_client(name)


def greedy(sampler, prompts) -> list[list[int]]:
    futures = [sampler.sample(ModelInput.from_ints(p), 1, GREEDY) for p in prompts]
    return [list(f.result().sequences[0].tokens) for f in futures]


def test_concurrent_sampling_uses_both_samplers_and_a_checkpoint_stays_where_it_is_loaded(scaleout_stack, tiny_model_dir):
    stack = scaleout_stack
    with stack.client("ann") as client:
        tuned = trained_sampler(client, tiny_model_dir, "spread")
        base = client.create_sampling_client(base_model=tiny_model_dir)
        before = tokens_sampled(stack)
        futures = [s.sample(ModelInput.from_ints(p), 1, GREEDY) for _ in range(3) for p in PROMPTS for s in (base, tuned)]
        results = [f.result() for f in futures]
        after = tokens_sampled(stack)
        moved = {name: after[name] - before[name] for name in after}
        assert all(len(r.sequences[0].tokens) == 12 for r in results)
        assert sum(moved.values()) == 12 * len(futures)
        assert all(count > 0 for count in moved.values()), moved  # both samplers served some

        # one checkpoint, one request at a time (equal loads): always the same sampler
        before = tokens_sampled(stack)
        answers = [greedy(tuned, [PROMPTS[0]])[0] for _ in range(6)]
        moved = {name: count - before[name] for name, count in tokens_sampled(stack).items()}
        assert sorted(moved.values()) == [0, 6 * 12], moved
        assert all(a == answers[0] for a in answers)


def test_a_sampler_killed_with_requests_in_flight_loses_none_and_comes_back_without_its_adapters(scaleout_stack, tiny_model_dir):
    stack = scaleout_stack
    with stack.client("bea") as client:
        tuned = trained_sampler(client, tiny_model_dir, "failover")
        base = client.create_sampling_client(base_model=tiny_model_dir)
        expected_tuned, expected_base = greedy(tuned, PROMPTS), greedy(base, PROMPTS)
        assert expected_tuned != expected_base  # the adapter changes the answers

        # the sampler holding the adapter: the one a request for it moves
        before = tokens_sampled(stack)
        greedy(tuned, PROMPTS[:1])
        holder = next(name for name, count in tokens_sampled(stack).items() if count > before[name])
        address = stack.service(holder).address

        # freeze it, so the adapter's requests hang there (in flight), then kill it
        stack.pause(holder)
        tuned_futures = [tuned.sample(ModelInput.from_ints(p), 1, GREEDY) for p in PROMPTS]
        wait_for(lambda: scheduler_series(stack, "temper_scheduler_sampler_requests_in_flight", address) == len(PROMPTS),
                 f"{len(PROMPTS)} requests in flight on {holder}")
        base_futures = [base.sample(ModelInput.from_ints(p), 1, GREEDY) for p in PROMPTS]  # the other sampler: less loaded
        stack.service(holder).process.kill()
        assert [list(f.result().sequences[0].tokens) for f in tuned_futures] == expected_tuned
        assert [list(f.result().sequences[0].tokens) for f in base_futures] == expected_base
        assert scheduler_series(stack, "temper_scheduler_sampler_failures_total", address) >= len(PROMPTS)
        assert greedy(tuned, PROMPTS) == expected_tuned and greedy(base, PROMPTS) == expected_base  # one sampler left

        # it comes back empty, as a new incarnation: once it serves again, the scheduler knew it restarted
        stack.restart(holder, crash=True)

        def serving_again() -> bool:
            assert greedy(base, PROMPTS) == expected_base
            return tokens_sampled(stack)[holder] > 0

        wait_for(serving_again, f"{holder} serving again")
        log = stack.service("scheduler").log_path.read_text()
        assert f"sampler {address} restarted (incarnation" in log
        assert greedy(tuned, PROMPTS * 2) == expected_tuned * 2
