"""Owner hints on two replicas (issue 32; common/owner_hints.py): once a run's first lane verb is
answered, temper.client sends the run's later lane verbs to the replica that owns its lane, so no
replica forwards them; the answers are those of the same runs trained without hints (deterministic
runs, bit for bit); and after the owner of a lane is killed the client's verbs still succeed: the
hint is dropped, the verb resent through round_robin, and the survivor named as the new owner."""

from __future__ import annotations

import signal
import threading

from safetensors.numpy import load_file

from fixtures_stack import assert_same_weights
from replica_fixtures import ADAM, counter, data_for, run_lanes, two, wait_balanced  # noqa: F401 - two: a fixture

RUNS = 4  # two on each trainer's lane
STEPS = 3
FORWARDED = "temper_scheduler_forwarded_total"


def forwarded(stack) -> float:
    return sum(counter(stack, s.name, FORWARDED) for s in stack.services_of("scheduler") if s.process.poll() is None)


def losses(output) -> dict[str, float]:
    return {key: value for key, value in output.metrics.items() if key.startswith("loss")}


def train(runs, data, steps: int) -> list[list[dict]]:
    """Each run in a thread of its own, ``steps`` rounds of forward_backward then optim_step, each waited
    for (so both lanes are busy at once); every run's forward_backward losses in order."""
    out: list[list[dict]] = [[] for _ in runs]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            for _ in range(steps):
                out[i].append(losses(runs[i].forward_backward(data[i]).result()))
                runs[i].optim_step(ADAM).result()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors, errors
    return out


def weights(client, tc, name: str, folder):
    path = tc.save_weights_for_sampler(name).result().path
    return load_file(str(client.download_checkpoint(path, folder) / "adapter_model.safetensors"))


def test_hinted_lane_verbs_go_to_the_owner_answer_the_same_and_survive_the_owners_death(two, tiny_model_dir, tmp_path):
    hinted, plain = two.client("tina"), two.client("tina")
    plain.runtime.owners = None  # the twins' client: round_robin only, its verbs forwarded as before hints
    assert hinted.runtime.owners is not None  # a list of two addresses: hints on
    try:
        runs = [hinted.create_lora_training_client(tiny_model_dir, seed=300 + i, rank=4, deterministic=True).result()
                for i in range(RUNS)]
        data = [data_for(400 + i) for i in range(RUNS)]
        lanes = run_lanes(two.url, [tc.model_id for tc in runs])
        assert len(set(lanes.values())) == 2  # runs on both lanes
        owners = wait_balanced(two, two.url)
        assert len(set(owners.values())) == 2  # each replica owns one lane

        got = train(runs, data, 1)  # the first verbs: through round_robin, some forwarded; they name the owners
        for tc in runs:
            assert hinted.runtime.owners.hints.get(tc.model_id) == owners[lanes[tc.model_id]]
        before = forwarded(two)
        for i, losses_now in enumerate(train(runs, data, STEPS - 1)):
            got[i] += losses_now
        assert forwarded(two) == before  # every later lane verb went straight to its lane's owner
        assert wait_balanced(two, two.url) == owners  # (the lanes stayed where they were meanwhile)

        # the same runs through the plain client (forwarded as before hints): the same losses and weights
        twins = [plain.create_lora_training_client(tiny_model_dir, seed=300 + i, rank=4, deterministic=True).result()
                 for i in range(RUNS)]
        want = train(twins, data, STEPS)
        assert forwarded(two) > before  # the twins' verbs were forwarded: the counter does count them
        assert got == want
        for i in range(RUNS):
            assert_same_weights(weights(hinted, runs[i], "w", tmp_path / f"g{i}"), weights(plain, twins[i], "w", tmp_path / f"t{i}"))

        # the owner of a lane dies: its runs' hinted verbs fail, are resent through round_robin, and
        # succeed once the survivor takes the lane, which the answers then name
        victim_lane = sorted(owners)[0]
        victim = next(s for s in two.services_of("scheduler") if s.address == owners[victim_lane])
        survivor = next(s for s in two.services_of("scheduler") if s is not victim)
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(timeout=30)
        train(runs, data, 2)
        for tc in runs:
            assert hinted.runtime.owners.hints.get(tc.model_id) == survivor.address
        assert wait_balanced(two, two.url) == {lane: survivor.address for lane in owners}
    finally:
        hinted.close()
        plain.close()
