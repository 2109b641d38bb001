"""ServiceClient: the entry point. Opens a session on the scheduler, keeps it alive with
heartbeats, and creates training and sampling clients."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from temper.client import convert
from temper.client import types as t
from temper.client.runtime import Runtime, resolve_target
from temper.client.sampling_client import SamplingClient
from temper.client.training_client import TrainingClient
from temper.v1 import service_pb2

DEFAULT_BASE_URL = "127.0.0.1:50051"
HEARTBEAT_SECONDS = 10.0


class ServiceClient:
    def __init__(self, base_url: str | None = None, api_key: str | None = None, tags: list[str] | None = None,
                 user_metadata: dict[str, str] | None = None, timeout: float | None = None,
                 root_certificates: bytes | None = None):
        """``base_url``: ``host:port`` or ``grpc://host:port`` (plaintext), ``grpcs://host:port`` (TLS);
        TLS checks the server against ``root_certificates`` (PEM), else TEMPER_TLS_CA_FILE, else the
        system's roots (runtime.resolve_target). ``api_key``: else TEMPER_API_KEY, else TINKER_API_KEY."""
        target, credentials = resolve_target(base_url or os.environ.get("TEMPER_BASE_URL") or DEFAULT_BASE_URL, root_certificates)
        # The key says who you are (the server has no other notion of a tenant).
        api_key = api_key or os.environ.get("TEMPER_API_KEY") or os.environ.get("TINKER_API_KEY")
        metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
        self.runtime = Runtime(target, metadata, timeout=timeout, credentials=credentials)
        request = service_pb2.CreateSessionRequest(tags=tags or [], user_metadata=user_metadata or {})
        self.session_id = self.runtime.rpc("CreateSession", request).result().session_id
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="temper-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._closed.wait(HEARTBEAT_SECONDS):
            try:
                self.runtime.rpc("Heartbeat", service_pb2.HeartbeatRequest(session_id=self.session_id)).result()
            except Exception:  # noqa: BLE001 - a missed heartbeat is retried on the next tick
                pass

    # ---- factories ----------------------------------------------------------------------------

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None, train_mlp: bool = True, train_attn: bool = True,
        train_unembed: bool = True, alpha: float | None = None, dropout: float = 0.0, user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        lora = t.LoraConfig(rank=rank, alpha=alpha, seed=seed, train_attn=train_attn, train_mlp=train_mlp,
                            train_unembed=train_unembed, dropout=dropout)
        request = service_pb2.CreateTrainingRunRequest(
            session_id=self.session_id, base_model=base_model, lora_config=convert.lora_to_proto(lora), user_metadata=user_metadata or {}
        )
        return TrainingClient(self, self.runtime.rpc("CreateTrainingRun", request).result())

    def training_client(self, training_run_id: str) -> TrainingClient:
        """Reattach to an existing run (its next seq_id comes from the server)."""
        info = self.runtime.rpc("GetInfo", service_pb2.GetInfoRequest(training_run_id=training_run_id)).result()
        return TrainingClient(self, info)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> SamplingClient:
        if (model_path is None) == (base_model is None):
            raise ValueError("give exactly one of model_path or base_model")
        request = service_pb2.CreateSamplingClientRequest(session_id=self.session_id)
        if model_path is not None:
            request.model_path = model_path
        else:
            request.base_model = base_model
        return SamplingClient(self, self.runtime.rpc("CreateSamplingClient", request).result())

    # ---- queries ------------------------------------------------------------------------------

    def get_server_capabilities(self) -> t.GetServerCapabilitiesResponse:
        r = self.runtime.rpc("GetServerCapabilities", service_pb2.GetServerCapabilitiesRequest()).result()
        return t.GetServerCapabilitiesResponse([
            t.SupportedModel(m.model_name, m.max_context_length, m.trainable, m.sampleable) for m in r.supported_models
        ])

    def get_usage(self) -> dict:
        """This tenant's usage: tokens trained and sampled, optimizer steps, per run and in total."""
        r = self.runtime.rpc("GetUsage", service_pb2.GetUsageRequest()).result()
        return {
            "tenant": r.tenant, "weight": r.weight, "tokens_trained": r.tokens_trained, "tokens_sampled": r.tokens_sampled,
            "steps": r.steps, "runs": {u.training_run_id: {"tokens_trained": u.tokens_trained, "steps": u.steps} for u in r.runs},
            "samplers": {u.sampler_id: u.tokens_sampled for u in r.samplers}, "storage_bytes": r.storage_bytes,
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

    # ---- lifecycle ----------------------------------------------------------------------------

    def close(self, status: str = "success") -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.runtime.rpc("CloseSession", service_pb2.CloseSessionRequest(session_id=self.session_id, status=status)).result(timeout=10)
        finally:
            self.runtime.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("success" if exc_type is None else "errored")
