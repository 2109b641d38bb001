"""A cycle on the wire: the RunCycle request built from planned work, and its per-item outcomes
(shared by the loop and recovery's replay)."""

from __future__ import annotations

from temper.common.errors import Internal, from_status_number
from temper.scheduler.planning.work import Work
from temper.v1 import service_pb2, trainer_pb2


def build_cycle(passes: list[Work], steps: list[Work]) -> trainer_pb2.CycleRequest:
    """One RunCycle: the passes, then the optim steps, each with its run's seq."""
    request = trainer_pb2.CycleRequest()
    for work in passes:
        r = work.request
        request.forward_backward.add(training_run_id=work.run_id, data=r.data, loss_fn=r.loss_fn, loss_fn_config=r.loss_fn_config,
                                     forward_only=r.forward_only, seq_id=work.seq_id, deterministic=work.deterministic)
    for work in steps:
        request.optim_step.add(training_run_id=work.run_id, adam_params=work.request.adam_params, seq_id=work.seq_id)
    return request


def cycle_outcomes(response: trainer_pb2.CycleResponse, passes: int, steps: int) -> list:
    """Each item's answer, or the domain error of its status (CycleResponse: one per item, in order)."""
    answers = [*response.forward_backward, *(service_pb2.OptimStepResponse(metrics=out.metrics) for out in response.optim_step)]
    statuses = [*response.forward_backward_status, *response.optim_step_status]
    if len(response.forward_backward) != passes or len(response.optim_step) != steps or len(statuses) not in (0, len(answers)):
        raise Internal(f"the trainer answered a cycle of {passes} passes and {steps} steps with {len(response.forward_backward)} "
                       f"and {len(response.optim_step)} answers and {len(statuses)} statuses")
    return [from_status_number(status.code, status.message) if status.code else answer
            for answer, status in zip(answers, statuses or [trainer_pb2.ItemStatus()] * len(answers))]
