"""A mixture-of-experts base model on the real three-process stack (its own Postgres database): the
routed experts' LoRA rank in effect is what CreateTrainingRun, GetInfo and ListTrainingRuns answer
(the default rank // num_experts_per_tok, or the one asked for), a bad expert_rank is refused before
any run row exists, a run made from a checkpoint keeps the experts' rank of the run that saved it, a
checkpoint of another experts' rank does not load, and the server's capabilities name the model's
family and routed experts. The tiny qwen3_moe model: 8 routed experts, top-2."""

from __future__ import annotations

import grpc
import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import raw_stub
from temper.v1 import service_pb2, types_pb2

TENANT = "moe-info"


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> str:
    from temper.services.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", family="qwen3_moe"))


@pytest.fixture(scope="module")
def moe_stack(moe_model_dir, new_postgres_database, tmp_path_factory):
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_moe_info")
    with LocalStack(moe_model_dir, tmp_path_factory.mktemp("moe"), database_url=url, num_threads=1) as local:
        local.address = local.start()
        yield local


def lora(rank: int, expert_rank: int = 0, train_mlp: bool = True, train_attn: bool = False) -> types_pb2.LoraConfig:
    return types_pb2.LoraConfig(rank=rank, expert_rank=expert_rank, seed=3, train_attn=train_attn, train_mlp=train_mlp)


def refused(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=120)
    return caught.value.code(), caught.value.details()


def stored_expert_ranks(url: str) -> dict[str, int]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return dict(conn.execute(text("select id, lora_expert_rank from training_runs")).all())
    finally:
        engine.dispose()


def test_moe_run_info_expert_rank_and_capabilities(moe_stack, moe_model_dir):
    stub = raw_stub(moe_stack, TENANT)
    sid = stub.CreateSession(service_pb2.CreateSessionRequest()).session_id

    def create(cfg: types_pb2.LoraConfig, **fields) -> service_pb2.TrainingRunInfo:
        return stub.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(session_id=sid, base_model=moe_model_dir,
                                                                           lora_config=cfg, **fields), timeout=120)

    def listed() -> dict[str, int]:
        runs = stub.ListTrainingRuns(service_pb2.ListTrainingRunsRequest(limit=100), timeout=60)
        assert runs.total_count == len(runs.training_runs)
        return {r.training_run_id: r.lora_config.expert_rank for r in runs.training_runs}

    # capabilities: the family and routed experts, as the trainer reports them (raw and through the client)
    caps = stub.GetServerCapabilities(service_pb2.GetServerCapabilitiesRequest(), timeout=60)
    [model] = [m for m in caps.supported_models if m.model_name == moe_model_dir]
    assert (model.family, model.num_experts, model.num_experts_per_tok, model.trainable) == ("qwen3_moe", 8, 2, True)
    client = moe_stack.client(TENANT)
    try:
        [supported] = [m for m in client.get_server_capabilities().supported_models if m.model_name == moe_model_dir]
        assert (supported.family, supported.num_experts, supported.num_experts_per_tok) == ("qwen3_moe", 8, 2)

        # the default: rank 8 spread over the 2 experts a token is routed to
        default = create(lora(8))
        assert default.lora_config.expert_rank == 4 and default.lora_config.rank == 8
        assert stub.GetInfo(service_pb2.GetInfoRequest(training_run_id=default.training_run_id), timeout=60).lora_config.expert_rank == 4
        # asked for: 2; through the client as well (its run info shows the rank in effect)
        asked = create(lora(8, expert_rank=2))
        assert asked.lora_config.expert_rank == 2
        assert stub.GetInfo(service_pb2.GetInfoRequest(training_run_id=asked.training_run_id), timeout=60).lora_config.expert_rank == 2
        training = client.create_lora_training_client(moe_model_dir, rank=8, expert_rank=2, train_attn=False, train_unembed=False)
        info = training.get_info()
        assert info.lora_config.expert_rank == 2 and info.expert_rank == 2 and info.lora_rank == 8
        # no routed expert adapted without train_mlp
        attention_only = create(lora(8, train_mlp=False, train_attn=True))
        assert attention_only.lora_config.expert_rank == 0

        runs = {default.training_run_id: 4, asked.training_run_id: 2, training.model_id: 2, attention_only.training_run_id: 0}
        assert listed() == runs
        assert {k: v for k, v in stored_expert_ranks(moe_stack.database_url).items() if k in runs} == runs

        # refused by the scheduler (expert_rank > rank), naming the field; by the trainer (rank 1 // top-2 == 0): no row either way
        code, details = refused(stub.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(
            session_id=sid, base_model=moe_model_dir, lora_config=lora(8, expert_rank=9)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "expert_rank" in details, details
        code, details = refused(stub.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(
            session_id=sid, base_model=moe_model_dir, lora_config=lora(1)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert listed() == runs
        assert set(stored_expert_ranks(moe_stack.database_url)) == set(runs)

        # a run from a checkpoint has the experts' rank of the run that saved it (not the default 4)
        saved = stub.SaveWeights(service_pb2.SaveWeightsRequest(training_run_id=asked.training_run_id, seq_id=1, name="e2",
                                                                kind=types_pb2.CHECKPOINT_KIND_TRAINING), timeout=120).checkpoint
        assert saved.lora_config.expert_rank == 2
        copy = create(types_pb2.LoraConfig(), from_path=saved.path)
        assert copy.lora_config.expert_rank == 2 and copy.lora_config.rank == 8
        # ... and a run of another experts' rank (same rank and groups) does not load it
        code, details = refused(stub.LoadWeights, service_pb2.LoadWeightsRequest(
            training_run_id=default.training_run_id, seq_id=1, path=saved.path))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "routed experts rank 2" in details, details
    finally:
        client.close()


def test_deterministic_mode_on_an_moe_model_is_refused_naming_the_family_and_nothing_is_made(moe_stack, moe_model_dir):
    """Issue 23's bad input: deterministic mode asked of a family without batch-invariant kernels is
    refused FAILED_PRECONDITION at run and at sampling-client creation, naming what is missing; no
    run row, run number or sampling client is made (the next run of the session is still :train:0)."""
    stub = raw_stub(moe_stack, "moe-deterministic")
    sid = stub.CreateSession(service_pb2.CreateSessionRequest()).session_id
    before = set(stored_expert_ranks(moe_stack.database_url))
    code, details = refused(stub.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(
        session_id=sid, base_model=moe_model_dir, lora_config=lora(8), deterministic=True))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "deterministic" in details and "qwen3_moe" in details, details
    code, details = refused(stub.CreateSamplingClient, service_pb2.CreateSamplingClientRequest(
        session_id=sid, base_model=moe_model_dir, deterministic=True))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "qwen3_moe" in details, details
    assert set(stored_expert_ranks(moe_stack.database_url)) == before
    made = stub.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(session_id=sid, base_model=moe_model_dir,
                                                                       lora_config=lora(8)), timeout=120)
    assert made.training_run_id == f"{sid}:train:0" and made.deterministic is False
    assert stub.CreateSamplingClient(service_pb2.CreateSamplingClientRequest(session_id=sid, base_model=moe_model_dir),
                                     timeout=120).sampler_id == f"{sid}:sample:0"
