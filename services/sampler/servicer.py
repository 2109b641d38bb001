"""gRPC face of the sampler: adapters arrive as streams of file chunks; sampling runs on one
compute thread."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from temper.common.codec import decode_tokens, encode_array, encode_floats, encode_tokens
from temper.common.errors import InvalidArgument
from temper.services.sampler.backend import SampleRequest, SampleResult, SamplerBackend, SamplingOptions
from temper.common.checkpoints import WEIGHT_FILES
from temper.v1 import sampler_pb2, sampler_pb2_grpc, types_pb2

_STOP_REASONS = {"stop": types_pb2.STOP_REASON_STOP, "length": types_pb2.STOP_REASON_LENGTH}


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
        d = self.backend.describe()
        return sampler_pb2.SamplerModelInfo(
            base_model=d.base_model, tokenizer_id=d.tokenizer_id, vocab_size=d.vocab_size,
            max_context_length=d.max_context_length, backend=self.backend.name, loaded_adapters=d.loaded_adapters,
        )

    async def PushAdapter(self, request_iterator, context):
        staging = Path(tempfile.mkdtemp(dir=self.adapter_dir, prefix=".push-"))
        adapter_id, received, handles = None, 0, {}
        try:
            async for message in request_iterator:
                if message.WhichOneof("payload") == "checkpoint_key":
                    adapter_id = message.checkpoint_key
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
            if not adapter_id:
                raise InvalidArgument("the first PushAdapter message must name the adapter")
            missing = [n for n in WEIGHT_FILES if not (staging / n).is_file()]
            if missing:
                raise InvalidArgument(f"adapter push is missing {missing}")
            await self._run(self.backend.load_adapter, adapter_id, staging)
        finally:
            for fh in handles.values():
                fh.close()
            # weights are in memory now (or the push failed): the files are not needed either way
            shutil.rmtree(staging, ignore_errors=True)
        return sampler_pb2.PushAdapterResponse(bytes_received=received)

    async def DropAdapter(self, request, context):
        await self._run(self.backend.drop_adapter, request.checkpoint_key)
        return sampler_pb2.SamplerDropAdapterResponse()

    async def Sample(self, request, context):
        if not 1 <= request.num_samples <= self.max_num_samples:
            raise InvalidArgument(f"num_samples must be in [1, {self.max_num_samples}], got {request.num_samples}")
        options = SamplingOptions.from_proto(request.sampling_params, self.backend.describe().vocab_size)
        prompt = decode_tokens(request.prompt_tokens)
        vocab = self.backend.describe().vocab_size
        if not 0 <= request.topk_logprobs <= min(vocab, 100):
            raise InvalidArgument(f"topk_logprobs must be in [0, {min(vocab, 100)}], got {request.topk_logprobs}")
        sample = SampleRequest(request.checkpoint_key or None, prompt, request.num_samples, options, request.include_prompt_logprobs,
                               request.topk_logprobs)
        result = await self._submit(sample)
        response = types_pb2.SampleResponse()
        for seq in result.sequences:
            out = response.sequences.add(
                stop_reason=_STOP_REASONS[seq.stop_reason], tokens=encode_tokens(seq.tokens), logprobs=encode_floats(seq.logprobs)
            )
            if seq.topk_ids is not None:
                out.topk = request.topk_logprobs
                out.topk_token_ids = encode_tokens([t for row in seq.topk_ids for t in row])
                out.topk_logprobs = encode_floats([x for row in seq.topk_logprobs for x in row])
        if result.prompt_logprobs is not None:
            response.prompt_logprobs.CopyFrom(encode_array(result.prompt_logprobs, "float32"))
        return response

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
                results = await self._run(self.backend.sample_batch, [r for r, _ in batch])
            except Exception:  # noqa: BLE001 - retry alone so one bad request fails only itself
                results = None
            for k, (request, future) in enumerate(batch):
                if future.done():
                    continue
                if results is not None:
                    future.set_result(results[k])
                    continue
                try:
                    future.set_result((await self._run(self.backend.sample_batch, [request]))[0])
                except Exception as exc:  # noqa: BLE001 - delivered to that request's caller
                    future.set_exception(exc)

    async def ComputeLogprobs(self, request, context):
        logprobs = await self._run(self.backend.compute_logprobs, request.checkpoint_key or None, decode_tokens(request.prompt_tokens))
        return sampler_pb2.ComputeLogprobsResponseInternal(logprobs=encode_array(logprobs, "float32"))
