"""pytest plugin: the tiny test model, a trainer engine on it, and the real three-process stack."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import grpc
import numpy as np
import pytest
from safetensors.numpy import load_file
from sqlalchemy import create_engine, text

from temper.client import Datum, ModelInput
from temper.common.codec import encode_floats, encode_tokens
from temper.v1 import service_pb2_grpc, types_pb2


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from temper.services.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


class _TinyVlModels(Mapping):
    """family -> folder of every tiny vision-language family, each built on first use (a session that
    uses one family does not build the others)."""

    def __init__(self, root):
        from temper.services.models.tiny_vision import TINY_VL_FAMILIES

        self.root, self.families, self.built = root, tuple(TINY_VL_FAMILIES), {}

    def __getitem__(self, family: str) -> str:
        from temper.services.models.tiny_vision import build_tiny_vl_model

        if family not in self.families:
            raise KeyError(family)
        if family not in self.built:
            self.built[family] = str(build_tiny_vl_model(self.root / family, family))
        return self.built[family]

    def __iter__(self):
        return iter(self.families)

    def __len__(self) -> int:
        return len(self.families)


@pytest.fixture(scope="session")
def vl_model_dirs(tmp_path_factory) -> Mapping[str, str]:
    """The tiny vision-language models (services/models/tiny_vision.py), family -> folder, built once per session."""
    return _TinyVlModels(tmp_path_factory.mktemp("vl-models"))


@pytest.fixture(scope="session")
def small_vocab_vl_model(tmp_path_factory) -> str:
    """The tiny Qwen3-VL-MoE with a 4,096-entry vocabulary (its special tokens at the end of it: other ids than
    the real ones, as the benchmarks' tiny models), for the tests that train it through the whole stack for
    many steps: the real 151,936-row head is about 95% of a CPU training step (the lm_head and its
    log-softmax), and the cookbook recipe and the shape-colour demo find the special tokens by their text."""
    from temper.services.models.tiny_vision import build_tiny_vl_model

    folder = tmp_path_factory.mktemp("vl-small-vocab") / "qwen3_vl_moe"
    return str(build_tiny_vl_model(folder, "qwen3_vl_moe", vocab_size=4096))


def png_bytes(color: str = "red", size: tuple[int, int] = (64, 64), fmt: str = "PNG") -> bytes:
    """A solid-colour image file (PNG or JPEG) for image inputs."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, fmt)
    return out.getvalue()


def tiny_vl_config_folder(folder) -> str:
    """Writes a tiny Qwen3-VL folder without weights into ``folder``: config.json, tokenizer (Qwen3's real
    special ids), preprocessor_config.json; returns its path."""
    import json

    from temper.services.models import tiny_vision

    tokenizer = tiny_vision.qwen_tokenizer()
    config = tiny_vision.TINY_VL_FAMILIES["qwen3_vl"](64, 2, tokenizer)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(tiny_vision._preprocessor_config(config)))
    return str(folder)


class RedSampler:
    """The Sample verb of a scheduler stand-in for the gateway's image tests: records each request in
    ``self.samples`` and answers "red" then EOS (``self.tokenizer``'s ids), -0.5 a token."""

    async def verb(self, method, request, key):
        assert method == "Sample"
        self.samples.append(request)
        tokens = self.tokenizer.encode("red", add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return types_pb2.SampleResponse(sequences=[types_pb2.SampledSequence(
            tokens=encode_tokens(tokens), logprobs=encode_floats([-0.5] * len(tokens)), stop_reason=types_pb2.STOP_REASON_STOP)])

    async def close(self):
        pass


@pytest.fixture(scope="session")
def stack(tiny_model_dir, postgres_url, tmp_path_factory):
    """Scheduler + trainer + sampler as separate processes on loopback, scheduler on Postgres."""
    from temper.localstack import LocalStack

    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("stack"), database_url=postgres_url, num_threads=1) as local:
        local.address = local.start()
        yield local


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Adds ``authorization: Bearer <key>`` to every call of a raw channel."""

    def __init__(self, key: str):
        self.metadata = ("authorization", f"Bearer {key}")

    def _with_key(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self.metadata])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_key(details), request_iterator)


def keyed_channel(stack, tenant: str = "local") -> grpc.Channel:
    """A channel to the stack's scheduler whose calls carry ``tenant``'s API key."""
    return grpc.intercept_channel(grpc.insecure_channel(stack.address), _Bearer(stack.key_for(tenant)))


def raw_stub(stack, tenant: str = "local") -> service_pb2_grpc.TemperStub:
    """A raw stub on the stack's scheduler, calling as ``tenant``."""
    return service_pb2_grpc.TemperStub(keyed_channel(stack, tenant))


@pytest.fixture
def service_client(stack):
    client = stack.client()
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
            # a row still queued at or below its run's dispatched watermark is running (scheduler/db/request_log.py)
            text("select seq_id, kind, case when r.status = 'queued' and r.seq_id <= t.dispatched_seq then 'running' "
                 "else r.status end from requests r join training_runs t on t.id = r.training_run_id "
                 "where r.training_run_id = :r order by seq_id"), {"r": run_id}
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


def store_with_run(url: str):
    """A migrated Store on ``url`` holding one session and one bare training run: (store, run id)."""
    from temper.scheduler.db import models as m
    from temper.scheduler.db.store import Store, upgrade_schema

    upgrade_schema(url)
    store = Store(url)
    session = store.create_session("t", [], {})
    run_id = store.next_run_id(session.id)
    store.add_training_run(m.TrainingRun(id=run_id, session_id=session.id, base_model="tiny", lora_rank=4, lora_alpha=8.0,
                                         lora_dropout=0.0, train_attn=True, train_mlp=True, train_unembed=True, user_metadata={},
                                         next_seq_id=1))
    return store, run_id


@contextlib.contextmanager
def tinker_sdk_env(stack, api_key: str | None = None) -> Iterator[None]:
    """The unmodified tinker SDK pointed at ``stack``'s gateway (TINKER_BASE_URL, TINKER_API_KEY, telemetry
    off) for a module-scoped fixture, where the function-scoped ``monkeypatch`` cannot be used."""
    patch = pytest.MonkeyPatch()
    try:
        for name, value in (("TINKER_BASE_URL", stack.gateway_url), ("TINKER_API_KEY", api_key or stack.api_key),
                            ("TINKER_TELEMETRY", "0")):
            patch.setenv(name, value)
        yield
    finally:
        patch.undo()


def sdk_rest_client(stack, api_key: str | None = None):
    """The unmodified tinker SDK's RestClient on ``stack``'s gateway (the stack's key unless given)."""
    import tinker

    return tinker.RestClient(base_url=stack.gateway_url, api_key=api_key or stack.api_key)


def plain_get(url: str, api_key: str | None = None):
    """(status, headers, body) of a plain GET, an HTTP error's too."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"X-API-Key": api_key} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()
