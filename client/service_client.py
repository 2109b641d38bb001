"""ServiceClient: the entry point. Opens a session on the scheduler, keeps it alive with
heartbeats, and creates training and sampling clients. Shaped as the Tinker SDK's: the creation
calls return a future of the client that also works as the client (futures.ClientFuture)."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any, Mapping

from temper.client import convert
from temper.client import types as t
from temper.client.errors import unsupported
from temper.client.futures import APIFuture, ClientFuture, completed
from temper.client.rest_client import RestClient
from temper.client.runtime import DEFAULT_BASE_URL, open_runtime  # noqa: F401  (DEFAULT_BASE_URL: public name)
from temper.client.sampling_client import SamplingClient
from temper.client.training_client import TrainingClient
from temper.common.checkpoints import WEIGHT_FILES
from temper.common.uploads import CHUNK_BYTES, file_chunks
from temper.v1 import service_pb2

HEARTBEAT_SECONDS = 10.0


class ServiceClient:
    def __init__(self, *args: Any, base_url: str | None = None, api_key: str | None = None,
                 user_metadata: dict[str, str] | None = None, project_id: str | None = None, tags: list[str] | None = None,
                 timeout: float | None = None, root_certificates: bytes | None = None, connect_timeout: float | None = None,
                 display_name: str | None = None, **kwargs: Any):
        """Positional arguments are Tinker's ``(user_metadata, project_id)`` or Temper's ``(base_url, api_key)``.

        ``base_url``: ``host:port`` or ``grpc://host:port`` (plaintext), ``grpcs://host:port`` (TLS); several
        replicas as ``host1:port1,host2:port2`` or ``dns:///name:port`` (round_robin); else TEMPER_BASE_URL, TEMPER_ADDRESS, or a gRPC TINKER_BASE_URL (runtime.resolve_base_url); TLS checks
        the server against ``root_certificates`` (PEM), else TEMPER_TLS_CA_FILE, else the system's roots.
        ``api_key``: else TEMPER_API_KEY, else TINKER_API_KEY. ``connect_timeout``: seconds to reach the
        scheduler before failing (else TEMPER_CONNECT_TIMEOUT, else 30). ``project_id`` (else
        TINKER_PROJECT_ID): one of the caller's projects (NotFound otherwise; docs/tenancy.md); ``display_name``:
        the session's name in lists, searches and the console."""
        if args and isinstance(args[0], str):
            base_url, api_key = (list(args) + [api_key])[:2] if base_url is None else (base_url, api_key)
        elif args:
            user_metadata, project_id = (list(args) + [project_id])[:2]
        if kwargs:
            warnings.warn(f"ServiceClient ignores unsupported arguments: {', '.join(sorted(kwargs))}", FutureWarning, stacklevel=2)
        project_id = project_id or os.environ.get("TINKER_PROJECT_ID") or None
        self.runtime = open_runtime(base_url, api_key, timeout, root_certificates, connect_timeout)
        request = service_pb2.CreateSessionRequest(tags=list(tags or []), user_metadata=dict(user_metadata or {}),
                                                   display_name=display_name or "", project_id=project_id or "")
        try:
            self.session_id = self.runtime.rpc("CreateSession", request).result().session_id
        except BaseException:
            self.runtime.close()
            raise
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="temper-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._closed.wait(HEARTBEAT_SECONDS):
            try:
                self.runtime.rpc("Heartbeat", service_pb2.HeartbeatRequest(session_id=self.session_id)).result()
            except Exception:  # noqa: BLE001 - a missed heartbeat is retried on the next tick
                pass

    # ---- factories: each returns a future of the client, usable as the client -----------------

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None, train_mlp: bool = True, train_attn: bool = True,
        train_unembed: bool = True, user_metadata: dict[str, str] | None = None, optimizer: Any = None, *,
        alpha: float | None = None, dropout: float = 0.0, expert_rank: int = 0, deterministic: bool | None = None,
    ) -> ClientFuture[TrainingClient]:
        """``optimizer``: None or AdamW (Tinker's AdamOptimizerConfig); Temper has no other. ``expert_rank``
        (mixture-of-experts models, with train_mlp): each routed expert's LoRA rank, in [0, rank]; 0: the
        server's default, rank // num_experts_per_tok. The run's info (get_info) shows the rank in effect.
        ``deterministic`` (docs/deterministic.md): the run's numbers do not depend on who shares its passes,
        and its checkpoints sample with the trainer's logprobs bit for bit; None: the server's default."""
        _check_optimizer(optimizer)
        lora = t.LoraConfig(rank=rank, alpha=alpha, seed=seed, train_attn=train_attn, train_mlp=train_mlp,
                            train_unembed=train_unembed, dropout=dropout, expert_rank=expert_rank)
        request = service_pb2.CreateTrainingRunRequest(
            session_id=self.session_id, base_model=base_model, lora_config=convert.lora_to_proto(lora), user_metadata=user_metadata or {}
        )
        if deterministic is not None:
            request.deterministic = deterministic

        async def create() -> TrainingClient:
            return TrainingClient(self, await self.runtime._call("CreateTrainingRun", request))

        return ClientFuture(self.runtime.call_soon(create()))

    async def create_lora_training_client_async(self, *args: Any, **kwargs: Any) -> TrainingClient:
        return await self.create_lora_training_client(*args, **kwargs)

    def create_training_client_from_state(self, path: str, base_model: str | None = None, user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None, optimizer: Any = None) -> ClientFuture[TrainingClient]:
        """A new run with the LoRA config of the checkpoint's run, its weights loaded (a fresh optimizer)."""
        _check_optimizer(optimizer)
        return self._from_state(path, base_model, user_metadata, with_optimizer=False)

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: dict[str, str] | None = None,
                                                         weights_access_token: str | None = None) -> ClientFuture[TrainingClient]:
        """As create_training_client_from_state, with the checkpoint's optimizer state too (exact resume)."""
        return self._from_state(path, base_model, user_metadata, with_optimizer=True)

    async def create_training_client_from_state_async(self, *args: Any, **kwargs: Any) -> TrainingClient:
        return await self.create_training_client_from_state(*args, **kwargs)

    async def create_training_client_from_state_with_optimizer_async(self, *args: Any, **kwargs: Any) -> TrainingClient:
        return await self.create_training_client_from_state_with_optimizer(*args, **kwargs)

    def _from_state(self, path: str, base_model: str | None, user_metadata: dict[str, str] | None,
                    with_optimizer: bool) -> ClientFuture[TrainingClient]:
        t.ParsedCheckpointTinkerPath.from_tinker_path(path)  # a malformed path fails here
        # One call: the run takes the checkpoint's LoRA config and base model (yours, or published by
        # another tenant) and the weights are loaded as part of creation; its first request is seq 1.
        request = service_pb2.CreateTrainingRunRequest(session_id=self.session_id, base_model=base_model or "", from_path=path,
                                                       with_optimizer=with_optimizer, user_metadata=user_metadata or {})

        async def create() -> TrainingClient:
            return TrainingClient(self, await self.runtime._call("CreateTrainingRun", request))

        return ClientFuture(self.runtime.call_soon(create()))

    def training_client(self, training_run_id: str) -> TrainingClient:
        """Reattach to an existing run (its next seq_id comes from the server)."""
        info = self.runtime.rpc("GetInfo", service_pb2.GetInfoRequest(training_run_id=training_run_id)).result()
        return TrainingClient(self, info)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None, retry_config: Any = None,
                               record_stability_info: bool = False, *, deterministic: bool | None = None) -> ClientFuture[SamplingClient]:
        """``deterministic``: sampled and prompt logprobs equal the trainer's forward bit for bit
        (docs/deterministic.md); a deterministic run's checkpoints are always sampled so; None: the
        server's default for the base model."""
        if (model_path is None) == (base_model is None):
            raise ValueError("give exactly one of model_path or base_model")
        self._check_sampling_options(record_stability_info)
        return ClientFuture(self.runtime.call_soon(self._new_sampling_client(model_path, base_model, deterministic)))

    async def create_sampling_client_async(self, *args: Any, **kwargs: Any) -> SamplingClient:
        return await self.create_sampling_client(*args, **kwargs)

    async def _new_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                                   deterministic: bool | None = None, inflight_training_run_id: str | None = None) -> SamplingClient:
        request = service_pb2.CreateSamplingClientRequest(session_id=self.session_id)
        if deterministic is not None:
            request.deterministic = deterministic
        if inflight_training_run_id is not None:
            request.inflight_training_run_id = inflight_training_run_id
        elif model_path is not None:
            request.model_path = model_path
        else:
            request.base_model = base_model
        return SamplingClient(self, await self.runtime._call("CreateSamplingClient", request))

    @staticmethod
    def _check_sampling_options(record_stability_info: bool) -> None:
        """Tinker's ``record_stability_info`` is accepted: every sampled sequence carries a stable
        ``sequence_id`` whether or not it is set."""

    def create_rest_client(self) -> RestClient:
        """Training runs and checkpoints, with the Tinker RestClient's method names (on this connection)."""
        return RestClient(self.runtime)

    # ---- queries ------------------------------------------------------------------------------

    def get_server_capabilities(self) -> t.GetServerCapabilitiesResponse:
        return self.create_rest_client().get_server_capabilities().result()

    async def get_server_capabilities_async(self) -> t.GetServerCapabilitiesResponse:
        return await self.create_rest_client().get_server_capabilities()

    def get_usage(self) -> dict:
        """This tenant's usage: tokens trained and sampled, optimizer steps, per run and in total."""
        r = self.runtime.rpc("GetUsage", service_pb2.GetUsageRequest()).result()
        return {
            "tenant": r.tenant, "weight": r.weight, "tokens_trained": r.tokens_trained, "tokens_sampled": r.tokens_sampled,
            "steps": r.steps, "runs": {u.training_run_id: {"tokens_trained": u.tokens_trained, "steps": u.steps} for u in r.runs},
            "samplers": {u.sampler_id: u.tokens_sampled for u in r.samplers}, "storage_bytes": r.storage_bytes,
            "image_bytes": r.image_bytes,
            "limits": {u.name: {"limit": u.limit, "used": u.used, "wait_seconds": u.wait_seconds} for u in r.limits},
        }

    def list_checkpoints(self, training_run_id: str | None = None) -> list[t.Checkpoint]:
        """A run's checkpoints, or (no run given) every checkpoint of yours."""
        r = self.runtime.rpc("ListCheckpoints", service_pb2.ListCheckpointsRequest(training_run_id=training_run_id or "")).result()
        return [convert.checkpoint_from_proto(c) for c in r.checkpoints]

    def publish_checkpoint(self, path: str, published: bool = True) -> t.Checkpoint:
        """Make one of your checkpoints readable by other tenants (load, sample, download), or private again."""
        request = service_pb2.UpdateCheckpointRequest(path=path, published=published)
        return convert.checkpoint_from_proto(self.runtime.rpc("UpdateCheckpoint", request).result())

    def unpublish_checkpoint(self, path: str) -> t.Checkpoint:
        return self.publish_checkpoint(path, published=False)

    def set_checkpoint_ttl(self, path: str, ttl_seconds: int | None) -> t.Checkpoint:
        """Delete the checkpoint ``ttl_seconds`` from now (None: keep it until deleted)."""
        request = service_pb2.UpdateCheckpointRequest(path=path, ttl_seconds=ttl_seconds or 0)
        return convert.checkpoint_from_proto(self.runtime.rpc("UpdateCheckpoint", request).result())

    def delete_checkpoint(self, path: str) -> int:
        """Delete one of your checkpoints; returns the bytes freed."""
        return self.runtime.rpc("DeleteCheckpoint", service_pb2.DeleteCheckpointRequest(path=path)).result().freed_bytes

    def download_checkpoint(self, path: str, destination: str | os.PathLike) -> Path:
        """Stream a checkpoint's files into ``destination`` (a peft adapter folder)."""
        chunks = self.runtime.stream("DownloadCheckpoint", service_pb2.DownloadCheckpointRequest(path=path)).result()
        folder = Path(destination)
        folder.mkdir(parents=True, exist_ok=True)
        handles = {}
        try:
            for chunk in chunks:
                name = Path(chunk.relative_path).name  # never write outside the folder
                fh = handles.get(name) or handles.setdefault(name, open(folder / name, "wb"))
                fh.seek(chunk.offset)
                fh.write(chunk.data)
        finally:
            for fh in handles.values():
                fh.close()
        return folder

    def import_checkpoint(self, source: str | os.PathLike | Mapping[str, bytes], name: str, *, save_state: bool = False,
                          user_metadata: dict[str, str] | None = None) -> t.ImportCheckpointResponse:
        """Bring your own adapter: a peft LoRA folder (adapter_config.json, adapter_model.safetensors; or
        those names mapped to their bytes) trained elsewhere for a base model the server serves becomes
        a new training run of yours with the adapter's LoRA config, and its checkpoint
        ``tinker://<run>/sampler_weights/<name>`` (``.path``: create_sampling_client(model_path=...)).
        ``save_state``: also ``tinker://<run>/weights/<name>`` (``.state_path``: load_state,
        create_training_client_from_state; weights only, no optimizer state). The server checks the
        files as its own checkpoints (base model, plain LoRA on whole module groups, tensor names,
        shapes, finite values): a refused import (InvalidArgument) leaves nothing behind."""
        if isinstance(source, Mapping):
            files = {n: bytes(source[n]) for n in WEIGHT_FILES if n in source}
        else:
            files = {n: (Path(source) / n).read_bytes() for n in WEIGHT_FILES if (Path(source) / n).is_file()}
        header = service_pb2.ImportCheckpointHeader(session_id=self.session_id, name=name, save_state=save_state,
                                                    user_metadata=user_metadata or {})
        messages = [service_pb2.ImportCheckpointChunk(header=header),
                    *(service_pb2.ImportCheckpointChunk(file=chunk) for chunk in file_chunks(files))]
        r = self.runtime.upload("ImportCheckpoint", messages).result()
        state = convert.checkpoint_from_proto(r.state_checkpoint) if r.HasField("state_checkpoint") else None
        return t.ImportCheckpointResponse(path=r.checkpoint.path, training_run_id=r.training_run.training_run_id,
                                          state_path=state.tinker_path if state else None,
                                          checkpoint=convert.checkpoint_from_proto(r.checkpoint), state_checkpoint=state)

    # ---- images -------------------------------------------------------------------------------

    def upload_image(self, source: bytes | str | os.PathLike, format: str | None = None, *,
                     base_model: str | None = None) -> t.ImageAsset:
        """Upload a PNG or JPEG image (its bytes, or a file) for sampling prompts: ``.pointer()`` is the
        ImageAssetPointerChunk of it (location "temper-image://<sha256>"). Uploading the same bytes again
        is the same image (``created`` False). ``format``: "png" or "jpeg" (None: from the bytes).
        ``base_model``: also answer ``expected_tokens``, the image tokens that model makes of it. Counted
        in your storage (max_storage_bytes); only you can point to it."""
        data = bytes(source) if isinstance(source, (bytes, bytearray, memoryview)) else Path(source).read_bytes()
        header = service_pb2.UploadImageHeader(format=format or _image_format(data), base_model=base_model or "")
        messages = [service_pb2.UploadImageChunk(header=header),
                    *(service_pb2.UploadImageChunk(data=data[i: i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES))]
        return convert.image_asset_from_proto(self.runtime.upload("UploadImage", messages).result())

    def list_images(self, limit: int = 100, offset: int = 0) -> list[t.ImageAsset]:
        """Your uploaded images, newest first."""
        r = self.runtime.rpc("ListImages", service_pb2.ListImagesRequest(limit=limit, offset=offset)).result()
        return [convert.image_asset_from_proto(image) for image in r.images]

    def delete_image(self, location: str) -> int:
        """Delete one of your uploaded images; returns the bytes freed."""
        return self.runtime.rpc("DeleteImage", service_pb2.DeleteImageRequest(location=location)).result().freed_bytes

    # ---- lifecycle ----------------------------------------------------------------------------

    def close(self, status: str = "success", detail: str | None = None) -> APIFuture[None]:
        """Ends the session; returns a done future (Tinker's close returns one to wait on)."""
        if self._closed.is_set():
            return completed(None)
        self._closed.set()
        try:
            self.runtime.rpc("CloseSession", service_pb2.CloseSessionRequest(session_id=self.session_id, status=status)).result(timeout=10)
        finally:
            self.runtime.close()
        return completed(None)

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("success" if exc_type is None else "errored")


def _image_format(data: bytes) -> str:
    """png or jpeg by the file's first bytes (the server checks the whole file; no image library here)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    raise ValueError("upload_image: the bytes are neither PNG nor JPEG; give format= to have the server say why")


def _check_optimizer(optimizer: Any) -> None:
    kind = getattr(optimizer, "type", None) or (optimizer.get("type") if isinstance(optimizer, Mapping) else None)
    if optimizer is not None and kind not in ("adamw", None):
        raise unsupported(f"optimizer type {kind!r}", "Temper trains with AdamW")
