"""tinker-cookbook 0.6.1, unmodified, against the gateway (services/gateway) on the tiny model: a
supervised recipe (`recipes.chat_sl.train` on the JSONL conversations the cookbook ships, then resumed
from a checkpoint), the RL recipe `recipes.math_rl.train env=arithmetic` (synthetic problems, the
cookbook's default `stable_reinforce` loss), and the cookbook's RL trainer on a tiny environment written
with its RL API (tests/stack/cookbook_even_tokens.py) whose rewards vary, so the update is not zero.

Everything is configured the way a user would: the recipes' own `key=value` CLI, `model_name=<the
tiny model's folder>` (the cookbook's `get_tokenizer` loads a local folder), `renderer_name=role_colon`
(the model-agnostic renderer), and only TINKER_BASE_URL / TINKER_API_KEY to find the server. No hub:
the runs are offline (HF_*_OFFLINE) and outbound HTTPS goes to a dead proxy (the cookbook's pricing
fetch then fails at once; it is optional). The cookbook is installed by `make venv` (pip --no-deps plus
the `cookbook` extra), so a missing one fails here rather than skipping."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tinker
    import tinker_cookbook
except ImportError as e:  # pragma: no cover - only on a venv not built by `make venv`
    tinker = tinker_cookbook = None
    MISSING = f"{e}: `make venv` installs tinker (the gateway extra) and tinker-cookbook (--no-deps + the cookbook extra)"
else:
    MISSING = None

from temper.localstack import LocalStack  # noqa: E402

HERE = Path(__file__).resolve().parent
CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl" if tinker_cookbook else None
RECIPE_TIMEOUT = 300
pytestmark = pytest.mark.slow  # about a minute on 2 idle cores: six cookbook processes plus the stack


@pytest.fixture(scope="module")
def cb_stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    if MISSING:
        pytest.fail(MISSING)
    url = new_postgres_database("temper_cookbook")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("cookbook"), database_url=url, num_threads=1, gateway=True) as local:
        local.start()
        yield local


@pytest.fixture(scope="module")
def rest(cb_stack):
    return tinker.RestClient(base_url=cb_stack.gateway_url, api_key=cb_stack.api_key)


def run_cookbook(stack, cwd: Path, *argv: str) -> str:
    """Run one cookbook entry point as a user would (`python -m <recipe> key=value ...`, or a script)."""
    env = {**os.environ, "TINKER_BASE_URL": stack.gateway_url, "TINKER_API_KEY": stack.api_key, "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    cmd = [sys.executable, *argv] if argv[0].endswith(".py") else [sys.executable, "-m", *argv]
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", timeout=RECIPE_TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    assert "Training completed successfully" in proc.stdout, proc.stdout[-3000:]
    return proc.stdout


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_metrics(log_path: Path) -> list[dict]:
    """The per-step rows of metrics.jsonl (the RL trainer ends with a row of token counters only)."""
    rows = [r for r in jsonl(log_path / "metrics.jsonl") if len(r) > 12]
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {row.get('step')}: not finite: {bad}"
    return rows


def run_id_of(tinker_path: str) -> str:
    assert tinker_path.startswith("tinker://"), tinker_path
    return tinker_path.removeprefix("tinker://").split("/", 1)[0]


def assert_checkpoints_listed(rest, records: list[dict]) -> None:
    """Every checkpoint the cookbook wrote to checkpoints.jsonl is in the RestClient's listing of its run."""
    for run_id in {run_id_of(r["state_path"]) for r in records}:
        listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
        wanted = {r[k] for r in records if run_id_of(r["state_path"]) == run_id for k in ("state_path", "sampler_path") if r.get(k)}
        assert wanted <= listed, f"{run_id}: missing from the listing: {wanted - listed}"


def test_chat_sl_recipe_trains_checkpoints_and_resumes(cb_stack, rest, tiny_model_dir, tmp_path):
    log = tmp_path / "chat_sl"
    args = ["tinker_cookbook.recipes.chat_sl.train", f"model_name={tiny_model_dir}", "renderer_name=role_colon",
            f"dataset={CONVERSATIONS}", "batch_size=8", "lora_rank=4", "learning_rate=1e-3", "save_every=1",
            f"log_path={log}"]
    run_cookbook(cb_stack, tmp_path, *args, "max_steps=2", "behavior_if_log_dir_exists=delete")

    rows = step_metrics(log)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["num_sequences"] == 8 and r["num_loss_tokens"] > 0 and r["train_mean_nll"] > 0 for r in rows)
    records = jsonl(log / "checkpoints.jsonl")
    assert [r["name"] for r in records] == ["000001", "final"]
    assert_checkpoints_listed(rest, records)
    first_run = run_id_of(records[0]["state_path"])
    run = rest.get_training_run(first_run).result()
    assert run.base_model == tiny_model_dir and run.lora_rank == 4

    # As if the run had died after its step-1 checkpoint: `resume` continues from it, with the optimizer
    # state (create_training_client_from_state_with_optimizer, and GET /training_runs/{id} for the renderer check).
    (log / "checkpoints.jsonl").write_text(json.dumps(records[0]) + "\n")
    out = run_cookbook(cb_stack, tmp_path, *args, "max_steps=3", "behavior_if_log_dir_exists=resume")
    assert f"Resumed training from {records[0]['state_path']}" in out
    resumed = jsonl(log / "checkpoints.jsonl")
    assert resumed[-1]["name"] == "final" and run_id_of(resumed[-1]["state_path"]) != first_run
    assert_checkpoints_listed(rest, resumed)
    assert [r["step"] for r in step_metrics(log)][-2:] == [1, 2]


@pytest.mark.parametrize("mode", [(), ("loss_fn=importance_sampling", "max_steps_off_policy=2")], ids=["sync", "async"])
def test_math_rl_arithmetic_recipe(cb_stack, rest, tiny_model_dir, tmp_path, mode):
    """The cookbook's default loss (stable_reinforce, sampling with record_stability_info), and its async
    off-policy mode (sampling goes on while the trainer steps; samples up to 2 steps stale)."""
    log = tmp_path / "math_rl"
    run_cookbook(cb_stack, tmp_path, "tinker_cookbook.recipes.math_rl.train", f"model_name={tiny_model_dir}",
                 "renderer_name=role_colon", "env=arithmetic", "groups_per_batch=4", "group_size=4", "max_tokens=5",
                 "lora_rank=4", "max_steps=2", "save_every=1", "eval_every=0", f"log_path={log}",
                 "behavior_if_log_dir_exists=delete", *mode)
    rows = step_metrics(log)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["env/all/total_episodes"] == 16 and r["env/all/ac_tokens_per_turn"] > 0
        # sampler and trainer see the same weights: the sampled logprobs are the trained ones
        assert abs(r["optim/kl_sample_train_v1"]) < 1e-3 and math.isfinite(r["grad_norm:mean"])
    records = jsonl(log / "checkpoints.jsonl")
    assert {"000001", "final"} <= {r["name"] for r in records}
    assert_checkpoints_listed(rest, records)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "stable_reinforce"])
def test_cookbook_rl_trainer_on_a_custom_env(cb_stack, rest, tiny_model_dir, tmp_path, loss_fn):
    log = tmp_path / f"even_{loss_fn}"
    run_cookbook(cb_stack, tmp_path, str(HERE / "cookbook_even_tokens.py"), tiny_model_dir, str(log), loss_fn, "2")
    rows = step_metrics(log)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["env/all/by_group/frac_mixed"] > 0  # rewards vary within groups: a real update
        assert r["grad_norm:mean"] > 0 and abs(r["optim/kl_sample_train_v1"]) < 1e-3
        assert math.isfinite(r["kl_policy_base"])  # compute_logprobs on the base model (the KL reference)
    records = jsonl(log / "checkpoints.jsonl")
    assert {"000001", "final"} <= {r["name"] for r in records}
    assert_checkpoints_listed(rest, records)


@pytest.fixture(scope="module")
def det_cb_stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    """A stack whose runs and base-model samplers are deterministic unless they say otherwise
    (docs/deterministic.md): how the unmodified cookbook, which cannot ask, gets the mode."""
    url = new_postgres_database("temper_cookbook_det")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("cookbook-det"), database_url=url, num_threads=1, gateway=True,
                    extra_env={"TEMPER_SCHEDULER_DETERMINISTIC_RUNS": "true"}) as local:
        local.start()
        yield local


def test_cookbook_rl_in_deterministic_mode_reads_kl_sample_train_zero(det_cb_stack, tiny_model_dir, tmp_path):
    """Issue 23: the cookbook's own sampler-vs-trainer KL estimates read exactly 0 on its on-policy steps
    (on the default stack above they are only < 1e-3), with the base-model KL reference scored too."""
    log = tmp_path / "even_deterministic"
    run_cookbook(det_cb_stack, tmp_path, str(HERE / "cookbook_even_tokens.py"), tiny_model_dir, str(log), "importance_sampling", "2")
    rows = step_metrics(log)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["env/all/by_group/frac_mixed"] > 0 and r["grad_norm:mean"] > 0  # a real update, so step 1 is new weights
        assert r["optim/kl_sample_train_v1"] == 0.0 and r["optim/kl_sample_train_v2"] == 0.0, r
        assert math.isfinite(r["kl_policy_base"])
