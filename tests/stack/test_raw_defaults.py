"""A raw gRPC client (temper.v1 stubs only) that leaves optional fields unset gets Tinker's defaults
(common/defaults.py), not proto3's zeros: an AdamParams with only learning_rate set trains exactly as
one that spells out beta1 0.9, beta2 0.95, eps 1e-12, weight_decay 0, grad_clip_norm 0."""

from __future__ import annotations

from fixtures_stack import raw_stub, sft_datum
from temper.client import convert
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
