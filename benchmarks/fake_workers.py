"""Fake trainers and samplers for measuring the scheduler itself: the real gRPC contract
(``protos/temper/v1/trainer.proto``, ``sampler.proto``), served by the real ``build_server`` behind the
internal token, with the compute replaced by a sleep proportional to the tokens of each call.

A fake trainer holds adapters by run id, answers every ``RunCycle`` item (one ``ForwardBackwardOutput``
with per-datum ``logprobs`` / ``elementwise_loss`` and ``loss:sum``, one optim-step answer, one OK
status each; NOT_FOUND for a run it holds no adapter of), and runs one cycle at a time, as the real
trainer's compute thread does. A cycle sleeps ``seconds_per_1k_tokens`` per 1000 forward/backward
tokens. Its answers also carry, in their metrics, what the benchmark needs to take the worker's time
out of a verb's latency:

    bench_trainer:max   index of the fake trainer that ran the item's cycle
    bench_cycle:max     that trainer's cycle number (1, 2, ...)
    bench_start_s:max   time.monotonic() when the cycle started (after waiting for the previous one)
    bench_end_s:max     time.monotonic() when it ended (CLOCK_MONOTONIC: one clock for every process on Linux)
    bench_tokens:sum    forward/backward tokens in the whole cycle
    bench_sleep_s:max   the sleep the cycle asked for (tokens x rate); end - start is what it took

Checkpoints are small fake peft files kept in memory, shared by the trainers of one process (the
stand-in for the shared checkpoint folder). A fake sampler serves ``GetModelInfo``, ``PushAdapter``,
``DropAdapter``, ``Sample`` (``max_tokens`` tokens of id 0 per sample) and ``ComputeLogprobs``, with the
same sleep per token.

As a process (what ``scaleout.py`` starts): N trainers and M samplers on free loopback ports, the
token from ``TEMPER_FAKE_WORKERS_INTERNAL_TOKEN``; it prints one line and serves until SIGTERM:

    TEMPER_FAKE_WORKERS_INTERNAL_TOKEN=... python benchmarks/fake_workers.py --trainers 4 --samplers 1 \\
        --seconds-per-1k-tokens 0.05
    TEMPER_READY fake_workers trainers=127.0.0.1:41001,... samplers=127.0.0.1:41009 pid=1234
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import numpy as np

from temper.common.codec import encode_array
from temper.common.errors import AlreadyExists, FailedPrecondition, NotFound
from temper.common.internal_auth import token_authenticator
from temper.common.server import build_server, mark_serving
from temper.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc, types_pb2

try:
    from temper.common.errors import AdapterNotLoaded
except ImportError:  # an older tree: the same wire answer, built by hand
    class AdapterNotLoaded(FailedPrecondition):
        def __init__(self, checkpoint_key: str):
            super().__init__(f"ADAPTER_NOT_LOADED: checkpoint {checkpoint_key} is not loaded on this sampler")

MODEL = "bench/fake-model"
VOCAB_SIZE = 32000
MAX_CONTEXT = 32768
TOKEN_ENV = "TEMPER_FAKE_WORKERS_INTERNAL_TOKEN"
TRAINER = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
SAMPLER = sampler_pb2.DESCRIPTOR.services_by_name["Sampler"].full_name
NOT_FOUND = 5  # grpc.StatusCode.NOT_FOUND's number, as ItemStatus carries it
# The metric names above (``name:reduction``, like the trainer's own).
M_TRAINER, M_CYCLE, M_START, M_END, M_TOKENS, M_SLEEP = ("bench_trainer:max", "bench_cycle:max", "bench_start_s:max",
                                                        "bench_end_s:max", "bench_tokens:sum", "bench_sleep_s:max")


def _has_field(message, name: str) -> bool:
    """Whether this build of the protos has the field (the contract grows; the fakes follow it)."""
    return name in message.DESCRIPTOR.fields_by_name


def datum_tokens(datum: types_pb2.Datum) -> int:
    return sum(len(chunk.encoded_text.tokens) // 4 for chunk in datum.model_input.chunks)


@dataclass
class CheckpointFiles:
    """Checkpoints in memory: key -> {relative path: bytes}, shared by the trainers of a process."""

    files: dict[str, dict[str, bytes]] = field(default_factory=dict)

    @staticmethod
    def make(run_id: str, config: types_pb2.LoraConfig | None, with_optimizer: bool) -> dict[str, bytes]:
        rank = config.rank if config is not None and config.rank else 8
        adapter_config = json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": (config.alpha if config else 0) or 32.0,
                                     "base_model_name_or_path": MODEL, "fake_run": run_id}).encode()
        out = {"adapter_config.json": adapter_config, "adapter_model.safetensors": bytes(64 * rank)}
        if with_optimizer:
            out["optimizer.pt"] = bytes(128 * rank)
        return out


class FakeTrainer(trainer_pb2_grpc.TrainerServicer):
    """One fake trainer: adapters by run id, cycles answered after a sleep proportional to tokens."""

    def __init__(self, index: int, seconds_per_1k_tokens: float, checkpoints: CheckpointFiles):
        self.index = index
        self.rate = seconds_per_1k_tokens / 1000.0
        self.checkpoints = checkpoints
        self.adapters: dict[str, types_pb2.LoraConfig] = {}
        self.applied: dict[str, int] = {}  # run id -> highest seq applied (what a snapshot records)
        self.steps: dict[str, int] = {}
        self.cycles = 0
        self.tokens = 0
        self.busy_seconds = 0.0
        self._compute = asyncio.Lock()  # one cycle at a time, as the trainer's compute thread
        self._outputs: dict[int, types_pb2.LossFnOutput] = {}  # per datum length: the same answer every time

    async def GetModelInfo(self, request, context):
        return trainer_pb2.ModelInfo(base_model=MODEL, tokenizer_id="", vocab_size=VOCAB_SIZE, max_context_length=MAX_CONTEXT,
                                     device="fake", dtype="none")

    async def CreateAdapter(self, request, context):
        self.adapters[request.training_run_id] = request.lora_config
        return trainer_pb2.CreateAdapterResponse()

    async def DropAdapter(self, request, context):
        self.adapters.pop(request.training_run_id, None)
        return trainer_pb2.DropAdapterResponse()

    def _loss_output(self, n: int) -> types_pb2.LossFnOutput:
        out = self._outputs.get(n)
        if out is None:
            logprobs = np.full(n, -1.0, np.float32)
            out = types_pb2.LossFnOutput(fields={"logprobs": encode_array(logprobs, "float32"),
                                                 "elementwise_loss": encode_array(-logprobs, "float32")})
            self._outputs[n] = out
        return out

    async def RunCycle(self, request, context):
        async with self._compute:
            start = time.monotonic()
            self.cycles += 1
            tokens = sum(datum_tokens(d) for item in request.forward_backward for d in item.data)
            sleep = tokens * self.rate
            if sleep > 0:
                await asyncio.sleep(sleep)
            end = time.monotonic()
            self.tokens += tokens
            self.busy_seconds += end - start
        bench = {M_TRAINER: float(self.index), M_CYCLE: float(self.cycles), M_START: start, M_END: end,
                 M_TOKENS: float(tokens), M_SLEEP: sleep}
        response = trainer_pb2.CycleResponse()
        statuses = _has_field(response, "forward_backward_status")
        for item in request.forward_backward:
            out = response.forward_backward.add()
            if item.training_run_id not in self.adapters:
                if statuses:
                    response.forward_backward_status.add(code=NOT_FOUND, message=f"no adapter for run {item.training_run_id}")
                continue
            out.loss_fn_output_type = "ArrayRecord"
            lengths = [datum_tokens(d) for d in item.data]
            for n in lengths:
                out.loss_fn_outputs.append(self._loss_output(n))
            out.metrics.update({"loss:sum": float(sum(lengths)), **bench})
            self._applied(item.training_run_id, item.seq_id)
            if statuses:
                response.forward_backward_status.add()
        for item in request.optim_step:
            out = response.optim_step.add()
            if item.training_run_id not in self.adapters:
                if statuses:
                    response.optim_step_status.add(code=NOT_FOUND, message=f"no adapter for run {item.training_run_id}")
                continue
            out.metrics.update(bench)
            self._applied(item.training_run_id, item.seq_id)
            self.steps[item.training_run_id] = self.steps.get(item.training_run_id, 0) + 1
            if statuses:
                response.optim_step_status.add()
        return response

    def _applied(self, run_id: str, seq: int) -> None:
        self.applied[run_id] = max(self.applied.get(run_id, 0), seq)

    async def SnapshotAdapter(self, request, context):
        run_id = request.training_run_id
        if run_id not in self.adapters:
            raise NotFound(f"no adapter for run {run_id}")
        if request.checkpoint_key in self.checkpoints.files:
            raise AlreadyExists(f"checkpoint {request.checkpoint_key} exists")
        files = CheckpointFiles.make(run_id, self.adapters[run_id], True)
        files["snapshot.json"] = json.dumps({"run": run_id, "applied": self.applied.get(run_id, 0),
                                             "steps": self.steps.get(run_id, 0),
                                             "rank": self.adapters[run_id].rank}).encode()
        self.checkpoints.files[request.checkpoint_key] = files
        return trainer_pb2.SnapshotAdapterResponse(size_bytes=sum(len(b) for b in files.values()),
                                                   applied_seq_id=self.applied.get(run_id, 0), steps=self.steps.get(run_id, 0))

    async def RestoreAdapter(self, request, context):
        files = self.checkpoints.files.get(request.checkpoint_key)
        if files is None or "snapshot.json" not in files:
            raise FailedPrecondition(f"no snapshot {request.checkpoint_key}")
        meta = json.loads(files["snapshot.json"])
        if meta["run"] != request.training_run_id:
            raise FailedPrecondition(f"snapshot {request.checkpoint_key} is of run {meta['run']}")
        run_id = request.training_run_id
        self.adapters[run_id] = types_pb2.LoraConfig(rank=meta["rank"])
        self.applied[run_id], self.steps[run_id] = meta["applied"], meta["steps"]
        return trainer_pb2.RestoreAdapterResponse(applied_seq_id=meta["applied"], steps=meta["steps"])

    async def SaveAdapter(self, request, context):
        if request.training_run_id not in self.adapters:
            raise NotFound(f"no adapter for run {request.training_run_id}")
        if request.checkpoint_key in self.checkpoints.files:
            raise AlreadyExists(f"checkpoint {request.checkpoint_key} exists")
        files = CheckpointFiles.make(request.training_run_id, self.adapters[request.training_run_id], request.include_optimizer)
        if not request.measure_only:  # measuring writes nothing
            self.checkpoints.files[request.checkpoint_key] = files
        return trainer_pb2.SaveAdapterResponse(size_bytes=sum(len(b) for b in files.values()))

    async def LoadAdapter(self, request, context):
        if request.checkpoint_key not in self.checkpoints.files:
            raise NotFound(f"no checkpoint {request.checkpoint_key}")
        self.adapters.setdefault(request.training_run_id, types_pb2.LoraConfig(rank=8))
        return trainer_pb2.LoadAdapterResponse()

    async def ReadCheckpoint(self, request, context):
        files = self.checkpoints.files.get(request.checkpoint_key)
        if files is None:
            raise NotFound(f"no checkpoint {request.checkpoint_key}")
        for name, data in files.items():
            if request.weights_only and name not in ("adapter_config.json", "adapter_model.safetensors"):
                continue
            yield types_pb2.FileChunk(relative_path=name, offset=0, data=data, total_size=len(data))

    async def DeleteCheckpoint(self, request, context):
        files = self.checkpoints.files.pop(request.checkpoint_key, None)
        return trainer_pb2.DeleteCheckpointFilesResponse(freed_bytes=sum(len(b) for b in (files or {}).values()))


class FakeSampler(sampler_pb2_grpc.SamplerServicer):
    """A sampler without a model: adapters kept as pushed bytes, samples of token 0 after a sleep."""

    def __init__(self, seconds_per_1k_tokens: float):
        self.rate = seconds_per_1k_tokens / 1000.0
        self.adapters: dict[str, bytes] = {}
        self.incarnation = secrets.token_hex(8)

    async def GetModelInfo(self, request, context):
        info = sampler_pb2.SamplerModelInfo(base_model=MODEL, tokenizer_id="", vocab_size=VOCAB_SIZE,
                                            max_context_length=MAX_CONTEXT, backend="fake", loaded_adapters=sorted(self.adapters))
        if _has_field(info, "incarnation"):
            info.incarnation = self.incarnation
        return info

    async def PushAdapter(self, request_iterator, context):
        key, data = "", b""
        async for chunk in request_iterator:
            if chunk.HasField("file"):
                data += chunk.file.data
            else:
                key = chunk.checkpoint_key
        self.adapters[key] = data
        return sampler_pb2.PushAdapterResponse(bytes_received=len(data))

    async def DropAdapter(self, request, context):
        self.adapters.pop(request.checkpoint_key, None)
        return sampler_pb2.SamplerDropAdapterResponse()

    def _check(self, key: str) -> None:
        if key and key not in self.adapters:
            raise AdapterNotLoaded(key)

    async def Sample(self, request, context):
        self._check(request.checkpoint_key)
        prompt = len(request.prompt_tokens) // 4
        samples, length = max(1, request.num_samples), max(1, request.sampling_params.max_tokens)
        await asyncio.sleep((prompt + samples * length) * self.rate)
        sequence = types_pb2.SampledSequence(stop_reason=types_pb2.STOP_REASON_LENGTH, tokens=bytes(4 * length),
                                             logprobs=np.full(length, -1.0, "<f4").tobytes())
        response = types_pb2.SampleResponse(sequences=[sequence] * samples)
        if request.include_prompt_logprobs:
            response.prompt_logprobs.CopyFrom(self._prompt_logprobs(prompt))
        return response

    async def ComputeLogprobs(self, request, context):
        self._check(request.checkpoint_key)
        prompt = len(request.prompt_tokens) // 4
        await asyncio.sleep(prompt * self.rate)
        return sampler_pb2.ComputeLogprobsResponseInternal(logprobs=self._prompt_logprobs(prompt))

    @staticmethod
    def _prompt_logprobs(n: int) -> types_pb2.Tensor:
        values = np.full(n, -1.0, np.float32)
        if n:
            values[0] = np.nan
        return encode_array(values, "float32")


@dataclass
class FakeWorkers:
    trainers: list[FakeTrainer]
    samplers: list[FakeSampler]
    trainer_addresses: list[str]
    sampler_addresses: list[str]


@asynccontextmanager
async def serve_fake_workers(trainers: int, samplers: int, seconds_per_1k_tokens: float, token: str | None,
                             host: str = "127.0.0.1"):
    """Start the fake workers on free ports of ``host``, SERVING; with ``token``, every call but health
    and reflection must carry it (``authorization: Bearer <token>``, as the scheduler sends it)."""
    authenticate = token_authenticator(token) if token else None
    checkpoints = CheckpointFiles()
    fakes = FakeWorkers([FakeTrainer(i, seconds_per_1k_tokens, checkpoints) for i in range(trainers)],
                        [FakeSampler(seconds_per_1k_tokens) for _ in range(samplers)], [], [])
    servers = []
    try:
        for servicers, add, name, addresses in (
                (fakes.trainers, trainer_pb2_grpc.add_TrainerServicer_to_server, TRAINER, fakes.trainer_addresses),
                (fakes.samplers, sampler_pb2_grpc.add_SamplerServicer_to_server, SAMPLER, fakes.sampler_addresses)):
            for servicer in servicers:
                server, port, health = build_server([(add, servicer, name)], f"{host}:0", authenticate)
                await server.start()
                await mark_serving(health, [name])
                servers.append(server)
                addresses.append(f"{host}:{port}")
        yield fakes
    finally:
        await asyncio.gather(*(server.stop(grace=None) for server in servers))


async def _serve(args: argparse.Namespace) -> None:
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and not args.no_auth:
        sys.exit(f"set {TOKEN_ENV} to the scheduler's TEMPER_SCHEDULER_INTERNAL_TOKEN (or pass --no-auth)")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with serve_fake_workers(args.trainers, args.samplers, args.seconds_per_1k_tokens, token, args.host) as fakes:
        print(f"TEMPER_READY fake_workers trainers={','.join(fakes.trainer_addresses)} "
              f"samplers={','.join(fakes.sampler_addresses)} pid={os.getpid()}", flush=True)
        await stop.wait()
        print("fake workers: " + json.dumps({f"trainer-{t.index}": {"cycles": t.cycles, "tokens": t.tokens,
                                                                   "busy_seconds": round(t.busy_seconds, 3),
                                                                   "adapters": len(t.adapters)} for t in fakes.trainers}),
              flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=1)
    parser.add_argument("--samplers", type=int, default=1)
    parser.add_argument("--seconds-per-1k-tokens", type=float, default=0.05,
                        help="the sleep that stands in for compute, per 1000 tokens of a cycle or a sample")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--no-auth", action="store_true", help=f"serve without the internal token ({TOKEN_ENV} unset)")
    asyncio.run(_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
