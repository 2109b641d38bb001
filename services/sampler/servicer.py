"""gRPC face of the sampler: checkpoints' adapters arrive as streams of file chunks; requests are
decoded by ``convert`` and sampled on one compute thread, batched with whatever else is waiting.

At most ``max_adapters`` adapters (and ``max_adapter_bytes`` of pushed files, when set) stay loaded;
a push evicts the least recently used ones that no request is using (``residency.py``). A request
for an adapter that is not here answers AdapterNotLoaded (FAILED_PRECONDITION, details starting
"ADAPTER_NOT_LOADED: "): the scheduler pushes it again and retries.

Pushed adapters are installed on the compute thread, between two decode steps when a batch is decoding
(``installs.py``). In-flight weights (docs/async_rl.md, ``inflight.py``): ``SetInflightTarget`` records a
run's newest version; requests that follow the run start on it and move to newer ones between decode
steps (unless pinned); every sequence reports its tokens' versions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from temper.common.checkpoints import WEIGHT_FILES
from temper.common.errors import AdapterNotLoaded, FailedPrecondition, InvalidArgument, ResourceExhausted
from temper.services.models.images import DEFAULT_LIMITS, ImageLimits
from temper.services.sampler import convert, metrics
from temper.services.sampler.backend import (SampleRequest, SampleResult, SamplerBackend, VersionSpan, WeightsVersion,
                                             fill_versions)
from temper.services.sampler.inflight import Follower, InflightTargets, check_target
from temper.services.sampler.installs import Busy, Job, PendingInstalls
from temper.services.sampler.residency import Residency
from temper.v1 import sampler_pb2, sampler_pb2_grpc

log = logging.getLogger(__name__)


class SamplerServicer(sampler_pb2_grpc.SamplerServicer):
    def __init__(self, backend: SamplerBackend, adapter_dir: Path, max_num_samples: int, max_batch_sequences: int = 64,
                 max_adapters: int = 16, max_adapter_bytes: int = 0, image_limits: ImageLimits = DEFAULT_LIMITS):
        self.backend = backend
        self.image_limits = image_limits  # what one image of a prompt may be (images.flatten checks it)
        # new per process start: the scheduler learns from it that the adapters it pushed before are gone
        self.incarnation = secrets.token_hex(8)
        self.residency = Residency(max_adapters, max_adapter_bytes)
        for key in backend.describe().loaded_checkpoints:  # loaded before this servicer (tests); 0 bytes
            self.residency.adopt(key)
        self._unpin_waiters: dict[str, list[asyncio.Future]] = {}
        self._drops: dict[str, asyncio.Task] = {}
        self.max_batch_sequences = max_batch_sequences
        self._pending: list[tuple[SampleRequest, asyncio.Future]] = []
        self._batcher: asyncio.Task | None = None
        self.adapter_dir = Path(adapter_dir)
        self.adapter_dir.mkdir(parents=True, exist_ok=True)
        self.max_num_samples = max_num_samples
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler-compute")
        self.inflight = InflightTargets()
        self._installs = PendingInstalls(self._install_one)
        self._install_runs: set[asyncio.Task] = set()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def GetModelInfo(self, request, context):
        return convert.model_info_to_pb(self.backend.describe(), self.backend.name, self.incarnation)

    async def PushAdapter(self, request_iterator, context):
        staging = Path(tempfile.mkdtemp(dir=self.adapter_dir, prefix=".push-"))
        checkpoint_key, received, handles, job = None, 0, {}, None
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
            # the staged files are the job's now (removed once it ran); a batch that is decoding runs it
            # between two steps, else the compute thread does when it is free (whichever comes first)
            job = self._installs.submit(checkpoint_key, staging, received)
            run = asyncio.create_task(self._run(self._install))
            self._install_runs.add(run)
            run.add_done_callback(self._install_runs.discard)
            await asyncio.wrap_future(job.done)
        finally:
            for fh in handles.values():
                fh.close()
            if job is None:  # refused before it was queued
                shutil.rmtree(staging, ignore_errors=True)
            self._count_adapters()
        return sampler_pb2.PushAdapterResponse(bytes_received=received)

    def _install(self) -> None:
        """On the compute thread, between batches: every queued install."""
        self._installs.run()

    def _install_one(self, job: Job, busy: frozenset | None) -> None:
        """On the compute thread (so loads never interleave with a forward): check, make room, then load.
        An adapter the backend refuses evicts nothing. ``busy``: between two decode steps, the adapters
        the batch decodes with, which this install may neither replace nor evict (Busy: after the batch)."""
        key = job.key
        if busy is not None and key in busy:
            raise Busy(key)
        if not job.checked:
            self.backend.check_adapter(job.folder)
            job.checked = True
        try:
            victims = self.residency.reserve(key, job.size, keep=busy or frozenset())
        except ResourceExhausted:
            if busy is not None:  # the batch's adapters may be the room it needs
                raise Busy(key) from None
            raise
        for victim in victims:
            with contextlib.suppress(AdapterNotLoaded):
                self.backend.drop_adapter(victim)
            metrics.EVICTIONS.inc()
            log.info("evicted adapter %s (least recently used) to load %s", victim, key)
        try:
            self.backend.load_adapter(key, job.folder)
        except BaseException:
            self.residency.forget(key)  # a failed push leaves the key not loaded (a replaced one too)
            with contextlib.suppress(AdapterNotLoaded):
                self.backend.drop_adapter(key)
            raise
        self.residency.loaded(key)

    async def DropAdapter(self, request, context):
        """Once the requests already using it are done (new ones get AdapterNotLoaded meanwhile)."""
        key = request.checkpoint_key
        self.residency.retire(key)
        task = self._drops.get(key)
        if task is None or task.done():
            task = self._drops[key] = asyncio.create_task(self._drop_when_unused(key))
        await asyncio.shield(task)  # a caller that gives up does not leave the adapter half-dropped
        return sampler_pb2.SamplerDropAdapterResponse()

    async def _drop_when_unused(self, key: str) -> None:
        try:
            while self.residency.pins(key) > 0:
                waiter = asyncio.get_running_loop().create_future()
                self._unpin_waiters.setdefault(key, []).append(waiter)
                await waiter
            await self._run(self._remove, key)
        finally:
            if self._drops.get(key) is asyncio.current_task():
                del self._drops[key]
            self._count_adapters()

    def _remove(self, key: str) -> None:
        self.residency.forget(key)
        with contextlib.suppress(AdapterNotLoaded):
            self.backend.drop_adapter(key)

    @contextlib.contextmanager
    def _pinned(self, key: str | None):
        """Keep ``key``'s adapter loaded while a request uses it; AdapterNotLoaded if it is not here."""
        pin = self.residency.use(key) if key else None
        try:
            yield
        finally:
            if pin is not None:
                self._release(key, pin)

    def _release(self, key: str, pin) -> None:
        if self.residency.release(pin) == 0:
            for waiter in self._unpin_waiters.pop(key, ()):
                if not waiter.done():
                    waiter.set_result(None)

    @contextlib.contextmanager
    def _using(self, sample: SampleRequest, run: str, pin_version: bool):
        """Pin the adapter ``sample`` starts on while it is queued and decoding. An in-flight request
        (``run`` set) starts on the run's newest version held here when it names an older one (if that
        adapter is usable here), advances the run's target when it names a newer one, and, unless
        ``pin_version``, follows the target between decode steps (each adapter it moves to is pinned
        too, until it ends)."""
        held = self.inflight.get(run) if run else None
        pin = None
        if held is not None and held.weights.version > sample.weights.version:
            with contextlib.suppress(AdapterNotLoaded):  # its newer adapter went: start on the one named
                pin = self.residency.use(held.checkpoint_key)
                sample.checkpoint_key, sample.weights = held.checkpoint_key, held.weights
        if pin is None and sample.checkpoint_key:
            pin = self.residency.use(sample.checkpoint_key)
        follower = Follower(self.inflight, run, self.residency.use) if run and not pin_version else None
        sample.retarget = follower
        sample.between_steps = self._installs.run
        try:
            if run:  # (convert checked its fields)
                self.inflight.advance(run, sample.checkpoint_key, sample.weights)
            yield
        finally:
            if pin is not None:
                self._release(sample.checkpoint_key, pin)
            for key, extra in follower.close() if follower is not None else ():
                self._release(key, extra)

    def _count_adapters(self) -> None:
        metrics.RESIDENT_ADAPTERS.set(len(self.backend.describe().loaded_checkpoints))
        metrics.RESIDENT_ADAPTER_BYTES.set(self.residency.total_bytes)

    def _decoded_sample(self, request) -> SampleRequest:
        description = self.backend.describe()
        sample = convert.sample_request_from_pb(request, description.vocab_size, self.max_num_samples,
                                                description.vision, self.image_limits, description.base_model)
        if sample.deterministic:
            self._check_deterministic(description, "sampling")
        return sample

    @staticmethod
    def _check_deterministic(description, what: str) -> None:
        """A deterministic request this sampler cannot serve is refused, never answered approximately."""
        if description.deterministic_unsupported:
            raise FailedPrecondition(f"deterministic {what}: {description.deterministic_unsupported}")

    async def Sample(self, request, context):
        start = time.perf_counter()
        sample = self._decoded_sample(request)
        with self._using(sample, request.inflight_run, request.pin_version):
            result = fill_versions(await self._submit(sample), sample.weights)
        metrics.SAMPLE_SECONDS.observe(time.perf_counter() - start)
        return convert.sample_result_to_pb(result, request.topk_logprobs)

    async def SampleStream(self, request, context):
        """Sample, batched the same way, with each decode step's pieces sent as they come (backend.py)."""
        start = time.perf_counter()
        sample = self._decoded_sample(request)
        stream = _Stream(asyncio.get_running_loop())
        sample.progress = stream
        with self._using(sample, request.inflight_run, request.pin_version):
            stream.weights = sample.weights
            future = self._enqueue(sample)
            future.add_done_callback(lambda _: stream.queue.put_nowait(None))
            try:
                # the pieces reach this loop before the answer does (both by call_soon_threadsafe, in order)
                while (pieces := await stream.queue.get()) is not None:
                    yield convert.pieces_to_pb(pieces, request.topk_logprobs)
                result = future.result()
            finally:
                future.cancel()  # a caller gone before its batch began: never decoded (_drain skips it)
        metrics.SAMPLE_SECONDS.observe(time.perf_counter() - start)
        yield convert.stream_end_to_pb(result)

    async def SetInflightTarget(self, request, context):
        """Hold the run's newest version (docs/async_rl.md): its adapter must be loaded here; an older
        version than the one held changes nothing. Answers the version held now."""
        run, key = request.training_run_id, request.checkpoint_key
        weights = WeightsVersion(request.weights.path, request.weights.version)
        check_target(run, key, weights)
        if not self.residency.usable(key):
            raise AdapterNotLoaded(key)
        held = self.inflight.advance(run, key, weights)
        return sampler_pb2.SetInflightTargetResponse(version=held.weights.version)

    async def _submit(self, request: SampleRequest) -> SampleResult:
        return await self._enqueue(request)

    def _enqueue(self, request: SampleRequest) -> asyncio.Future:
        """Queue a request; requests that arrive while a batch decodes go together into the next."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._drain())
        return future

    async def _drain(self) -> None:
        while self._pending:
            batch, rows = [], 0
            while self._pending and (not batch or rows + self._pending[0][0].num_samples <= self.max_batch_sequences):
                item = self._pending.pop(0)
                if item[1].done():  # its caller gave up (and its adapter may be gone)
                    continue
                batch.append(item)
                rows += item[0].num_samples
            if not batch:
                continue
            try:
                results = await self._sample([r for r, _ in batch])
            except Exception as exc:  # noqa: BLE001 - retry alone so one bad request fails only itself
                results, failure = None, exc
            for k, (request, future) in enumerate(batch):
                if future.done():
                    continue
                if results is not None:
                    future.set_result(results[k])
                    continue
                if isinstance(request.progress, _Stream) and request.progress.sent:
                    future.set_exception(failure)  # its caller has pieces of this attempt: never a second one
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

    async def ComputeLogprobs(self, request, context):
        description = self.backend.describe()
        checkpoint_key, prompt, last_n, deterministic, images = convert.logprobs_request_from_pb(
            request, description.vision, self.image_limits, description.base_model)
        if deterministic:
            self._check_deterministic(description, "prompt scoring")
        with self._pinned(checkpoint_key):
            return convert.logprobs_to_pb(await self._run(self.backend.compute_logprobs, checkpoint_key, prompt, last_n,
                                                          deterministic, images))


class _Stream:
    """A streamed request's progress: the backend's pieces, handed from the compute thread to the
    request's own loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sent = False
        self.weights = WeightsVersion()   # the version the request starts on: pieces without spans are on it
        self._told: dict[int, int] = {}   # tokens sent so far per sequence

    def __call__(self, pieces) -> None:
        self.sent = True
        for p in pieces:
            told = self._told.get(p.sequence, 0)
            if not p.versions and p.tokens:
                p.versions = [VersionSpan(self.weights, told, len(p.tokens))]
            self._told[p.sequence] = told + len(p.tokens)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, pieces)
