"""The public Temper API: each verb checks its input and hands sequenced work to admission;
sampling is forwarded to a sampler. Errors are raised, never returned (one interceptor maps them)."""

from __future__ import annotations

import asyncio
import functools
import math
import re

from temper.common.checkpoints import KIND_DIRS, check_name, parse_path
from temper.common.codec import decode_tokens
from temper.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from temper.common.logs import request_context
from temper.common.strings import shown
from temper.common.validation import check_token_range, model_input_tokens, validate_adam, validate_forward_backward
from temper.scheduler import metrics
from temper.scheduler.admission import Admission
from temper.scheduler.backends import Backends
from temper.scheduler.db import models as m
from temper.scheduler.loop import KIND_NAMES, checkpoint_message
from temper.scheduler.runs import RunInfo, RunRegistry
from temper.scheduler.work import WorkKind
from temper.v1 import sampler_pb2, service_pb2, service_pb2_grpc, trainer_pb2, types_pb2

TENANT_METADATA_KEY = "x-temper-tenant"
MAX_LORA_RANK = 1024


_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")


def _tenant(context) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_METADATA_KEY and value:
            if not _TENANT.fullmatch(value):
                raise InvalidArgument(f"{TENANT_METADATA_KEY} must match {_TENANT.pattern}, got {shown(value)}")
            return value
    return "default"


def needs_workers(method):
    """The verb waits until the trainers and samplers have answered (UNAVAILABLE after a while):
    a scheduler that has just started never answers "no trainer serves this model" by mistake."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        await self.backends.wait_ready()
        return await method(self, request, context)

    return wrapper


class TemperServicer(service_pb2_grpc.TemperServicer):
    def __init__(self, store, backends: Backends, runs: RunRegistry, admission: Admission):
        self.store = store
        self.backends = backends
        self.runs = runs
        self.admission = admission
        self._samplers: dict[str, m.SamplingClient] = {}
        self._closed_sessions: set[str] = set()   # closed in this process (sampling clients check it)

    # ---- sessions -----------------------------------------------------------------------------

    @needs_workers
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
        self.runs.close_session(request.session_id)
        self._closed_sessions.add(request.session_id)
        return service_pb2.CloseSessionResponse()

    # ---- training runs ------------------------------------------------------------------------

    @needs_workers
    async def CreateTrainingRun(self, request, context):
        cfg = request.lora_config
        if not 0 < cfg.rank <= MAX_LORA_RANK:
            raise InvalidArgument(f"lora rank must be in [1, {MAX_LORA_RANK}], got {cfg.rank}")
        if not (cfg.train_attn or cfg.train_mlp or cfg.train_unembed):
            raise InvalidArgument("the LoRA config trains nothing: set train_attn, train_mlp or train_unembed")
        if not math.isfinite(cfg.alpha) or cfg.alpha < 0 or not 0 <= cfg.dropout < 1:
            raise InvalidArgument("lora alpha must be a finite number >= 0 and dropout in [0, 1)")
        await asyncio.to_thread(self.store.open_session, request.session_id)
        self.backends.trainer_for(request.base_model, "")  # an unknown model leaves the session untouched
        run_id = await asyncio.to_thread(self.store.next_run_id, request.session_id)
        trainer = self.backends.trainer_for(request.base_model, run_id)
        await trainer.call("CreateAdapter", trainer_pb2.CreateAdapterRequest(training_run_id=run_id, lora_config=cfg))
        row = m.TrainingRun(
            id=run_id, session_id=request.session_id, base_model=request.base_model, lora_rank=cfg.rank,
            lora_alpha=cfg.alpha or 32.0, lora_dropout=cfg.dropout, seed=cfg.seed if cfg.HasField("seed") else None,
            train_attn=cfg.train_attn, train_mlp=cfg.train_mlp, train_unembed=cfg.train_unembed,
            user_metadata=dict(request.user_metadata), next_seq_id=1,
        )
        await asyncio.to_thread(self.store.add_training_run, row)
        tenant = await asyncio.to_thread(self.store.tenant_of_session, row.session_id)
        return self._run_info(self.runs.add(row, tenant))

    @needs_workers
    async def GetInfo(self, request, context):
        return self._run_info(await self.runs.get(request.training_run_id))

    def _run_info(self, run: RunInfo) -> service_pb2.TrainingRunInfo:
        trainer, row = self.backends.trainer_for(run.base_model, run.run_id), run.row
        lora = types_pb2.LoraConfig(rank=row.lora_rank, alpha=row.lora_alpha, train_attn=row.train_attn, train_mlp=row.train_mlp,
                                    train_unembed=row.train_unembed, dropout=row.lora_dropout)
        if row.seed is not None:
            lora.seed = row.seed
        return service_pb2.TrainingRunInfo(
            training_run_id=run.run_id, base_model=run.base_model, tokenizer_id=trainer.info.tokenizer_id, lora_config=lora,
            next_seq_id=self.admission.next_seq_id(run), vocab_size=trainer.info.vocab_size,
            max_context_length=trainer.info.max_context_length,
        )

    # ---- the sequenced verbs: admission owns them ---------------------------------------------

    async def _submit(self, request, kind: WorkKind, check=None, check_async=None):
        await self.backends.wait_ready()
        with request_context(run=request.training_run_id, seq=request.seq_id, verb=kind.value):
            return await self.admission.submit(request.training_run_id, request.seq_id, kind, request, check, check_async)

    async def ForwardBackward(self, request, context):
        def check(run: RunInfo) -> int:
            trainer = self.backends.trainer_for(run.base_model, run.run_id)
            data, _ = validate_forward_backward(request.data, request.loss_fn, request.loss_fn_config, trainer.info.vocab_size,
                                                trainer.info.max_context_length)
            return sum(len(d.tokens) for d in data)

        return await self._submit(request, WorkKind.FORWARD if request.forward_only else WorkKind.FORWARD_BACKWARD, check)

    async def OptimStep(self, request, context):
        def check(run: RunInfo) -> int:
            if not request.HasField("adam_params"):
                raise InvalidArgument("optim_step needs adam_params")
            validate_adam(request.adam_params)
            return 0

        return await self._submit(request, WorkKind.OPTIM_STEP, check)

    async def SaveWeights(self, request, context):
        def check(run: RunInfo) -> int:
            if request.kind not in KIND_DIRS:
                raise InvalidArgument("kind must be CHECKPOINT_KIND_SAMPLER or CHECKPOINT_KIND_TRAINING")
            check_name(request.name)
            return 0

        async def not_taken(run: RunInfo) -> None:
            if await asyncio.to_thread(self.store.checkpoint_exists, run.run_id, KIND_NAMES[request.kind], request.name):
                raise AlreadyExists(f"checkpoint {KIND_DIRS[request.kind]}/{request.name} already exists for {run.run_id}")

        return await self._submit(request, WorkKind.SAVE_WEIGHTS, check, not_taken)

    async def LoadWeights(self, request, context):
        def check(run: RunInfo) -> int:
            path = parse_path(request.path)
            if request.with_optimizer and path.kind != types_pb2.CHECKPOINT_KIND_TRAINING:
                raise InvalidArgument("optimizer state is only in training checkpoints (tinker://<run>/weights/<name>)")
            return 0

        async def loadable(run: RunInfo) -> None:
            checkpoint = await asyncio.to_thread(self.store.get_checkpoint, str(parse_path(request.path)))
            source = await self.runs.get(checkpoint.training_run_id)
            if source.base_model != run.base_model:
                raise FailedPrecondition(f"checkpoint is for {source.base_model}, run {run.run_id} uses {run.base_model}")
            if self.backends.trainer_for(run.base_model, run.run_id) is not self.backends.trainer_for(source.base_model, source.run_id):
                raise FailedPrecondition("loading across trainers needs durable checkpoint storage (not yet supported)")

        return await self._submit(request, WorkKind.LOAD_WEIGHTS, check, loadable)

    # ---- sampling -----------------------------------------------------------------------------

    @needs_workers
    async def CreateSamplingClient(self, request, context):
        await asyncio.to_thread(self.store.open_session, request.session_id)
        source = request.WhichOneof("source")
        if source == "model_path":
            path = parse_path(request.model_path)
            checkpoint = await asyncio.to_thread(self.store.get_checkpoint, str(path))
            run = await self.runs.get(checkpoint.training_run_id)
            base_model, model_path = run.base_model, str(path)
            sampler = self.backends.sampler_for(base_model)
            await self.backends.push_checkpoint(self.backends.trainer_for(base_model, run.run_id), sampler, path.key)
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
            if await asyncio.to_thread(self.store.session_closed, row.session_id):
                self._closed_sessions.add(row.session_id)
            self._samplers[sampler_id] = row
        if row.session_id in self._closed_sessions:
            raise FailedPrecondition(f"the session of sampling client {sampler_id} is closed")
        sampler = self.backends.sampler_for(row.base_model)
        checkpoint_key = ""
        if row.model_path:
            path = parse_path(row.model_path)
            checkpoint_key = path.key
            if checkpoint_key not in sampler.loaded:  # e.g. after a sampler restart
                run = await self.runs.get(path.training_run_id)
                await self.backends.push_checkpoint(self.backends.trainer_for(run.base_model, run.run_id), sampler, checkpoint_key)
        tokens = model_input_tokens(prompt)
        if tokens.size == 0:
            raise InvalidArgument("prompt is empty")
        check_token_range(tokens, sampler.info.vocab_size, "prompt")
        if len(tokens) > sampler.info.max_context_length:
            raise InvalidArgument(f"prompt has {len(tokens)} tokens; the context length is {sampler.info.max_context_length}")
        return sampler, checkpoint_key, tokens

    @needs_workers
    async def Sample(self, request, context):
        sampler, checkpoint_key, tokens = await self._sampling_target(request.sampler_id, request.prompt)
        if request.num_samples < 1:
            raise InvalidArgument(f"num_samples must be >= 1, got {request.num_samples}")
        check_token_range(decode_tokens(request.sampling_params.stop_token_ids), sampler.info.vocab_size, "stop token ids")
        response = await sampler.call("Sample", sampler_pb2.SamplerSampleRequest(
            checkpoint_key=checkpoint_key, prompt_tokens=tokens.astype("<i4").tobytes(), num_samples=request.num_samples,
            sampling_params=request.sampling_params, include_prompt_logprobs=request.include_prompt_logprobs,
            topk_logprobs=request.topk_logprobs,
        ))
        generated = sum(len(s.tokens) // 4 for s in response.sequences)
        await asyncio.to_thread(self.store.add_sampled_tokens, request.sampler_id, generated)
        metrics.TOKENS_SAMPLED.labels(_tenant(context)).inc(generated)
        return response

    @needs_workers
    async def ComputeLogprobs(self, request, context):
        sampler, checkpoint_key, tokens = await self._sampling_target(request.sampler_id, request.prompt)
        response = await sampler.call("ComputeLogprobs", sampler_pb2.SamplerLogprobsRequest(
            checkpoint_key=checkpoint_key, prompt_tokens=tokens.astype("<i4").tobytes()))
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
        await self.backends.wait_ready()
        path = parse_path(request.path)
        await asyncio.to_thread(self.store.get_checkpoint, str(path))
        run = await self.runs.get(path.training_run_id)
        async for chunk in self.backends.trainer_for(run.base_model, run.run_id).read_checkpoint(path.key):
            yield chunk
