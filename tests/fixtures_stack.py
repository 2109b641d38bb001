"""pytest plugin: the tiny test model, a trainer engine on it, and the real three-process stack."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file
from sqlalchemy import create_engine, text

from temper.client import Datum, ModelInput, ServiceClient


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from temper.services.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def stack(tiny_model_dir, postgres_url, tmp_path_factory):
    """Scheduler + trainer + sampler as separate processes on loopback, scheduler on Postgres."""
    from temper.localstack import LocalStack

    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("stack"), database_url=postgres_url, num_threads=1) as local:
        local.address = local.start()
        yield local


@pytest.fixture
def service_client(stack):
    client = ServiceClient(stack.address)
    yield client
    client.close()


def sft_datum(tokens: list[int], weights: list[float] | None = None) -> Datum:
    """Next-token datum: input tokens[:-1], targets tokens[1:], weight 1 by default."""
    n = len(tokens) - 1
    w = np.ones(n, dtype=np.float32) if weights is None else np.asarray(weights, dtype=np.float32)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64), "weights": w},
    )


def request_rows(url, run_id):
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            text("select seq_id, kind, status from requests where training_run_id = :r order by seq_id"), {"r": run_id}
        ).all()
    engine.dispose()
    return [tuple(r) for r in rows]


def adapter_weights(client, path, tmp_path):
    folder = client.download_checkpoint(path, tmp_path / path.replace("/", "_").replace(":", "_"))
    return load_file(str(folder / "adapter_model.safetensors"))


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
