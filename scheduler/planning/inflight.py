"""Each training run's in-flight target (docs/async_rl.md) as this scheduler knows it, and its spread
to the samplers.

Postgres holds the target (``training_runs.inflight_version`` / ``inflight_path``, written with the
save's checkpoint row: db/inflight.py). One scheduler is the only writer, so the copy here is exact
once this process has saved or read it; a run it has not seen since it started is read from the
database on first use. With replicas the owner of the run's lane saves, so the others read the target
again when theirs is older than ``reread_after``. The target never goes backwards here either: ``advance`` keeps the newer of two.

After an in-flight save is answered, ``spread`` pushes the new version, in the background, to every
sampler of the model that holds an earlier version of the run (or the one a request for it would go
to), then tells them ``SetInflightTarget``. A failure is only logged: every request names the
newest version, and a sampler without it gets it pushed then (samplers.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import grpc

from temper.common.checkpoints import parse_path
from temper.common.errors import TemperError
from temper.v1 import sampler_pb2, types_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    run_id: str
    version: int  # 1, 2, ...
    path: str     # tinker://<run>/sampler_weights/<name>

    @property
    def key(self) -> str:
        return parse_path(self.path).key

    def weights(self) -> types_pb2.WeightsVersion:
        return types_pb2.WeightsVersion(path=self.path, version=self.version)


class InflightTargets:
    def __init__(self, store, reread_after: float | None = None):
        """``reread_after``: seconds after which a held target is read from the database again (replicas:
        the run's saves go through the replica that owns its lane, not necessarily this one); None: never."""
        self.store = store
        self.reread_after = reread_after
        self._read_at: dict[str, float] = {}
        self._targets: dict[str, Target] = {}
        # run -> checkpoint key -> version, for the versions this process saved or read: which samplers hold an older one
        self._versions: dict[str, dict[str, int]] = defaultdict(dict)
        self._spreading: set[asyncio.Task] = set()  # held: a task nobody references may be collected mid-way
        self._unsupported: set[str] = set()  # samplers that answered SetInflightTarget UNIMPLEMENTED (logged once)

    def advance(self, target: Target) -> Target:
        """The run's target is ``target`` unless a newer one is known already; the target after."""
        self._versions[target.run_id][target.key] = target.version
        held = self._targets.get(target.run_id)
        if held is None or target.version > held.version:
            self._targets[target.run_id] = held = target
        return held

    async def current(self, run_id: str) -> Target | None:
        """The run's target; None before its first in-flight save."""
        held = self._targets.get(run_id)
        if held is not None and (self.reread_after is None or time.monotonic() - self._read_at.get(run_id, 0.0) < self.reread_after):
            return held
        stored = await asyncio.to_thread(self.store.inflight_target, run_id)
        self._read_at[run_id] = time.monotonic()
        if stored.version <= 0:
            return held
        return self.advance(Target(run_id, stored.version, stored.path))

    def known(self, run_id: str) -> Target | None:
        return self._targets.get(run_id)

    def spread(self, backends, trainer, base_model: str, target: Target, tenant: str, max_resident: int) -> None:
        """Push ``target`` to the samplers that serve the run and point them at it, in the background."""
        task = asyncio.create_task(self._spread(backends, trainer, base_model, target, tenant, max_resident),
                                   name=f"in-flight {target.run_id} v{target.version}")
        self._spreading.add(task)
        task.add_done_callback(self._spreading.discard)

    async def settled(self) -> None:
        """Every spread under way has ended (tests, shutdown)."""
        while self._spreading:
            await asyncio.gather(*list(self._spreading), return_exceptions=True)

    async def _spread(self, backends, trainer, base_model: str, target: Target, tenant: str, max_resident: int) -> None:
        try:
            samplers = backends.samplers_of(base_model)
            older = {k for k, v in self._versions[target.run_id].items() if v < target.version}
            holders = [s for s in samplers if older & set(s.loaded)] or [backends.sampler_for(base_model, target.key)]
        except TemperError as exc:
            log.warning("in-flight %s v%d: no sampler to push it to now (%s)", target.run_id, target.version, exc.message)
            return
        await asyncio.gather(*(self._to_sampler(backends, trainer, s, target, tenant, max_resident) for s in holders))

    async def _to_sampler(self, backends, trainer, sampler, target: Target, tenant: str, max_resident: int) -> None:
        if self._targets[target.run_id].version > target.version:
            return  # a newer save is spreading itself
        try:
            await backends.push_checkpoint(trainer, sampler, target.key, tenant=tenant, max_resident=max_resident)
            await sampler.call("SetInflightTarget", sampler_pb2.SetInflightTargetRequest(
                training_run_id=target.run_id, checkpoint_key=target.key, weights=target.weights()))
        except TemperError as exc:
            if exc.code == grpc.StatusCode.UNIMPLEMENTED:  # an older sampler: requests still name the newest version
                if sampler.address not in self._unsupported:
                    self._unsupported.add(sampler.address)
                    log.info("sampler %s does not support SetInflightTarget: in-flight updates reach its new requests only",
                             sampler.address)
                return
            log.warning("in-flight %s v%d on sampler %s: %s (its next request pushes it)", target.run_id, target.version,
                        sampler.address, exc.message)
        except Exception:  # noqa: BLE001 - a background task: logged, never lost silently
            log.exception("in-flight %s v%d on sampler %s failed", target.run_id, target.version, sampler.address)
