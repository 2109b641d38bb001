"""A raw gRPC client (temper.v1 stubs only) that leaves optional fields unset gets Tinker's defaults
(common/defaults.py), not proto3's zeros: an AdamParams with only learning_rate set trains exactly as
one that spells out beta1 0.9, beta2 0.95, eps 1e-12, weight_decay 0, grad_clip_norm 0; SamplingParams
without temperature, top_k, top_p samples as temperature 1 over the full vocabulary; a LoraConfig without
rank or train_* is rank 32 training attention, MLP and unembedding."""

from __future__ import annotations

from fixtures_stack import raw_stub, sft_datum
from temper.client import ModelInput, convert
from temper.common.codec import decode_tokens
from temper.v1 import service_pb2, types_pb2

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]


def _losses_after_steps(stub, session_id: str, model: str, adam: types_pb2.AdamParams) -> list[float]:
    run = stub.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(
        session_id=session_id, base_model=model, lora_config=types_pb2.LoraConfig(rank=4, seed=5, train_attn=True)), timeout=60)
    datum = convert.datum_to_proto(sft_datum(PATTERN))
    losses = []
    for step in range(3):
        out = stub.ForwardBackward(service_pb2.ForwardBackwardRequest(
            training_run_id=run.training_run_id, seq_id=2 * step + 1, data=[datum], loss_fn="cross_entropy"), timeout=60)
        losses.append(out.metrics["loss:sum"])
        stub.OptimStep(service_pb2.OptimStepRequest(training_run_id=run.training_run_id, seq_id=2 * step + 2,
                                                    adam_params=adam), timeout=60)
    return losses


def test_adam_params_left_unset_are_tinkers_defaults(stack, tiny_model_dir):
    stub = raw_stub(stack, "raw-defaults")
    session = stub.CreateSession(service_pb2.CreateSessionRequest(), timeout=60)
    only_lr = _losses_after_steps(stub, session.session_id, tiny_model_dir, types_pb2.AdamParams(learning_rate=2e-2))
    spelled = _losses_after_steps(stub, session.session_id, tiny_model_dir, types_pb2.AdamParams(
        learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0))
    assert only_lr == spelled and only_lr[2] < only_lr[0]  # the same steps, and they train
    # and a field set to 0 is 0, not the default: beta2 0 is another optimizer
    other = _losses_after_steps(stub, session.session_id, tiny_model_dir, types_pb2.AdamParams(learning_rate=2e-2, beta2=0.0))
    assert other[2] != only_lr[2]  # (Adam's first step does not depend on the betas)


def test_sampling_params_left_unset_are_tinkers_defaults(stack, tiny_model_dir):
    """temperature unset is 1 (not greedy), top_k -1 and top_p 1 (the full vocabulary)."""
    stub = raw_stub(stack, "raw-defaults")
    session = stub.CreateSession(service_pb2.CreateSessionRequest(), timeout=60)
    sampler = stub.CreateSamplingClient(service_pb2.CreateSamplingClientRequest(session_id=session.session_id,
                                                                                base_model=tiny_model_dir), timeout=60)
    prompt = convert.model_input_to_proto(ModelInput.from_ints(PATTERN[:5]))

    def tokens(**params) -> list[list[int]]:
        response = stub.Sample(service_pb2.SampleRequest(sampler_id=sampler.sampler_id, prompt=prompt, num_samples=4,
                                                         sampling_params=types_pb2.SamplingParams(
                                                             max_tokens=8, seed=11, stop_disabled=True, **params)), timeout=60)
        return [list(decode_tokens(s.tokens)) for s in response.sequences]

    unset = tokens()
    assert unset == tokens(temperature=1.0, top_k=-1, top_p=1.0)
    assert unset != tokens(temperature=0.0)  # an explicit 0 is greedy, as before


def test_lora_config_left_unset_is_tinkers_default(stack, tiny_model_dir):
    stub = raw_stub(stack, "raw-defaults")
    session = stub.CreateSession(service_pb2.CreateSessionRequest(), timeout=60)

    def created(lora: types_pb2.LoraConfig) -> types_pb2.LoraConfig:
        run = stub.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(
            session_id=session.session_id, base_model=tiny_model_dir, lora_config=lora), timeout=60)
        info = stub.GetInfo(service_pb2.GetInfoRequest(training_run_id=run.training_run_id), timeout=60)
        return info.lora_config

    unset = created(types_pb2.LoraConfig())
    assert (unset.rank, unset.train_attn, unset.train_mlp, unset.train_unembed) == (32, True, True, True)
    explicit = created(types_pb2.LoraConfig(rank=4, train_attn=True, train_mlp=False, train_unembed=False))
    assert (explicit.rank, explicit.train_attn, explicit.train_mlp, explicit.train_unembed) == (4, True, False, False)
