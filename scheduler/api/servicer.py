"""The public Temper API: each verb checks its input and hands sequenced work to admission;
sampling (sampling_verbs.py) is forwarded to a sampler; checkpoints are in checkpoint_verbs.py,
importing an outside adapter in import_verbs.py.
Every verb acts for ``caller()``, the tenant of the call's API key, and sees only that tenant's
objects (another tenant's id answers NOT_FOUND). Errors are raised, never returned (one
interceptor maps them)."""

from __future__ import annotations

import asyncio
import functools
from collections import defaultdict

from temper.common.checkpoints import KIND_DIRS, check_name, parse_path
from temper.common.defaults import adam_with_defaults, lora_with_defaults
from temper.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, TemperError, Unavailable
from temper.common.logs import request_context
from temper.common.validation import validate_adam, validate_forward_backward
from temper.scheduler.planning.admission import Admission
from temper.scheduler.tenancy.auth import caller, caller_actor
from temper.scheduler.workers.backends import Backends
from temper.scheduler.api.audit_verbs import AuditVerbs
from temper.scheduler.api.billing_copy_verbs import BillingCopyVerbs
from temper.scheduler.api.checkpoint_verbs import CheckpointVerbs, check_ttl
from temper.scheduler.api.cluster_status import ClusterStatusVerbs
from temper.scheduler.api.download_verbs import DownloadVerbs
from temper.scheduler.api.image_inputs import has_images, serves_images, vision_of
from temper.scheduler.api.image_verbs import ImageVerbs
from temper.scheduler.api.inflight_verbs import check_inflight_save
from temper.scheduler.api.lane_routing import LaneRouting, on_lane_owner
from temper.scheduler.api.import_verbs import ImportVerbs
from temper.scheduler.api.record_verbs import RecordVerbs
from temper.scheduler.api.project_verbs import ProjectVerbs
from temper.scheduler.api.lookup_verbs import (CheckpointSource, LookupVerbs, check_deterministic, check_lora, check_lora_for_model,
                                               check_user_metadata)
from temper.scheduler.cluster.ownership import SoleOwner
from temper.scheduler.db import models as m
from temper.scheduler.tenancy.quotas import check_hard_limit
from temper.scheduler.planning.recovery import snapshot_key
from temper.scheduler.planning.runs import RunInfo, RunRegistry, created_expert_rank, give_back_run, new_run_row, undo_creation
from temper.scheduler.api.sampling_verbs import SamplingVerbs
from temper.scheduler.api.tokenizer_verbs import TokenizerVerbs
from temper.scheduler.db.views import KIND_NAMES, lora_of, run_message
from temper.scheduler.planning.work import WorkKind
from temper.v1 import service_pb2, service_pb2_grpc, trainer_pb2, types_pb2

# The session's run counter (sessions.num_training_runs, an INTEGER) stores the index + 1.
MAX_RUN_INDEX = 2**31 - 1


def needs_workers(method):
    """The verb waits until the trainers and samplers have answered (UNAVAILABLE after a while):
    a scheduler that has just started never answers "no trainer serves this model" by mistake."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        await self.backends.wait_ready()
        return await method(self, request, context)

    return wrapper


class TemperServicer(LaneRouting, AuditVerbs, ClusterStatusVerbs, SamplingVerbs, CheckpointVerbs, DownloadVerbs, ImportVerbs, ImageVerbs,
                     LookupVerbs, TokenizerVerbs, RecordVerbs, BillingCopyVerbs, ProjectVerbs,
                     service_pb2_grpc.TemperServicer):
    def __init__(self, store, backends: Backends, runs: RunRegistry, admission: Admission):
        self.store = store
        self.backends = backends
        self.runs = runs
        self.admission = admission
        self._closed_sessions: set[str] = set()   # closed in this process (sampling clients check it)
        self._creating_runs: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)  # per tenant: the run limit holds exactly
        self._init_sampling(admission.settings.image_limits())
        self.ownership = SoleOwner()  # replicas: the app sets LaneOwnership and a Forwarder (lane_routing.py)

    # ---- sessions -----------------------------------------------------------------------------

    @needs_workers
    async def GetServerCapabilities(self, request, context):
        await self.backends.settled()  # after a restart: not a partial list while workers are still registering again
        response = service_pb2.GetServerCapabilitiesResponse()
        for name in self.backends.model_names():
            trainers = [t for t in self.backends.trainers if t.info.base_model == name]
            samplers = [s for s in self.backends.samplers if s.info.base_model == name]
            lengths = [t.info.max_context_length for t in trainers] + [s.info.max_context_length for s in samplers]
            model = response.supported_models.add(model_name=name, max_context_length=min(lengths), trainable=bool(trainers),
                                                  sampleable=bool(samplers))
            # the model's family and routed experts, as its trainers report them (samplers do not): unset without a trainer
            described = next((t.info for t in trainers if t.info.family), None)
            if described is not None:
                model.family, model.num_experts = described.family, described.num_experts
                model.num_experts_per_tok = described.num_experts_per_tok
            # a vision-language model's token ids and image processor, as any of its workers report them
            seen = next((w.info.vision for w in trainers + samplers if serves_images(w.info)), None)
            if seen is not None:
                model.vision.CopyFrom(seen)
        return response

    async def CreateSession(self, request, context):
        check_user_metadata(request.user_metadata)
        if request.display_name and not request.display_name.strip():
            raise InvalidArgument("display_name must not be only spaces (leave it unset for none)")
        row = await asyncio.to_thread(self.store.create_session, caller(), list(request.tags), dict(request.user_metadata),
                                      caller_actor(), request.display_name, request.project_id)
        return service_pb2.Session(session_id=row.id)

    async def Heartbeat(self, request, context):
        await asyncio.to_thread(self.store.heartbeat, request.session_id, caller())
        return service_pb2.HeartbeatResponse()

    async def CloseSession(self, request, context):
        status = request.status or "success"
        if status not in ("success", "errored", "interrupted"):
            raise InvalidArgument(f"status must be success, errored or interrupted, got {status!r}")
        await asyncio.to_thread(self.store.close_session, request.session_id, status, caller(), caller_actor())
        self.release_session(request.session_id)
        return service_pb2.CloseSessionResponse()

    def release_session(self, session_id: str) -> None:
        """A closed or expired session's runs take no more work; its sampling clients answer FAILED_PRECONDITION."""
        self.runs.close_session(session_id)
        self._closed_sessions.add(session_id)

    # ---- training runs ------------------------------------------------------------------------

    @needs_workers
    async def CreateTrainingRun(self, request, context):
        if request.HasField("run_index") and not 0 <= request.run_index < MAX_RUN_INDEX:
            raise InvalidArgument(f"run_index must be in [0, {MAX_RUN_INDEX}), got {request.run_index}")
        check_user_metadata(request.user_metadata)
        request.lora_config.CopyFrom(lora_with_defaults(request.lora_config))  # a raw client's unset fields: Tinker's
        tenant = caller()
        source = await self._checkpoint_source(request, tenant) if request.from_path else None
        if source is None:
            if request.with_optimizer:
                raise InvalidArgument("with_optimizer needs from_path (the checkpoint to load)")
            check_lora(request.lora_config)
        base_model, cfg = (source.run.base_model, lora_of(source.run)) if source else (request.base_model, request.lora_config)
        await self.backends.served("trainer", base_model)  # its trainers may be registering again: waited for
        await asyncio.to_thread(self.store.open_session, request.session_id, tenant)
        trainer = self.backends.trainer_for(base_model, "")  # an unknown model leaves the session untouched
        if source is None:
            check_lora_for_model(cfg, trainer.info)
        if self._deterministic(request):
            check_deterministic((source.trainer if source else trainer).info, base_model)
        async with self._creating_runs[tenant]:
            limit = (await self.admission.quotas.limits(tenant)).max_training_runs
            if limit:
                check_hard_limit("max_training_runs", limit, await asyncio.to_thread(self.store.open_training_runs, tenant))
            return await self._create_run(request, tenant, base_model, cfg, source)

    def _deterministic(self, request) -> bool:
        """The mode a CreateTrainingRun/CreateSamplingClient asks for; unset: the scheduler's default."""
        return request.deterministic if request.HasField("deterministic") else self.admission.settings.deterministic_runs

    async def _checkpoint_source(self, request, tenant: str) -> CheckpointSource:
        """What a run created from ``request.from_path`` starts from; read only (nothing changes)."""
        path = parse_path(request.from_path)
        if request.with_optimizer and path.kind != types_pb2.CHECKPOINT_KIND_TRAINING:
            raise InvalidArgument("optimizer state is only in training checkpoints (tinker://<run>/weights/<name>)")
        _, run_row = await asyncio.to_thread(self.store.readable_checkpoint_and_run, str(path), tenant)
        if request.base_model and request.base_model != run_row.base_model:
            raise InvalidArgument(f"checkpoint {path} is of base model {run_row.base_model}, not {request.base_model}")
        source = await self.runs.get(run_row.id)  # may be another tenant's: the checkpoint is published
        # the new run lives where the checkpoint's files are
        return CheckpointSource(path, run_row, self.backends.trainer_for(source.base_model, source.run_id), request.with_optimizer)

    async def _create_run(self, request, tenant: str, base_model: str, cfg: types_pb2.LoraConfig,
                          source: CheckpointSource | None) -> service_pb2.TrainingRunInfo:
        index = request.run_index if request.HasField("run_index") else None
        number = await asyncio.to_thread(self.store.reserve_run, request.session_id, index)
        run_id, asked, snapshot = number.run_id, [], None  # asked: the trainers sent CreateAdapter
        create = trainer_pb2.CreateAdapterRequest(training_run_id=run_id, lora_config=cfg)
        try:
            if source is not None:
                trainer = source.trainer
                asked.append(trainer)
                created = await trainer.call("CreateAdapter", create)
                await source.load_into(run_id)
            else:
                # replicas: each knows only the runs it has seen; the database knows them all
                counts = await asyncio.to_thread(self.store.open_runs_per_trainer) if self.ownership.replicated else None
                trainer = self.backends.place(base_model, counts=counts)
                try:
                    asked.append(trainer)
                    created = await trainer.call("CreateAdapter", create)
                except Unavailable:  # that trainer is down: another of the model that answers takes the run
                    others = [t for t in self.backends.trainers if t.info.base_model == base_model and t is not trainer]
                    answering = [t for t in others if await t.ping()]
                    if not answering:
                        raise
                    trainer = self.backends.place(base_model, among=answering)
                    asked.append(trainer)
                    created = await trainer.call("CreateAdapter", create)
            if (source is not None or not cfg.HasField("seed")) and self.admission.settings.recovery != "off":
                # loaded weights or a random initialisation cannot be created again: trainer recovery restores them from this snapshot
                snapshot = snapshot_key(run_id, 0)
                await trainer.snapshot(run_id, snapshot)
            # the experts' rank in effect (cfg's 0 asks for the trainer's default): shown by GetInfo, asked for again on a rebuild
            row = new_run_row(run_id, request.session_id, base_model, cfg, dict(request.user_metadata), trainer.address,
                              snapshot, created_expert_rank(created), self._deterministic(request))
            await asyncio.to_thread(self.store.add_training_run, row)
        except BaseException:
            # a refused creation leaves nothing: no adapter or snapshot on a trainer, and the run number given back
            undone = [await undo_creation(t, run_id, [snapshot] if snapshot and t is asked[-1] else []) for t in asked]
            if all(undone):
                await give_back_run(self.store, request.session_id, number)
            raise
        self.backends.remember_placement(run_id, trainer.address)
        return self._run_info(self.runs.add(row, tenant))

    @needs_workers
    @on_lane_owner
    async def GetInfo(self, request, context):
        run = await self.runs.get(request.training_run_id, caller())
        return self._run_info(run, await asyncio.to_thread(self.store.get_training_run, run.run_id))

    def _run_info(self, run: RunInfo, fresh: m.TrainingRun | None = None) -> service_pb2.TrainingRunInfo:
        """``fresh``: the run's row as stored now (its last request time); else the one ``run`` holds."""
        trainer = self.backends.trainer_for(run.base_model, run.run_id)
        return run_message(fresh or run.row, run.tenant, self.admission.next_seq_id(run), trainer.info)

    # ---- the sequenced verbs: admission owns them ---------------------------------------------

    async def _submit(self, request, kind: WorkKind, check=None, check_async=None, offload: bool = False):
        await self.backends.wait_ready()
        with request_context(run=request.training_run_id, seq=request.seq_id, verb=kind.value):
            return await self.admission.submit(request.training_run_id, request.seq_id, kind, request, check, check_async,
                                               tenant=caller(), offload=offload)

    @on_lane_owner
    async def AbandonSeq(self, request, context):
        """A seq its client gave up on (retries spent in an outage, or the request failed before it was
        sent): skipped unless recorded, so the run's next request does not wait seq_gap_timeout_seconds."""
        with request_context(run=request.training_run_id, seq=request.seq_id, verb="abandon_seq"):
            skipped = await self.admission.abandon(request.training_run_id, request.seq_id, tenant=caller())
        return service_pb2.AbandonSeqResponse(skipped=skipped)

    @on_lane_owner
    async def ForwardBackward(self, request, context):
        def check(run: RunInfo) -> int:
            # images are checked, counted (N each, by the model's own processor) and expanded here: the
            # context length, the token count (rates, usage, cycle budgets) are the flattened input's
            info = self.backends.trainer_for(run.base_model, run.run_id).info
            data, _ = validate_forward_backward(request.data, request.loss_fn, request.loss_fn_config, info.vocab_size,
                                                info.max_context_length, vision=vision_of(info), limits=self._image_limits,
                                                model=run.base_model)
            return sum(len(d.tokens) for d in data)

        kind = WorkKind.FORWARD if request.forward_only else WorkKind.FORWARD_BACKWARD
        return await self._submit(request, kind, check, offload=self._check_in_thread(request))

    def _check_in_thread(self, request) -> bool:
        """Decoding images, or a vision model's first build of its processor, is CPU work for a thread."""
        if any(has_images(datum.model_input) for datum in request.data):
            return True
        run = self.runs.known(request.training_run_id)
        try:
            return run is not None and serves_images(self.backends.trainer_for(run.base_model, run.run_id).info)
        except TemperError:  # no trainer now: the check answers that, inline
            return False

    @on_lane_owner
    async def OptimStep(self, request, context):
        def check(run: RunInfo) -> int:
            if not request.HasField("adam_params"):
                raise InvalidArgument("optim_step needs adam_params")
            validate_adam(adam_with_defaults(request.adam_params))
            return 0

        return await self._submit(request, WorkKind.OPTIM_STEP, check)

    @on_lane_owner
    async def SaveWeights(self, request, context):
        def check(run: RunInfo) -> int:
            if request.kind not in KIND_DIRS:
                raise InvalidArgument("kind must be CHECKPOINT_KIND_SAMPLER, CHECKPOINT_KIND_TRAINING or CHECKPOINT_KIND_EXTERNAL")
            if request.ephemeral and request.kind != types_pb2.CHECKPOINT_KIND_SAMPLER:
                raise InvalidArgument("only sampler checkpoints can be ephemeral")
            if request.inflight:
                check_inflight_save(request)
            check_ttl(request.ttl_seconds)
            check_name(request.name)
            check_user_metadata(request.user_metadata)
            return 0

        async def not_taken(run: RunInfo) -> None:
            if request.overwrite:
                pass  # the checkpoint of that name is removed when this save runs (loop.py)
            elif await asyncio.to_thread(self.store.checkpoint_exists, run.run_id, KIND_NAMES[request.kind], request.name):
                raise AlreadyExists(f"checkpoint {KIND_DIRS[request.kind]}/{request.name} already exists for {run.run_id}")
            limit = (await self.admission.quotas.limits(run.tenant)).max_storage_bytes
            if limit and not (request.ephemeral or request.inflight):  # snapshots are collected by themselves; named saves are what fills storage
                check_hard_limit("max_storage_bytes", limit, await asyncio.to_thread(self.store.storage_bytes, run.tenant), adding=1)

        return await self._submit(request, WorkKind.SAVE_WEIGHTS, check, not_taken)

    @on_lane_owner
    async def LoadWeights(self, request, context):
        def check(run: RunInfo) -> int:
            path = parse_path(request.path)
            if request.with_optimizer and path.kind != types_pb2.CHECKPOINT_KIND_TRAINING:
                raise InvalidArgument("optimizer state is only in training checkpoints (tinker://<run>/weights/<name>)")
            return 0

        async def loadable(run: RunInfo) -> None:
            # Yours, or published by its owner (loading copies it into your run; the source is never written).
            checkpoint = await asyncio.to_thread(self.store.readable_checkpoint, str(parse_path(request.path)), run.tenant)
            source = await self.runs.get(checkpoint.training_run_id)
            if source.base_model != run.base_model:
                raise FailedPrecondition(f"checkpoint is for {source.base_model}, run {run.run_id} uses {run.base_model}")
            # a checkpoint has the LoRA layout of the run that saved it; the trainer loads only the same one
            mine, theirs = lora_layout(run.row), lora_layout(source.row)
            if mine != theirs:
                raise FailedPrecondition(f"checkpoint has {_shape(theirs)}; run {run.run_id} has {_shape(mine)}")
            if self.backends.trainer_for(run.base_model, run.run_id) is not self.backends.trainer_for(source.base_model, source.run_id):
                raise FailedPrecondition("loading across trainers needs durable checkpoint storage (not yet supported)")

        return await self._submit(request, WorkKind.LOAD_WEIGHTS, check, loadable)

    # ---- usage --------------------------------------------------------------------------------

    async def GetUsage(self, request, context):
        tenant = caller()
        weight, runs, samplers = await asyncio.to_thread(self.store.usage, tenant)
        response = service_pb2.UsageResponse(tenant=tenant, weight=weight)
        for run in runs:
            response.runs.add(training_run_id=run.id, tokens_trained=run.tokens_trained, steps=run.steps)
        for sampler in samplers:
            response.samplers.add(sampler_id=sampler.id, tokens_sampled=sampler.tokens_sampled)
        response.tokens_trained = sum(r.tokens_trained for r in runs)
        response.steps = sum(r.steps for r in runs)
        response.tokens_sampled = sum(s.tokens_sampled for s in samplers)
        response.storage_bytes = await asyncio.to_thread(self.store.storage_bytes, tenant)
        response.image_bytes = await asyncio.to_thread(self.store.image_bytes, tenant)
        limits, quotas = await self.admission.quotas.limits(tenant), self.admission.quotas
        held, parked = self.admission.depth_by_tenant().get(tenant, (0, 0))
        resident = max((sum(1 for owner in s.loaded.values() if owner == tenant) for s in self.backends.samplers), default=0)
        for name, limit, used, wait in (
            ("max_training_runs", limits.max_training_runs, await asyncio.to_thread(self.store.open_training_runs, tenant), 0.0),
            ("max_resident_adapters", limits.max_resident_adapters, resident, 0.0),
            ("max_queued_requests", limits.max_queued_requests, held - parked, 0.0),
            ("train_tokens_per_minute", limits.train_tokens_per_minute, quotas.trained.used(tenant), quotas.train_wait(tenant)),
            ("sample_tokens_per_minute", limits.sample_tokens_per_minute, quotas.sampled.used(tenant),
             quotas.sampled.wait_seconds(tenant, limits.sample_tokens_per_minute)),
            ("max_storage_bytes", limits.max_storage_bytes, response.storage_bytes, 0.0),
        ):
            response.limits.add(name=name, limit=limit, used=used, wait_seconds=wait)
        return response


def lora_layout(row: m.TrainingRun) -> tuple[int, bool, bool, bool, int]:
    """What fixes a run's adapter tensors: rank, the groups trained, the routed experts' rank (0: none)."""
    return row.lora_rank, bool(row.train_attn), bool(row.train_mlp), bool(row.train_unembed), row.lora_expert_rank or 0


def _shape(layout: tuple[int, bool, bool, bool, int]) -> str:
    """e.g. "LoRA rank 8 (routed experts rank 4) on attention+MLP"."""
    experts = f" (routed experts rank {layout[4]})" if layout[4] else ""
    targets = "+".join(name for name, on in zip(("attention", "MLP", "unembedding"), layout[1:4]) if on) or "nothing"
    return f"LoRA rank {layout[0]}{experts} on {targets}"
