"""The in-flight side of the public API (docs/async_rl.md): what an in-flight save must be, in-flight
sampling clients (made on a run's target, each request sent to the target current then), and the
version spans of what was sampled.

A sampler that reports no spans (one older than the contract) gets one span per sequence, from what
was sent: the request ran on that one version, since only SetInflightTarget moves a running request.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

from temper.common.errors import FailedPrecondition, InvalidArgument
from temper.scheduler.api.lookup_verbs import check_deterministic
from temper.scheduler.db import models as m
from temper.scheduler.planning.inflight import Target
from temper.v1 import service_pb2, types_pb2


def check_inflight_save(request: service_pb2.SaveWeightsRequest) -> None:
    """An in-flight save is an ephemeral sampler save, collected when idle (never by a TTL), and never
    replaces a checkpoint: the run's versions must stay what their spans named."""
    if request.kind != types_pb2.CHECKPOINT_KIND_SAMPLER:
        raise InvalidArgument("an in-flight save (inflight) is a sampler save: kind must be CHECKPOINT_KIND_SAMPLER")
    if request.ttl_seconds:
        raise InvalidArgument("an in-flight save takes no ttl_seconds (its versions are collected when idle)")
    if request.overwrite:
        raise InvalidArgument("an in-flight save cannot overwrite: each is a new version")


def fill_spans(sequences: Iterable[types_pb2.SampledSequence], sent: types_pb2.WeightsVersion) -> None:
    """One span of ``sent`` over each sequence the sampler gave no spans."""
    for sequence in sequences:
        if not sequence.versions:
            sequence.versions.add(weights=sent, first_token=0, count=len(sequence.tokens) // 4)


class PieceSpans:
    """The same for a stream's pieces: a piece without spans gets one over its own tokens, counted from
    its sequence's start."""

    def __init__(self, sent: types_pb2.WeightsVersion):
        self.sent, self.seen = sent, {}

    def fill(self, piece: types_pb2.SampledPiece) -> None:
        count, start = len(piece.tokens) // 4, self.seen.get(piece.index, 0)
        self.seen[piece.index] = start + count
        if count and not piece.versions:
            piece.versions.add(weights=self.sent, first_token=start, count=count)


class InflightSampling:
    """Mixed into SamplingVerbs (store, backends, runs come from the servicer)."""

    async def _inflight_source(self, request, tenant: str):
        """(base model, sampler info, deterministic, target) of a CreateSamplingClient on a run's in-flight
        target: the caller's run (another tenant's is the same NotFound as none) with an in-flight save.
        The target's adapter is pushed now, as for a checkpoint. Nothing is written here."""
        run = await self.runs.get(request.inflight_training_run_id, tenant)
        target = await self.runs.inflight.current(run.run_id)
        if target is None:
            raise FailedPrecondition(f"training run {run.run_id} has no in-flight save yet (save_weights with inflight first)")
        deterministic = bool(run.row.deterministic) or request.deterministic
        await self.backends.served("sampler", run.base_model)
        info = self.backends.sampler_info(run.base_model)
        if deterministic:
            check_deterministic(info, run.base_model)
        await self.backends.on_a_sampler(run.base_model, target.key, None,
                                         load=lambda s: self._ensure_loaded(s, target.key, tenant))
        await asyncio.to_thread(self.store.touch_checkpoint, target.path)
        return run.base_model, info, deterministic, target

    async def _target_of(self, row: m.SamplingClient) -> Target:
        """An in-flight client's run's target now (never older than the client's min_version: the
        target only moves forward)."""
        target = await self.runs.inflight.current(row.inflight_run_id)
        if target is None or target.version < (row.min_version or 0):  # the database lost the run's saves
            raise FailedPrecondition(f"training run {row.inflight_run_id} has no in-flight target")
        return target

    async def _client_info(self, row: m.SamplingClient) -> service_pb2.SamplingClientInfo:
        """A sampling client as GetSamplingClient shows it: an in-flight one with its run, min_version
        and the target now as model_path."""
        info = service_pb2.SamplingClientInfo(sampler_id=row.id, base_model=row.base_model, model_path=row.model_path or "",
                                              deterministic=bool(row.deterministic))
        if row.inflight_run_id:
            info.inflight_training_run_id, info.min_version = row.inflight_run_id, row.min_version or 0
            target = await self.runs.inflight.current(row.inflight_run_id)
            info.model_path = target.path if target is not None else ""
        return info
