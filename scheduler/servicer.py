"""The public Temper API. Validates, persists what must survive, queues sequenced training work on
the scheduler loop and forwards sampling to samplers. Errors are raised, never returned."""

from __future__ import annotations

import asyncio
import hashlib

from temper.common.checkpoints import KIND_DIRS, check_name, parse_path
from temper.common.codec import decode_tokens
from temper.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from temper.common.validation import check_token_range, model_input_tokens, validate_adam, validate_forward_backward
from temper.scheduler.backends import Backends, downstream
from temper.scheduler.db import models as m
from temper.scheduler.db.store import Store
from temper.scheduler.loop import KIND_NAMES, SchedulerLoop, checkpoint_message
from temper.scheduler.work import Work, WorkKind
from temper.v1 import sampler_pb2, service_pb2, service_pb2_grpc, trainer_pb2, types_pb2

TENANT_METADATA_KEY = "x-temper-tenant"
ANSWER_TYPES = {  # what each sequenced verb answers (RequestRecord.result holds it serialized)
    WorkKind.FORWARD_BACKWARD: types_pb2.ForwardBackwardOutput, WorkKind.FORWARD: types_pb2.ForwardBackwardOutput,
    WorkKind.OPTIM_STEP: service_pb2.OptimStepResponse, WorkKind.SAVE_WEIGHTS: service_pb2.SaveWeightsResponse,
    WorkKind.LOAD_WEIGHTS: service_pb2.LoadWeightsResponse,
}
MAX_LORA_RANK = 1024


def _tenant(context) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_METADATA_KEY and value:
            return value
    return "default"


class TemperServicer(service_pb2_grpc.TemperServicer):
    def __init__(self, store: Store, backends: Backends, loop: SchedulerLoop):
        self.store = store
        self.backends = backends
        self.loop = loop
        self._runs: dict[str, m.TrainingRun] = {}
        self._loading: dict[str, asyncio.Future] = {}   # run id -> its first load in this process
        self._samplers: dict[str, m.SamplingClient] = {}
        self._tenants: dict[str, str] = {}   # session id -> tenant

    # ---- sessions -----------------------------------------------------------------------------

    async def GetServerCapabilities(self, request, context):
        response = service_pb2.GetServerCapabilitiesResponse()
        for name in self.backends.model_names():
            trainers = [t for t in self.backends.trainers if t.info.base_model == name]
            samplers = [s for s in self.backends.samplers if s.info.base_model == name]
            lengths = [t.info.max_context_length for t in trainers] + [s.info.max_context_length for s in samplers]
            response.supported_models.add(model_name=name, max_context_length=min(lengths), trainable=bool(trainers), sampleable=bool(samplers))
        return response

    async def CreateSession(self, request, context):
        row = await asyncio.to_thread(self.store.create_session, _tenant(context), list(request.tags), dict(request.user_metadata))
        return service_pb2.Session(session_id=row.id)

    async def Heartbeat(self, request, context):
        await asyncio.to_thread(self.store.heartbeat, request.session_id)
        return service_pb2.HeartbeatResponse()

    async def CloseSession(self, request, context):
        status = request.status or "success"
        if status not in ("success", "errored", "interrupted"):
            raise InvalidArgument(f"status must be success, errored or interrupted, got {status!r}")
        await asyncio.to_thread(self.store.close_session, request.session_id, status)
        return service_pb2.CloseSessionResponse()

    # ---- training runs ------------------------------------------------------------------------

    async def CreateTrainingRun(self, request, context):
        cfg = request.lora_config
        if not 0 < cfg.rank <= MAX_LORA_RANK:
            raise InvalidArgument(f"lora rank must be in [1, {MAX_LORA_RANK}], got {cfg.rank}")
        if not (cfg.train_attn or cfg.train_mlp or cfg.train_unembed):
            raise InvalidArgument("the LoRA config trains nothing: set train_attn, train_mlp or train_unembed")
        if cfg.alpha < 0 or not 0 <= cfg.dropout < 1:
            raise InvalidArgument("lora alpha must be >= 0 and dropout in [0, 1)")
        await asyncio.to_thread(self.store.open_session, request.session_id)
        # Checked before reserving an id, so an unknown model leaves the session untouched.
        self.backends.trainer_for(request.base_model, "")
        run_id = await asyncio.to_thread(self.store.next_run_id, request.session_id)
        trainer = self.backends.trainer_for(request.base_model, run_id)
        async with downstream(f"trainer {trainer.address}"):
            await trainer.stub.CreateAdapter(trainer_pb2.CreateAdapterRequest(training_run_id=run_id, lora_config=cfg))
        row = m.TrainingRun(
            id=run_id, session_id=request.session_id, base_model=request.base_model, lora_rank=cfg.rank,
            lora_alpha=cfg.alpha or 32.0, lora_dropout=cfg.dropout, seed=cfg.seed if cfg.HasField("seed") else None,
            train_attn=cfg.train_attn, train_mlp=cfg.train_mlp, train_unembed=cfg.train_unembed,
            user_metadata=dict(request.user_metadata), next_seq_id=1,
        )
        await asyncio.to_thread(self.store.add_training_run, row)
        self._runs[run_id] = row
        self.loop.register_run(run_id, row.base_model, 1, await self._tenant_of(row.session_id))
        return self._run_info(row)

    async def GetInfo(self, request, context):
        return self._run_info(await self._run(request.training_run_id))

    def _run_info(self, run: m.TrainingRun) -> service_pb2.TrainingRunInfo:
        trainer = self.backends.trainer_for(run.base_model, run.id)
        lora = types_pb2.LoraConfig(
            rank=run.lora_rank, alpha=run.lora_alpha, train_attn=run.train_attn, train_mlp=run.train_mlp,
            train_unembed=run.train_unembed, dropout=run.lora_dropout,
        )
        if run.seed is not None:
            lora.seed = run.seed
        return service_pb2.TrainingRunInfo(
            training_run_id=run.id, base_model=run.base_model, tokenizer_id=trainer.info.tokenizer_id, lora_config=lora,
            next_seq_id=self.loop.next_seq_id(run.id) or run.next_seq_id, vocab_size=trainer.info.vocab_size,
            max_context_length=trainer.info.max_context_length,
        )

    async def _run(self, run_id: str) -> m.TrainingRun:
        run = self._runs.get(run_id)
        if run is None:
            # The first use of a run in this process closes what an earlier process left on a
            # trainer; concurrent first uses share that one load (it must precede any dispatch).
            loading = self._loading.get(run_id)
            if loading is None:
                barriers = [kind.value for kind in WorkKind if kind.is_barrier]
                loading = self._loading[run_id] = asyncio.ensure_future(
                    asyncio.to_thread(self.store.recover_interrupted, run_id, barriers))
            try:
                run = await asyncio.shield(loading)
            finally:
                if loading.done():
                    self._loading.pop(run_id, None)
            self._runs.setdefault(run_id, run)
            run = self._runs[run_id]
        self.loop.register_run(run.id, run.base_model, run.next_seq_id, await self._tenant_of(run.session_id))
        return run

    async def _tenant_of(self, session_id: str) -> str:
        tenant = self._tenants.get(session_id)
        if tenant is None:
            tenant = self._tenants[session_id] = await asyncio.to_thread(self.store.tenant_of_session, session_id)
        return tenant

    # ---- the sequenced verbs ------------------------------------------------------------------

    async def ForwardBackward(self, request, context):
        async def validate(run):
            trainer = self.backends.trainer_for(run.base_model, run.id)
            data, _ = validate_forward_backward(
                request.data, request.loss_fn, request.loss_fn_config, trainer.info.vocab_size, trainer.info.max_context_length
            )
            return sum(len(d.tokens) for d in data)

        kind = WorkKind.FORWARD if request.forward_only else WorkKind.FORWARD_BACKWARD
        return await self._sequenced(request, kind, validate)

    async def OptimStep(self, request, context):
        async def validate(run):
            if not request.HasField("adam_params"):
                raise InvalidArgument("optim_step needs adam_params")
            validate_adam(request.adam_params)
            return 0

        return await self._sequenced(request, WorkKind.OPTIM_STEP, validate)

    async def SaveWeights(self, request, context):
        async def validate(run):
            if request.kind not in KIND_DIRS:
                raise InvalidArgument("kind must be CHECKPOINT_KIND_SAMPLER or CHECKPOINT_KIND_TRAINING")
            check_name(request.name)
            if await asyncio.to_thread(self.store.checkpoint_exists, run.id, KIND_NAMES[request.kind], request.name):
                raise AlreadyExists(f"checkpoint {KIND_DIRS[request.kind]}/{request.name} already exists for {run.id}")
            return 0

        return await self._sequenced(request, WorkKind.SAVE_WEIGHTS, validate)

    async def LoadWeights(self, request, context):
        async def validate(run):
            path = parse_path(request.path)
            checkpoint = await asyncio.to_thread(self.store.get_checkpoint, str(path))
            source = await self._run(checkpoint.training_run_id)
            if source.base_model != run.base_model:
                raise FailedPrecondition(f"checkpoint is for {source.base_model}, run {run.id} uses {run.base_model}")
            if request.with_optimizer and path.kind != types_pb2.CHECKPOINT_KIND_TRAINING:
                raise InvalidArgument("optimizer state is only in training checkpoints (tinker://<run>/weights/<name>)")
            if self.backends.trainer_for(run.base_model, run.id).address != self.backends.trainer_for(source.base_model, source.id).address:
                raise FailedPrecondition("loading across trainers needs durable checkpoint storage (not yet supported)")
            return 0

        return await self._sequenced(request, WorkKind.LOAD_WEIGHTS, validate)

    async def _sequenced(self, request, kind: WorkKind, validate):
        """Run ``request`` in its run's seq order. ``validate(run)`` raises on bad input (the seq is
        then spent and nothing else changes) or returns the request's token count."""
        run = await self._run(request.training_run_id)
        seq = request.seq_id
        if seq < 1:
            raise InvalidArgument(f"seq_id must be >= 1, got {seq}")
        sha = hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()
        existing, recorded = self.loop.known(run.id, seq), False
        if existing is None:
            record = await asyncio.to_thread(self.store.get_request, run.id, seq)
            existing = self.loop.known(run.id, seq)  # another retry may have arrived meanwhile
            if existing is None and record is not None:
                if record.payload_sha256 != sha:
                    raise AlreadyExists(f"seq_id {seq} of {run.id} was used by a different request")
                if record.status == "done" and record.result is not None:
                    return ANSWER_TYPES[kind].FromString(record.result)  # answered by an earlier process
                if record.status not in ("queued", "running"):
                    detail = f": {record.error}" if record.error else ""
                    raise FailedPrecondition(f"seq_id {seq} of {run.id} already ran ({record.status}{detail}); "
                                             f"its result is no longer held")
                # Accepted by an earlier scheduler process that stopped before it had an answer: it is
                # queued again (its row already exists). If it had reached the trainer, the trainer
                # answers it from memory by its seq instead of applying it twice.
                recorded = True
        if existing is not None:
            if existing.payload_sha256 != sha:
                raise AlreadyExists(f"seq_id {seq} of {run.id} was used by a different request")
            return await asyncio.shield(existing.future)
        next_seq = self.loop.next_seq_id(run.id)
        if self.loop.skipped(run.id, seq):
            raise FailedPrecondition(f"seq_id {seq} of {run.id} arrived after the scheduler stopped waiting for it "
                                     f"(TEMPER_SEQ_GAP_TIMEOUT_SECONDS); the run's later requests went on without it")
        if seq < next_seq:
            raise InvalidArgument(f"seq_id {seq} of {run.id} is behind the next expected seq_id {next_seq}")
        self.loop.check_capacity(run.id, seq)  # full: nothing is claimed, the client retries the same seq later
        work = Work(run.id, seq, kind, request, sha)
        self.loop.claim(work)  # from here a retry of this (run, seq) waits for this answer
        try:
            work.num_tokens = await validate(run)
            if not recorded:
                await asyncio.to_thread(self.store.add_request, run.id, seq, kind.value, sha, "queued", work.num_tokens)
        except Exception as exc:  # noqa: BLE001 - any rejection must still release the seq
            # The seq is spent (the client numbered later requests after it) but nothing else changes;
            # a failed add_request wrote nothing either.
            work.rejected = True
            self.loop.enqueue(work)
            work.fail(exc)
            work.future.exception()  # retrieved: this call re-raises it
            raise
        self.loop.enqueue(work)
        return await asyncio.shield(work.future)

    # ---- sampling -----------------------------------------------------------------------------

    async def CreateSamplingClient(self, request, context):
        await asyncio.to_thread(self.store.open_session, request.session_id)
        source = request.WhichOneof("source")
        if source == "model_path":
            path = parse_path(request.model_path)
            checkpoint = await asyncio.to_thread(self.store.get_checkpoint, str(path))
            run = await self._run(checkpoint.training_run_id)
            base_model, model_path = run.base_model, str(path)
            sampler = self.backends.sampler_for(base_model)
            await self.backends.push_checkpoint(self.backends.trainer_for(base_model, run.id), sampler, path.key)
        elif source == "base_model":
            base_model, model_path = request.base_model, None
            sampler = self.backends.sampler_for(base_model)
        else:
            raise InvalidArgument("give base_model or model_path")
        row = await asyncio.to_thread(self.store.add_sampling_client, request.session_id, base_model, model_path)
        self._samplers[row.id] = row
        return service_pb2.SamplingClientInfo(
            sampler_id=row.id, base_model=base_model, model_path=model_path or "", tokenizer_id=sampler.info.tokenizer_id,
            vocab_size=sampler.info.vocab_size,
        )

    async def _sampling_target(self, sampler_id: str, prompt: types_pb2.ModelInput):
        row = self._samplers.get(sampler_id)
        if row is None:
            row = await asyncio.to_thread(self.store.get_sampling_client, sampler_id)
            self._samplers[sampler_id] = row
        sampler = self.backends.sampler_for(row.base_model)
        adapter_id = ""
        if row.model_path:
            path = parse_path(row.model_path)
            adapter_id = path.key
            if adapter_id not in sampler.loaded:  # e.g. after a sampler restart
                run = await self._run(path.training_run_id)
                await self.backends.push_checkpoint(self.backends.trainer_for(run.base_model, run.id), sampler, adapter_id)
        tokens = model_input_tokens(prompt)
        if tokens.size == 0:
            raise InvalidArgument("prompt is empty")
        check_token_range(tokens, sampler.info.vocab_size, "prompt")
        return sampler, adapter_id, tokens

    async def Sample(self, request, context):
        sampler, adapter_id, tokens = await self._sampling_target(request.sampler_id, request.prompt)
        if request.num_samples < 1:
            raise InvalidArgument(f"num_samples must be >= 1, got {request.num_samples}")
        stop_ids = decode_tokens(request.sampling_params.stop_token_ids)
        check_token_range(stop_ids, sampler.info.vocab_size, "stop token ids")
        async with downstream(f"sampler {sampler.address}"):
            response = await sampler.stub.Sample(sampler_pb2.SamplerSampleRequest(
                checkpoint_key=adapter_id, prompt_tokens=tokens.astype("<i4").tobytes(), num_samples=request.num_samples,
                sampling_params=request.sampling_params, include_prompt_logprobs=request.include_prompt_logprobs,
                topk_logprobs=request.topk_logprobs,
            ))
        generated = sum(len(s.tokens) // 4 for s in response.sequences)
        await asyncio.to_thread(self.store.add_sampled_tokens, request.sampler_id, generated)
        return response

    async def ComputeLogprobs(self, request, context):
        sampler, adapter_id, tokens = await self._sampling_target(request.sampler_id, request.prompt)
        async with downstream(f"sampler {sampler.address}"):
            response = await sampler.stub.ComputeLogprobs(
                sampler_pb2.SamplerLogprobsRequest(checkpoint_key=adapter_id, prompt_tokens=tokens.astype("<i4").tobytes())
            )
        return service_pb2.ComputeLogprobsResponse(logprobs=response.logprobs)

    async def GetUsage(self, request, context):
        tenant = _tenant(context)
        weight, runs, samplers = await asyncio.to_thread(self.store.usage, tenant)
        response = service_pb2.UsageResponse(tenant=tenant, weight=weight)
        for run in runs:
            response.runs.add(training_run_id=run.id, tokens_trained=run.tokens_trained, steps=run.steps)
        for sampler in samplers:
            response.samplers.add(sampler_id=sampler.id, tokens_sampled=sampler.tokens_sampled)
        response.tokens_trained = sum(r.tokens_trained for r in runs)
        response.steps = sum(r.steps for r in runs)
        response.tokens_sampled = sum(s.tokens_sampled for s in samplers)
        return response

    # ---- checkpoints --------------------------------------------------------------------------

    async def ListCheckpoints(self, request, context):
        rows = await asyncio.to_thread(self.store.list_checkpoints, request.training_run_id)
        return service_pb2.ListCheckpointsResponse(checkpoints=[checkpoint_message(r) for r in rows])

    async def DownloadCheckpoint(self, request, context):
        path = parse_path(request.path)
        await asyncio.to_thread(self.store.get_checkpoint, str(path))
        run = await self._run(path.training_run_id)
        trainer = self.backends.trainer_for(run.base_model, run.id)
        async with downstream(f"trainer {trainer.address}"):
            async for chunk in trainer.stub.ReadCheckpoint(trainer_pb2.ReadCheckpointRequest(checkpoint_key=path.key)):
                yield chunk

