"""What the scheduler knows about each training run, held once per process: owner, base model and
the seq it resumes from, loaded from the database on a run's first use in this process; and each
run's in-flight target (``inflight``: planning/inflight.py)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from temper.common.errors import NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db.catalog import RunNumber
from temper.scheduler.planning.inflight import InflightTargets
from temper.v1 import trainer_pb2, types_pb2

log = logging.getLogger(__name__)


def new_run_row(run_id: str, session_id: str, base_model: str, cfg: types_pb2.LoraConfig, user_metadata: dict[str, str],
                trainer: str, snapshot: str | None, expert_rank: int = 0, deterministic: bool = False) -> m.TrainingRun:
    """The row of a run being created on ``trainer`` (its adapter made, ``snapshot``: its first one if any).
    ``expert_rank``: the routed experts' LoRA rank in effect, as the trainer answered CreateAdapter
    (``created_expert_rank``), not ``cfg.expert_rank`` (0 there asks for the default)."""
    return m.TrainingRun(
        id=run_id, session_id=session_id, base_model=base_model, lora_rank=cfg.rank, lora_alpha=cfg.alpha or 32.0,
        lora_dropout=cfg.dropout, seed=cfg.seed if cfg.HasField("seed") else None, train_attn=cfg.train_attn,
        train_mlp=cfg.train_mlp, train_unembed=cfg.train_unembed, user_metadata=dict(user_metadata), next_seq_id=1,
        trainer=trainer, snapshot_key=snapshot, snapshot_seq=0 if snapshot else None, lora_expert_rank=expert_rank,
        deterministic=deterministic,
    )


async def undo_creation(trainer, run_id: str | None, keys: list[str]) -> bool:
    """Remove what a failed run creation or import may have made on ``trainer`` (a TrainerHandle): the
    adapter of ``run_id`` (None: it was never asked for; one never made answers NotFound) and the files
    under ``keys`` (deleting files never written is fine); whether all of it went. Never raises: the
    creation's own error is the answer."""
    steps = [("DropAdapter", trainer_pb2.DropAdapterRequest(training_run_id=run_id))] if run_id else []
    steps += [("DeleteCheckpoint", trainer_pb2.DeleteCheckpointFilesRequest(checkpoint_key=key)) for key in keys]
    undone = True
    for method, request in steps:
        try:
            await trainer.call(method, request)
        except NotFound:
            pass
        except Exception as exc:  # noqa: BLE001 - best effort; the rest is still removed
            undone = False
            log.warning("undoing the creation of %s: %s failed: %r", run_id, method, exc)
    return undone


async def give_back_run(store, session_id: str, number: RunNumber) -> None:
    """A refused creation's run number back to its session (a refused request changes no counter), once
    the trainer holds nothing of it: a number whose adapter or files may be left there stays skipped.
    Never raises: the creation's own error is the answer."""
    try:
        await asyncio.to_thread(store.give_back_run, session_id, number)
    except Exception as exc:  # noqa: BLE001 - the database is down: the number stays skipped, as before
        log.warning("giving back run number %s: %r", number.run_id, exc)


def created_expert_rank(response: trainer_pb2.CreateAdapterResponse | None) -> int:
    """The routed experts' LoRA rank in effect that a trainer's CreateAdapter answered (0: no expert LoRA;
    also for an answer without one)."""
    return response.expert_rank if response is not None else 0


@dataclass
class RunInfo:
    run_id: str
    session_id: str
    tenant: str
    base_model: str
    row: m.TrainingRun        # as loaded or created (lora config, metadata); counters there are not kept current
    closed: bool = False      # its session was closed: the run takes no more work
    recorded_upto: int = 0    # the highest seq with a request row when this process loaded it (0 for a run it created)
    skipped: tuple[int, ...] = ()  # seqs from the resume point on that their clients gave up on (AbandonSeq)


class RunRegistry:
    def __init__(self, store, on_load: Callable[[RunInfo], None] | None = None):
        self.store = store
        self.on_load = on_load  # told each run this process learns of (the app records its trainer placement)
        self._runs: dict[str, RunInfo] = {}
        self._loading: dict[str, asyncio.Future] = {}
        self.inflight = InflightTargets(store)  # saved by the loop, followed by the sampling verbs

    def add(self, row: m.TrainingRun, tenant: str, closed: bool = False, recorded_upto: int = 0,
            skipped: tuple[int, ...] = ()) -> RunInfo:
        info = self._runs[row.id] = RunInfo(row.id, row.session_id, tenant, row.base_model, row, closed, recorded_upto, skipped)
        if self.on_load is not None:
            self.on_load(info)
        return info

    def close_session(self, session_id: str) -> None:
        for info in self._runs.values():
            if info.session_id == session_id:
                info.closed = True

    async def get(self, run_id: str, tenant: str | None = None) -> RunInfo:
        """The run (with ``tenant``: only if it is that tenant's, else the same NotFound as a run that
        does not exist). Concurrent first uses share that one load."""
        info = self._runs.get(run_id)
        if info is None and tenant is not None:
            # The owner is checked before the first load: another tenant's call must not even recover the run.
            if await asyncio.to_thread(self.store.run_owner, run_id) != tenant:
                raise NotFound(f"training run {run_id!r} not found")
        elif info is not None:
            if tenant is not None and info.tenant != tenant:
                raise NotFound(f"training run {run_id!r} not found")
            return info
        loading = self._loading.get(run_id)
        if loading is None:
            loading = self._loading[run_id] = asyncio.ensure_future(asyncio.to_thread(self._load, run_id))
        try:
            row, owner, closed, recorded_upto, skipped = await asyncio.shield(loading)
        finally:
            if loading.done():
                self._loading.pop(run_id, None)
        info = self._runs.get(run_id) or self.add(row, owner, closed, recorded_upto, skipped)
        return info

    def _load(self, run_id: str):
        row, owner, closed, recorded_upto = self.store.load_run(run_id)
        # only rows at or above the resume point can be skips the queue must pass over
        skipped = self.store.skipped_seqs(run_id, row.next_seq_id) if recorded_upto >= row.next_seq_id else ()
        return row, owner, closed, recorded_upto, skipped

    def known(self, run_id: str) -> RunInfo | None:
        return self._runs.get(run_id)

    def forget(self, run_id: str) -> None:
        """Drop what this process knew of the run: its next use loads it from the database again (its
        lane changed hands between scheduler replicas: planning/handover.py)."""
        self._runs.pop(run_id, None)

    def tenant_by_run(self) -> dict[str, str]:
        return {run_id: info.tenant for run_id, info in self._runs.items()}
