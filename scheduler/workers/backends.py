"""Connections to trainer and sampler services, which one serves a base model, and the calls to
them, each with its deadline from settings (samplers: choice, failover and adapters in samplers.py).
Every trainer call can be given up while it waits (``TrainerHandle.abandon``: abandon.py)."""

from __future__ import annotations

import asyncio
import logging
import zlib
from typing import Callable
from dataclasses import dataclass, field

import grpc

from temper.common.errors import TemperError, Unavailable
from temper.common.internal_auth import resolve_token, with_token
from temper.common.lane_fence import lane_token_metadata
from temper.common.server_options import CHANNEL_OPTIONS
from temper.common.tls import channel_credentials
from temper.common.uploads import file_chunks
from temper.scheduler import metrics
from temper.scheduler.workers.abandon import Calls
from temper.scheduler.workers.downstream import UNKNOWN_OUTCOME_CODES, downstream
from temper.scheduler.workers.events import CycleRate
from temper.scheduler.workers.presence import ModelPresence
from temper.scheduler.workers.samplers import SamplerHandle, SamplerRouting
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)
__all__ = ["Backends", "SamplerHandle", "TrainerHandle", "UNKNOWN_OUTCOME_CODES", "downstream"]


@dataclass
class TrainerHandle:
    address: str
    stub: trainer_pb2_grpc.TrainerStub
    info: trainer_pb2.ModelInfo
    settings: SchedulerSettings
    calls: Calls = field(init=False, repr=False, compare=False)  # waiting now: given up by abandon()
    # the fencing token this replica sends as the lane's owner (common/lane_fence.py); None: not fenced
    lane_token: Callable[[], int | None] = field(default=lambda: None, repr=False, compare=False)
    cycles: CycleRate = field(init=False, repr=False, compare=False)  # answered cycles (GetClusterStatus)

    def __post_init__(self):
        self.calls = Calls(f"trainer {self.address}")
        self.cycles = CycleRate()

    def abandon(self) -> int:
        """Give up every call waiting on this trainer now (its runs moved: Recovery.fail_over); each
        raises Abandoned in its caller. How many."""
        return self.calls.abandon()

    async def run_cycle(self, request: trainer_pb2.CycleRequest) -> trainer_pb2.CycleResponse:
        async with downstream(f"trainer {self.address}"):
            response = await self.calls.run(self.stub.RunCycle(request, timeout=self.settings.cycle_timeout_seconds,
                                                               **self._fencing()))
        self.cycles.ran()
        return response

    async def ping(self, timeout: float = 2.0) -> bool:
        """Whether the trainer answers GetModelInfo within ``timeout`` (a hung one does not). Not
        abandonable: it is how a frozen trainer is told from a live one."""
        try:
            async with downstream(f"trainer {self.address}"):
                await self.stub.GetModelInfo(trainer_pb2.GetModelInfoRequest(), timeout=timeout)
            return True
        except TemperError:
            return False

    def _fencing(self) -> dict:
        """The call's lane token (replicas: common/lane_fence.py); one scheduler sends nothing extra."""
        token = self.lane_token()
        return {} if token is None else {"metadata": lane_token_metadata(token)}

    async def claim(self) -> None:
        """Tell the trainer this replica's fencing token now (it has just taken the lane): from here a
        former owner's calls are refused there. Best effort: the next call carries the token anyway."""
        try:
            async with downstream(f"trainer {self.address}"):
                await self.stub.GetModelInfo(trainer_pb2.GetModelInfoRequest(), timeout=self.settings.trainer_call_timeout_seconds,
                                             **self._fencing())
        except TemperError as exc:
            log.warning("could not claim trainer %s for this replica's lane: %s", self.address, exc.message)

    async def memory_used(self, timeout: float = 1.0) -> int:
        """The device memory in use there now (GetModelInfo's device_memory_used_bytes); 0 if it does
        not answer within ``timeout`` or does not say. For the operator's status only."""
        try:
            async with downstream(f"trainer {self.address}"):
                info = await self.stub.GetModelInfo(trainer_pb2.GetModelInfoRequest(), timeout=timeout)
            return info.device_memory_used_bytes
        except TemperError:
            return 0

    async def call(self, method: str, request):
        """A unary trainer call other than RunCycle (CreateAdapter, SaveAdapter, LoadAdapter, ...)."""
        async with downstream(f"trainer {self.address}"):
            return await self.calls.run(getattr(self.stub, method)(request, timeout=self.settings.trainer_call_timeout_seconds,
                                                                   **self._fencing()))

    async def delete_checkpoint(self, key: str) -> int:
        """Remove a checkpoint's files; the bytes freed (0 if there were none: deleting twice is fine)."""
        response = await self.call("DeleteCheckpoint", trainer_pb2.DeleteCheckpointFilesRequest(checkpoint_key=key))
        return response.freed_bytes

    async def snapshot(self, run_id: str, key: str) -> trainer_pb2.SnapshotAdapterResponse:
        """Write the run's whole adapter state under ``key`` (size_bytes, applied_seq_id, steps)."""
        return await self.call("SnapshotAdapter", trainer_pb2.SnapshotAdapterRequest(training_run_id=run_id, checkpoint_key=key))

    async def restore(self, run_id: str, key: str) -> trainer_pb2.RestoreAdapterResponse:
        """Create (or replace) the run's adapter on this trainer from a snapshot (applied_seq_id, steps)."""
        return await self.call("RestoreAdapter", trainer_pb2.RestoreAdapterRequest(training_run_id=run_id, checkpoint_key=key))

    async def import_adapter(self, key: str, files: dict[str, bytes]) -> trainer_pb2.ImportAdapterResponse:
        """Have the trainer check an outside adapter's files and write them under ``key`` (size_bytes,
        lora_config); INVALID_ARGUMENT: refused, nothing written."""
        async def messages():
            yield trainer_pb2.ImportAdapterChunk(checkpoint_key=key)
            for chunk in file_chunks(files):
                yield trainer_pb2.ImportAdapterChunk(file=chunk)

        async with downstream(f"trainer {self.address}"):
            return await self.calls.run(self.stub.ImportAdapter(messages(), timeout=self.settings.trainer_call_timeout_seconds))

    async def read_checkpoint(self, key: str, weights_only: bool = False, relative_path: str = ""):
        """``relative_path``: only that file of the checkpoint."""
        request = trainer_pb2.ReadCheckpointRequest(checkpoint_key=key, weights_only=weights_only, relative_path=relative_path)
        async with downstream(f"trainer {self.address}"):
            chunks = aiter(self.stub.ReadCheckpoint(request, timeout=self.settings.trainer_call_timeout_seconds))
            while True:
                try:
                    chunk = await self.calls.run(anext(chunks))  # each chunk's wait can be given up
                except StopAsyncIteration:
                    return
                yield chunk


class Backends(SamplerRouting, ModelPresence):
    """The workers; choosing samplers and calling them: samplers.py::SamplerRouting; a model with no
    worker here now, absent for now or unknown: presence.py::ModelPresence."""

    def __init__(self, settings: SchedulerSettings):
        self.settings = settings
        self.trainers: list[TrainerHandle] = []
        # a trainer lane's fencing token for its calls (replicas: LaneOwnership.token_for); None: not fenced
        self.lane_token_of: Callable[[str], int | None] = lambda address: None
        self._trainer_at: dict[str, TrainerHandle] = {}  # address -> the first trainer of self.trainers there
        self._indexed: tuple[int, int] = (0, -1)           # the list and length _trainer_at was built from
        self.samplers: list[SamplerHandle] = []
        self.placements: dict[str, str] = {}  # run id -> trainer address (training_runs.trainer)
        self.down: set[str] = set()            # trainers whose runs were moved away (recovery.py); no new runs go there
        self._channels: list[grpc.aio.Channel] = []
        self._ready = asyncio.Event()
        self._joined = asyncio.Event()  # a trainer joined: the loop starts a lane for it
        self._init_presence()
        # Every call to a worker carries the internal token (common/internal_auth.py), streams included.
        token = resolve_token(settings, "TEMPER_SCHEDULER_")
        if token is None:
            log.warning("no TEMPER_SCHEDULER_INTERNAL_TOKEN: trainers and samplers answer only with internal_auth=disabled")
        self._token = token
        self._credentials = None
        if settings.internal_tls_ca_file is not None:
            self._credentials = channel_credentials(settings.internal_tls_ca_file, settings.internal_tls_cert_file,
                                                    settings.internal_tls_key_file)

    def channel(self, address: str) -> grpc.aio.Channel:
        # A worker that restarts is found again within seconds (gRPC's default backoff grows to 2 min).
        options = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 5000)]
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=options)
        else:
            if self.settings.internal_tls_server_name:
                options.append(("grpc.ssl_target_name_override", self.settings.internal_tls_server_name))
            channel = grpc.aio.secure_channel(address, self._credentials, options=options)
        channel = with_token(channel, self._token)
        self._channels.append(channel)
        return channel

    async def connect(self) -> None:
        """Wait (as long as it takes) for every statically configured worker to answer GetModelInfo.
        Registered workers (membership.py) join through add_trainer / add_sampler meanwhile."""
        for address in self.settings.trainer_addresses:
            stub = self.trainer_stub(address)
            info = await self._model_info(f"trainer {address}", stub.GetModelInfo, trainer_pb2.GetModelInfoRequest())
            self.add_trainer(TrainerHandle(address, stub, info, self.settings))
        for address in self.settings.sampler_addresses:
            stub = self.sampler_stub(address)
            info = await self._model_info(f"sampler {address}", stub.GetModelInfo, sampler_pb2.SamplerModelInfoRequest())
            self.add_sampler(SamplerHandle(address, stub, info, self.settings))
        # With a registry, a scheduler without static trainers is ready at the first registration.
        if self.trainers or not self.settings.registry_bind:
            self._ready.set()

    def trainer_stub(self, address: str) -> trainer_pb2_grpc.TrainerStub:
        return trainer_pb2_grpc.TrainerStub(self.channel(address))

    def sampler_stub(self, address: str) -> sampler_pb2_grpc.SamplerStub:
        return sampler_pb2_grpc.SamplerStub(self.channel(address))

    def add_trainer(self, handle: TrainerHandle) -> None:
        """A trainer joins for good (its handle is kept across its restarts: a lane is tied to it)."""
        handle.lane_token = lambda: self.lane_token_of(handle.address)
        self.trainers.append(handle)
        metrics.WORKERS.labels("trainer").set(len(self.trainers))
        log.info("trainer %s serves %s", handle.address, handle.info.base_model)
        self._joined.set()
        self.worker_joined()
        if self.settings.registry_bind:
            self._ready.set()

    def add_sampler(self, handle: SamplerHandle) -> None:
        handle.loaded.update((key, "") for key in handle.info.loaded_adapters)  # held since before a restart of ours
        self.samplers.append(handle)
        metrics.WORKERS.labels("sampler").set(len(self.samplers))
        log.info("sampler %s (%s) serves %s", handle.address, handle.info.backend, handle.info.base_model)
        self.worker_joined()

    def trainer_at(self, address: str) -> TrainerHandle | None:
        return next((t for t in self.trainers if t.address == address), None)

    def sampler_at(self, address: str) -> SamplerHandle | None:
        return next((s for s in self.samplers if s.address == address), None)

    async def wait_for_new_trainer(self) -> None:
        """Return when a trainer joined since the last call (the loop then starts its lane)."""
        await self._joined.wait()
        self._joined.clear()

    @staticmethod
    async def _model_info(what: str, method, request):
        while True:
            try:
                return await method(request, wait_for_ready=True, timeout=10.0)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                    # a worker restarted with the right token is found on a later try
                    log.error("%s refused the scheduler (%s): TEMPER_SCHEDULER_INTERNAL_TOKEN must be the worker's "
                              "INTERNAL_TOKEN; retrying", what, err.details())
                    await asyncio.sleep(5.0)
                    continue
                if err.code() not in UNKNOWN_OUTCOME_CODES:
                    raise
                log.warning("waiting for %s (%s)", what, err.code().name)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def wait_ready(self) -> None:
        """Return once every static worker has answered (with a registry: once a trainer is known);
        past backend_wait_seconds, Unavailable (retry)."""
        if self._ready.is_set():
            return
        try:
            await asyncio.wait_for(self._ready.wait(), self.settings.backend_wait_seconds)
        except asyncio.TimeoutError:
            raise Unavailable("the scheduler is still connecting to its trainers and samplers; retry") from None

    async def close_channel(self, channel: grpc.aio.Channel | None) -> None:
        """Close a channel to a worker that was never added (it did not answer its registration)."""
        if channel is not None and channel in self._channels:
            self._channels.remove(channel)
            await channel.close()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    def model_names(self) -> list[str]:
        return sorted({t.info.base_model for t in self.trainers} | {s.info.base_model for s in self.samplers})

    def trainer_for(self, base_model: str, run_id: str) -> TrainerHandle:
        """The trainer holding ``run_id``'s adapter: where it was placed (``place``), or for runs made
        before placements were recorded, a hash of the run among the model's trainers."""
        address = self.placements.get(run_id)
        if address is not None:
            if self._indexed != (id(self.trainers), len(self.trainers)):  # trainers are only ever added (membership.py)
                self._trainer_at, self._indexed = {}, (id(self.trainers), len(self.trainers))
                for t in self.trainers:
                    self._trainer_at.setdefault(t.address, t)
            placed = self._trainer_at.get(address)
            if placed is None:
                raise Unavailable(f"training run {run_id} lives on trainer {address}, which this scheduler does not reach; retry")
            return placed
        candidates = self._trainers_of(base_model)
        return candidates[zlib.crc32(run_id.encode()) % len(candidates)]

    def mark_down(self, address: str) -> None:
        """No new runs go to trainer ``address`` until mark_up (it stopped answering: recovery.py, membership.py)."""
        self.down.add(address)
        metrics.TRAINERS_DOWN.set(len(self.down))

    def mark_up(self, address: str) -> None:
        self.down.discard(address)
        metrics.TRAINERS_DOWN.set(len(self.down))

    def place(self, base_model: str, among: list[TrainerHandle] | None = None, counts: dict[str, int] | None = None) -> TrainerHandle:
        """The trainer a new (or moved) run of ``base_model`` goes to: of ``among`` (default: the
        model's trainers not marked down, else all of them), the one holding the fewest runs (by
        ``counts``, runs per trainer address, when given: replicas count them in the database)."""
        candidates = among or [t for t in self._trainers_of(base_model) if t.address not in self.down] or self._trainers_of(base_model)
        held = {t.address: 0 for t in candidates}
        for address, count in (counts.items() if counts is not None else ((a, 1) for a in self.placements.values())):
            if address in held:
                held[address] += count
        return next(t for t in self.trainers if t.address == min(held, key=lambda a: (held[a], a)))

    def moved_off(self, run_id: str, trainer: TrainerHandle) -> bool:
        """Whether the run is now placed on another trainer than ``trainer`` (fail-over moved it)."""
        return self.placements.get(run_id, trainer.address) != trainer.address

    def remember_placement(self, run_id: str, address: str | None) -> None:
        if address:
            self.placements[run_id] = address

    def _trainers_of(self, base_model: str) -> list[TrainerHandle]:
        candidates = [t for t in self.trainers if t.info.base_model == base_model]
        if not candidates:
            raise self.absent("trainer", base_model)  # NotFound only for a model unknown here
        return candidates
