"""Two trainers behind one scheduler: runs are spread over both, each trainer has its own lane (its
runs' cycles run while the other trainer's do), and training gives the same weights on either."""

import numpy as np
import pytest

from fixtures_stack import adapter_weights, request_rows, sft_datum
from temper.client import AdamParams
from test_faults import metric

ADAM = AdamParams(learning_rate=5e-3, eps=1e-8)
TRAINERS = ("trainer", "trainer-1")


@pytest.fixture(scope="module")
def scaleout(tiny_model_dir, new_postgres_database, tmp_path_factory):
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_scaleout")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("scaleout"), database_url=url, num_threads=1, num_trainers=2) as local:
        local.address = local.start()
        local.url = url
        yield local


def on_each_trainer(stack, client, base_model, seed, **lora):
    """A training client on each trainer, all alike (same seed and LoRA config): runs are created
    until each trainer of the stack holds one (the trainers' resident-adapter gauges say where each went).
    Every trainer the stack runs counts: placement is by load, so a run may go to one that joined later."""
    names = [s.name for s in stack.services_of("trainer")]
    placed = {}
    for _ in range(32):
        before = {name: metric(stack.service(name), "temper_trainer_resident_adapters") for name in names}
        tc = client.create_lora_training_client(base_model, seed=seed, **lora).result(timeout=300)  # created: then count
        grown = [name for name in names if metric(stack.service(name), "temper_trainer_resident_adapters") == before[name] + 1]
        assert len(grown) == 1, (before, grown)
        placed.setdefault(grown[0], tc)
        if len(placed) == len(names):
            return placed
    raise AssertionError(f"32 runs, and all on {list(placed)}")


def data_for(seed):
    rng = np.random.default_rng(seed)
    return [sft_datum(rng.integers(0, 512, int(n)).tolist()) for n in rng.integers(6, 16, 2)]


def test_runs_spread_over_two_trainers_all_complete_and_train_alike_on_either(scaleout, tiny_model_dir, tmp_path):
    clients = {"alice": scaleout.client("alice"), "bob": scaleout.client("bob")}
    try:
        configs = {"alice": (31, dict(rank=4)), "bob": (32, dict(rank=8, train_mlp=False, train_unembed=False))}
        runs = {tenant: on_each_trainer(scaleout, clients[tenant], tiny_model_dir, seed, **lora)
                for tenant, (seed, lora) in configs.items()}
        data = {"alice": data_for(1), "bob": data_for(2)}
        tokens_before = {name: metric(scaleout.service(name), "temper_trainer_tokens_trained_total") for name in TRAINERS}
        pending = []
        for _ in range(3):  # all submitted before waiting: both trainers' lanes have work at once
            for tenant, placed in runs.items():
                for tc in placed.values():
                    pending += [tc.forward_backward(data[tenant]), tc.optim_step(ADAM)]
        for future in pending:
            future.result(timeout=600)

        per_trainer = 3 * sum(d.model_input.length for tenant in runs for d in data[tenant])
        for name in TRAINERS:  # each trainer trained its two runs, and nothing of the others'
            assert metric(scaleout.service(name), "temper_trainer_tokens_trained_total") - tokens_before[name] == per_trainer
        for placed in runs.values():
            for tc in placed.values():
                assert request_rows(scaleout.url, tc.model_id) == [
                    (seq, "forward_backward" if seq % 2 else "optim_step", "done") for seq in range(1, 7)]

        # twins on different trainers end alike, and alike a twin trained alone, one request at a time
        for tenant, placed in runs.items():
            seed, lora = configs[tenant]
            alone = clients[tenant].create_lora_training_client(tiny_model_dir, seed=seed, **lora)
            for _ in range(3):
                alone.forward_backward(data[tenant]).result(timeout=600)
                alone.optim_step(ADAM).result(timeout=600)
            want = adapter_weights(clients[tenant], alone.save_weights_for_sampler("alone").result().path, tmp_path)
            assert any(np.abs(v).max() > 0 for k, v in want.items() if "lora_B" in k)  # it did train
            for name, tc in placed.items():
                got = adapter_weights(clients[tenant], tc.save_weights_for_sampler(f"on-{name}").result().path, tmp_path)
                assert got.keys() == want.keys()
                for key in got:
                    np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=f"{tenant} on {name}: {key}")
    finally:
        for client in clients.values():
            client.close()


def test_a_stopped_trainer_holds_only_the_runs_placed_on_it(scaleout, tiny_model_dir):
    with scaleout.client("carol") as client:
        runs = on_each_trainer(scaleout, client, tiny_model_dir, seed=5, rank=2)
        scaleout.pause("trainer-1")  # its port stays open, nothing answers
        try:
            stuck = runs["trainer-1"].forward_backward(data_for(5))
            for _ in range(2):  # the other trainer's lane goes on, cycle after cycle
                runs["trainer"].forward_backward(data_for(6)).result(timeout=600)
                runs["trainer"].optim_step(ADAM).result(timeout=600)
            assert not stuck.done()
        finally:
            scaleout.resume("trainer-1")
        assert stuck.result(timeout=600).metrics["loss:sum"] > 0
        assert [status for _, _, status in request_rows(scaleout.url, runs["trainer-1"].model_id)] == ["done"]
