"""gRPC face of the sampler: checkpoints' adapters arrive as streams of file chunks; requests are
decoded by ``convert`` and sampled on one compute thread, batched with whatever else is waiting."""

from __future__ import annotations

import asyncio
import functools
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from temper.common.checkpoints import WEIGHT_FILES
from temper.common.errors import InvalidArgument, TemperError
from temper.services.sampler import convert, metrics
from temper.services.sampler.backend import SampleRequest, SampleResult, SamplerBackend
from temper.v1 import sampler_pb2, sampler_pb2_grpc


def _counted(method):
    """Count the RPC's failures by the status the error interceptor will send."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:
            metrics.ERRORS.labels(method.__name__, exc.code.name if isinstance(exc, TemperError) else "INTERNAL").inc()
            raise

    return wrapper


class SamplerServicer(sampler_pb2_grpc.SamplerServicer):
    def __init__(self, backend: SamplerBackend, adapter_dir: Path, max_num_samples: int, max_batch_sequences: int = 64):
        self.backend = backend
        self.max_batch_sequences = max_batch_sequences
        self._pending: list[tuple[SampleRequest, asyncio.Future]] = []
        self._batcher: asyncio.Task | None = None
        self.adapter_dir = Path(adapter_dir)
        self.adapter_dir.mkdir(parents=True, exist_ok=True)
        self.max_num_samples = max_num_samples
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler-compute")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def GetModelInfo(self, request, context):
        return convert.model_info_to_pb(self.backend.describe(), self.backend.name)

    @_counted
    async def PushAdapter(self, request_iterator, context):
        staging = Path(tempfile.mkdtemp(dir=self.adapter_dir, prefix=".push-"))
        checkpoint_key, received, handles = None, 0, {}
        try:
            async for message in request_iterator:
                if message.WhichOneof("payload") == "checkpoint_key":
                    checkpoint_key = message.checkpoint_key
                    continue
                chunk = message.file
                if chunk.relative_path not in WEIGHT_FILES:
                    raise InvalidArgument(f"unexpected adapter file {chunk.relative_path!r}")
                fh = handles.get(chunk.relative_path) or handles.setdefault(chunk.relative_path, open(staging / chunk.relative_path, "wb"))
                if fh.tell() != chunk.offset:
                    raise InvalidArgument(f"{chunk.relative_path}: chunk at offset {chunk.offset}, expected {fh.tell()}")
                fh.write(chunk.data)
                received += len(chunk.data)
            for fh in handles.values():
                fh.close()
            if not checkpoint_key:
                raise InvalidArgument("the first PushAdapter message must name the checkpoint")
            missing = [n for n in WEIGHT_FILES if not (staging / n).is_file()]
            if missing:
                raise InvalidArgument(f"adapter push is missing {missing}")
            await self._run(self.backend.load_adapter, checkpoint_key, staging)
        finally:
            for fh in handles.values():
                fh.close()
            # weights are in memory now (or the push failed): the files are not needed either way
            shutil.rmtree(staging, ignore_errors=True)
            self._count_adapters()
        return sampler_pb2.PushAdapterResponse(bytes_received=received)

    @_counted
    async def DropAdapter(self, request, context):
        try:
            await self._run(self.backend.drop_adapter, request.checkpoint_key)
        finally:
            self._count_adapters()
        return sampler_pb2.SamplerDropAdapterResponse()

    def _count_adapters(self) -> None:
        metrics.RESIDENT_ADAPTERS.set(len(self.backend.describe().loaded_checkpoints))

    @_counted
    async def Sample(self, request, context):
        start = time.perf_counter()
        sample = convert.sample_request_from_pb(request, self.backend.describe().vocab_size, self.max_num_samples)
        result = await self._submit(sample)
        metrics.SAMPLE_SECONDS.observe(time.perf_counter() - start)
        return convert.sample_result_to_pb(result, request.topk_logprobs)

    async def _submit(self, request: SampleRequest) -> SampleResult:
        """Queue a request; requests that arrive while a batch decodes go together into the next."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch, rows = [], 0
            while self._pending and (not batch or rows + self._pending[0][0].num_samples <= self.max_batch_sequences):
                item = self._pending.pop(0)
                batch.append(item)
                rows += item[0].num_samples
            try:
                results = await self._sample([r for r, _ in batch])
            except Exception:  # noqa: BLE001 - retry alone so one bad request fails only itself
                results = None
            for k, (request, future) in enumerate(batch):
                if future.done():
                    continue
                if results is not None:
                    future.set_result(results[k])
                    continue
                try:
                    future.set_result((await self._sample([request]))[0])
                except Exception as exc:  # noqa: BLE001 - delivered to that request's caller
                    future.set_exception(exc)

    async def _sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        results = await self._run(self.backend.sample_batch, requests)
        metrics.BATCH_SEQUENCES.observe(sum(r.num_samples for r in requests))
        metrics.TOKENS_SAMPLED.inc(sum(len(seq.tokens) for result in results for seq in result.sequences))
        return results

    @_counted
    async def ComputeLogprobs(self, request, context):
        checkpoint_key, prompt = convert.logprobs_request_from_pb(request)
        return convert.logprobs_to_pb(await self._run(self.backend.compute_logprobs, checkpoint_key, prompt))
