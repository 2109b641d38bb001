"""Several tenants and runs through the real scheduler: co-batched training equals training alone,
usage is recorded per tenant and run, and a full queue pushes back without losing work."""

import time

import grpc
import numpy as np
import pytest
from safetensors.numpy import load_file

from fixtures_stack import request_rows, sft_datum, raw_stub
from temper.client import AdamParams, ModelInput, SamplingParams, ServiceClient, convert
from temper.v1 import service_pb2, service_pb2_grpc

ADAM = AdamParams(learning_rate=5e-3, eps=1e-8)


def weights(client, path, folder):
    return load_file(str(client.download_checkpoint(path, folder) / "adapter_model.safetensors"))


def data_for(seed):
    rng = np.random.default_rng(seed)
    return [sft_datum(rng.integers(0, 512, int(n)).tolist()) for n in rng.integers(6, 16, 2)]


def test_runs_trained_interleaved_end_where_they_end_alone(stack, tiny_model_dir, tmp_path):
    alice, bob = stack.client("alice"), stack.client("bob")
    try:
        configs = {"a": (alice, 21, dict(rank=4)), "b": (bob, 22, dict(rank=8, train_mlp=False, train_unembed=False))}
        together = {k: c.create_lora_training_client(tiny_model_dir, seed=s, **kw) for k, (c, s, kw) in configs.items()}
        alone = {k: c.create_lora_training_client(tiny_model_dir, seed=s, **kw) for k, (c, s, kw) in configs.items()}
        data = {"a": data_for(1), "b": data_for(2)}
        pending = []
        for _ in range(4):  # everything submitted before waiting: the runs share scheduler cycles
            for key, tc in together.items():
                pending += [tc.forward_backward(data[key]), tc.optim_step(ADAM)]
        [f.result() for f in pending]
        for key, tc in alone.items():  # one run at a time, waiting on each request
            for _ in range(4):
                tc.forward_backward(data[key]).result()
                tc.optim_step(ADAM).result()
        for key in configs:
            client = configs[key][0]
            got = weights(client, together[key].save_weights_for_sampler("w").result().path, tmp_path / f"t{key}")
            want = weights(client, alone[key].save_weights_for_sampler("w").result().path, tmp_path / f"a{key}")
            assert got.keys() == want.keys()
            for name in got:
                np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=0, err_msg=name)
            assert any(np.abs(v).max() > 0 for k, v in got.items() if "lora_B" in k)  # they did train

        usage = alice.get_usage()
        assert usage["tenant"] == "alice"
        expected = sum(d.model_input.length for d in data["a"]) * 4
        assert usage["runs"][together["a"].model_id] == {"tokens_trained": expected, "steps": 4}
        sampler = alice.create_sampling_client(base_model=tiny_model_dir)
        sampler.sample(ModelInput.from_ints([1, 2, 3]), 2, SamplingParams(max_tokens=5, stop=[])).result()
        assert alice.get_usage()["samplers"][sampler.sampler_id] == 10
        assert together["b"].model_id not in usage["runs"]  # bob's runs are bob's
    finally:
        alice.close()
        bob.close()


@pytest.fixture(scope="module")
def tight_stack(tiny_model_dir, postgres_url, tmp_path_factory):
    """A stack whose scheduler holds at most 2 ready training requests (in all and per tenant) and 3 per run."""
    from temper.localstack import LocalStack

    env = {"TEMPER_SCHEDULER_MAX_QUEUED_REQUESTS": "2", "TEMPER_SCHEDULER_MAX_QUEUED_PER_TENANT": "2",
           "TEMPER_SCHEDULER_MAX_QUEUED_PER_RUN": "3", "TEMPER_SCHEDULER_TENANT_WEIGHTS": '{"alice": 2.0}'}
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("tight"), database_url=postgres_url, extra_env=env,
                    num_threads=1) as local:
        local.address = local.start()
        yield local


def test_full_queue_answers_resource_exhausted_and_the_client_retries(tight_stack, tiny_model_dir, postgres_url):
    with tight_stack.client("alice") as client:
        assert client.get_usage()["weight"] == 2.0
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
        stub = raw_stub(tight_stack, "alice")
        data = [convert.datum_to_proto(sft_datum(list(range(1, 40))))]

        def fb(seq):
            return service_pb2.ForwardBackwardRequest(training_run_id=run.model_id, seq_id=seq, data=data, loss_fn="cross_entropy")

        # Parked behind the missing seq 1, three requests count against their run only: more than the
        # scheduler-wide and per-tenant limits (2), but not more than the run's (3).
        waiting = [stub.ForwardBackward.future(fb(seq)) for seq in (2, 3, 4)]
        deadline = time.monotonic() + 60
        while [row[0] for row in request_rows(postgres_url, run.model_id)] != [2, 3, 4]:  # all three admitted
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as err:
            stub.ForwardBackward(fb(5))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"run {run.model_id} has 3 queued requests (limit 3)" in err.value.details()
        assert not any(f.done() for f in waiting)

        # Another tenant is not locked out by alice's parked backlog: its request is admitted and runs.
        with tight_stack.client("bob") as bob:
            other = bob.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
            assert other.forward_backward([sft_datum(list(range(1, 40)))]).result(timeout=60).metrics["loss:sum"] > 0
        assert not any(f.done() for f in waiting)

        first = stub.ForwardBackward(fb(1))
        assert [f.result(timeout=60) for f in waiting] == [first, first, first]  # acknowledged work was kept
        assert stub.ForwardBackward(fb(5)) == first  # the pushed-back seq is accepted when resent

        # Through the client, a burst beyond the bound is retried with backoff: every request lands,
        # each run's requests run in order, none is lost or run twice.
        fresh = [client.create_lora_training_client(tiny_model_dir, rank=4, seed=10 + i) for i in range(6)]
        datum = sft_datum(list(range(1, 400)))
        futures = [(run, [run.forward_backward([datum] * 4) for _ in range(3)]) for run in fresh]
        for run, futs in futures:
            losses = [f.result().metrics["loss:sum"] for f in futs]
            assert losses[0] == losses[1] == losses[2] > 0  # no optim_step between: same weights each time
            assert client.training_client(run.model_id).get_info().next_seq_id == 4
        assert client.get_usage()["runs"][fresh[0].model_id]["tokens_trained"] == 3 * 4 * 398
