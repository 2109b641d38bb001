"""gRPC face of the trainer: protobuf in, ``convert`` to domain objects, engine call on the compute
thread, ``convert`` back to protobuf."""

from __future__ import annotations

import asyncio
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor

from temper.common.errors import InvalidArgument, TemperError
from temper.common.uploads import FileAssembly
from temper.services.trainer import convert, imports, metrics
from temper.services.trainer.engine import TrainerEngine
from temper.services.trainer.tokenizer_files import file_pieces, tokenizer_files
from temper.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, engine: TrainerEngine):
        self.engine = engine
        # new per process start: the scheduler learns from it that the adapters it placed here are gone
        self.incarnation = secrets.token_hex(8)
        # One compute thread: torch work on the shared model is serialized, the event loop stays free.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")
        self._tokenizer_files: dict[str, bytes] | None = None  # saved on the first ReadTokenizer
        self._cleanups: set[asyncio.Task] = set()  # deletions of snapshots nobody will record (held: not collected)

    async def _run(self, rpc: str, fn, *args):
        # a failure is counted by the error interceptor (common/metrics.RPC_ERRORS), as every service's is
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def GetModelInfo(self, request, context):
        # a trainer group (group.GroupEngine) is one trainer of world_size ranks
        from temper.services.trainer.memory import device_memory_used_bytes
        info = convert.model_info_to_pb(self.engine.loaded, self.engine.settings.device, self.engine.settings.dtype,
                                        self.incarnation, getattr(self.engine, "world_size", 1),
                                        getattr(self.engine, "devices", None),
                                        getattr(self.engine, "device_memory", None) or [self._device_memory()],
                                        self.engine.deterministic_unsupported)
        info.device_memory_used_bytes = device_memory_used_bytes(self.engine.device)
        return info

    def _device_memory(self) -> int:
        from temper.services.trainer.memory import device_memory_bytes
        return device_memory_bytes(self.engine.device)

    async def CreateAdapter(self, request, context):
        expert_rank = await self._run("CreateAdapter", self._create, request)
        return trainer_pb2.CreateAdapterResponse(expert_rank=expert_rank)

    def _create(self, request: trainer_pb2.CreateAdapterRequest) -> int:
        spec, seed = convert.adapter_from_pb(request.lora_config, self.engine.settings.default_lora_alpha, self.engine.lora)
        return self.engine.create_adapter(request.training_run_id, spec, seed).spec.expert_rank

    async def DropAdapter(self, request, context):
        await self._run("DropAdapter", self.engine.drop_adapter, request.training_run_id)
        return trainer_pb2.DropAdapterResponse()

    async def RunCycle(self, request, context):
        return await self._run("RunCycle", self._cycle, request)

    def _cycle(self, request: trainer_pb2.CycleRequest) -> trainer_pb2.CycleResponse:
        # on the compute thread: decoding a big cycle is real work, and the event loop stays free
        loaded = self.engine.loaded
        forward_backward, optim_step = convert.cycle_from_pb(request, loaded.vocab_size, loaded.max_context_length,
                                                             loaded.vision, self.engine.image_limits, loaded.name)
        results, steps = self.engine.run_cycle(forward_backward, optim_step)
        for outcome in [*results, *steps]:
            if isinstance(outcome, TemperError):  # a refused item: answered in the response (the call succeeds)
                metrics.REFUSED_ITEMS.labels(outcome.code.name).inc()
        return convert.cycle_to_pb(results, steps)

    async def SaveAdapter(self, request, context):
        size = await self._run("SaveAdapter", self.engine.save, request.training_run_id, request.checkpoint_key,
                               request.include_optimizer, request.measure_only)
        return trainer_pb2.SaveAdapterResponse(size_bytes=size)

    async def LoadAdapter(self, request, context):
        await self._run("LoadAdapter", self.engine.load, request.training_run_id, request.checkpoint_key,
                        request.with_optimizer)
        return trainer_pb2.LoadAdapterResponse()

    async def SnapshotAdapter(self, request, context):
        key = request.checkpoint_key
        taking = asyncio.ensure_future(self._run("SnapshotAdapter", self.engine.snapshot, request.training_run_id, key))
        try:
            info = await asyncio.shield(taking)
        except asyncio.CancelledError:
            # The scheduler gave up on the call (its deadline passed, it abandoned a frozen trainer's
            # calls, or it died): it never records this snapshot, so the files, once written, are garbage.
            taking.add_done_callback(lambda taken: self._discard_unrecorded(key, taken))
            raise
        return trainer_pb2.SnapshotAdapterResponse(size_bytes=info.size_bytes, applied_seq_id=info.applied_seq,
                                                   steps=info.steps)

    def _discard_unrecorded(self, key: str, taken: asyncio.Future) -> None:
        if taken.cancelled() or taken.exception() is not None:
            return  # nothing was published (engine.snapshot discards its staging folder on failure)

        async def delete() -> None:
            try:
                await self._run("DeleteCheckpoint", self.engine.store.delete, key)
                log.info("deleted snapshot %s, written after its caller gave up on it", key)
            except (TemperError, OSError) as exc:
                log.warning("could not delete snapshot %s, written after its caller gave up on it: %s", key, exc)

        task = asyncio.ensure_future(delete())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def RestoreAdapter(self, request, context):
        info = await self._run("RestoreAdapter", self.engine.restore, request.training_run_id, request.checkpoint_key)
        return trainer_pb2.RestoreAdapterResponse(applied_seq_id=info.applied_seq, steps=info.steps)

    async def DeleteCheckpoint(self, request, context):
        # on the compute thread: never while a save or load of the same folder is under way
        freed = await self._run("DeleteCheckpoint", self.engine.store.delete, request.checkpoint_key)
        return trainer_pb2.DeleteCheckpointFilesResponse(freed_bytes=freed)

    async def CopyCheckpoint(self, request, context):
        # on the compute thread, as DeleteCheckpoint: never while a save or delete of these folders is under way
        size = await self._run("CopyCheckpoint", self.engine.store.copy, request.source_key, request.checkpoint_key)
        return trainer_pb2.CopyCheckpointFilesResponse(size_bytes=size)

    async def ReadCheckpoint(self, request, context):
        key, names = convert.checkpoint_files(request)
        for chunk in convert.file_chunks_to_pb(self.engine.store.read_chunks(key, names)):
            yield chunk

    async def ImportAdapter(self, request_iterator, context):
        key, files = await self._receive_import(request_iterator)
        size, lora = await self._run("ImportAdapter", self.engine.import_checkpoint, key, files)
        return trainer_pb2.ImportAdapterResponse(size_bytes=size, lora_config=convert.imported_lora_to_pb(lora))

    async def _receive_import(self, request_iterator) -> tuple[str, dict[str, bytes]]:
        """The checkpoint key and the adapter's files, held in memory (bounded by what an adapter of
        this model can be) until the engine checks and writes them."""
        key, upload = "", FileAssembly((imports.CONFIG_FILE, imports.WEIGHTS_FILE), imports.max_upload_bytes(self.engine.lora))
        async for message in request_iterator:
            if message.WhichOneof("payload") == "checkpoint_key":
                if key or upload.received:
                    raise InvalidArgument("only the first ImportAdapter message names the checkpoint")
                key = message.checkpoint_key
            else:
                upload.add(message.file)
        if not key:
            raise InvalidArgument("the first ImportAdapter message must name the checkpoint")
        return key, upload.files()

    async def ReadTokenizer(self, request, context):
        if self._tokenizer_files is None:
            loaded = self.engine.loaded
            processor_json = loaded.vision.processor_json if loaded.vision is not None else None
            self._tokenizer_files = await asyncio.to_thread(tokenizer_files, loaded.tokenizer, processor_json)
        for chunk in convert.file_chunks_to_pb(file_pieces(self._tokenizer_files)):
            yield chunk
