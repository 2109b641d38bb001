"""Settings fields every Temper process shares. Each process has one settings object, a subclass
of these read from environment variables under its own prefix (TEMPER_SCHEDULER_, TEMPER_TRAINER_,
TEMPER_SAMPLER_)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
LogFormat = Literal["text", "json"]


class ImageSettings(BaseModel):
    """What one image of a request may be (services/models/images.py checks them). Every process that
    reads images has these: the scheduler and the gateway refuse early, the trainer and sampler again."""

    image_max_bytes: int = Field(10 << 20, gt=0, description="Bytes of one image file (PNG or JPEG); larger: RESOURCE_EXHAUSTED.")
    image_max_pixels: int = Field(4096 * 4096, gt=0, description="Pixels (width x height) of one image; more: RESOURCE_EXHAUSTED.")
    image_max_side: int = Field(8192, gt=0, description="Pixels of an image's longer side; more: RESOURCE_EXHAUSTED.")
    image_max_images: int = Field(64, gt=0, description="Images in one model input; more: RESOURCE_EXHAUSTED.")

    def image_limits(self):
        """These settings as ``services.models.images.ImageLimits`` (imported here: settings load without Pillow)."""
        from temper.services.models.images import ImageLimits

        return ImageLimits(max_bytes=self.image_max_bytes, max_pixels=self.image_max_pixels, max_side=self.image_max_side,
                           max_images=self.image_max_images)


class ProcessSettings(BaseSettings, ImageSettings):
    """What any Temper server process has: where it listens, how it logs, where its metrics are, and
    the image limits (every Temper process reads images: the scheduler, trainer, sampler and gateway)."""

    bind: str = Field("127.0.0.1:0", description="host:port of the gRPC server (port 0 picks a free one).")
    metrics_bind: str = Field(
        "", description="host:port of the Prometheus /metrics HTTP endpoint (port 0 picks a free one); empty: no endpoint.")
    log_level: LogLevel = Field("INFO", description="Python logging level.")
    log_format: LogFormat = Field("text", description="text: one human-readable line per record; json: one JSON object per line.")
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate chain of the gRPC server; with tls_key_file the port serves TLS only (common/tls.py).")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_client_ca_file: Path | None = Field(
        None, description="PEM CA bundle; set, every client must present a certificate it signed (mutual TLS).")

    @model_validator(mode="after")
    def _tls_pair(self):
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file are set together (or neither)")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file (mutual TLS is TLS)")
        return self


class InternalTokenSettings(BaseModel):
    """The shared secret the scheduler presents to its trainers and samplers
    (``authorization: Bearer <token>``; common/internal_auth.py)."""

    internal_token: SecretStr | None = Field(None, description="Shared secret between the scheduler and its trainers and samplers.")
    internal_token_file: Path | None = Field(
        None, description="File holding internal_token (a compose or Kubernetes secret); set one of the two.")


class RegistrationSettings(BaseModel):
    """How a trainer or sampler announces itself to the scheduler's registry (common/registration.py)."""

    register_with: str = Field(
        "", description="host:port of the scheduler's registry (its registry_bind), or several comma-separated: one per "
                        "scheduler replica, each registered with and sent heartbeats on its own; empty: do not register "
                        "(the scheduler then needs this worker in its static trainer_addresses / sampler_addresses).")
    advertise_address: str = Field(
        "", description="host:port the scheduler dials to reach this worker; empty: bind's host (this machine's host "
                        "name when bind is a wildcard such as 0.0.0.0) and the port actually bound.")
    heartbeat_seconds: float = Field(2.0, gt=0, description="Seconds between heartbeats to the registry.")
    register_tls_ca_file: Path | None = Field(
        None, description="PEM CA that signed the registry's certificate; set: the registry is reached over TLS.")
    register_tls_cert_file: Path | None = Field(
        None, description="PEM client certificate presented to a registry that requires one (mutual TLS).")
    register_tls_key_file: Path | None = Field(None, description="PEM private key of register_tls_cert_file.")


class ModelServiceSettings(ProcessSettings, InternalTokenSettings, RegistrationSettings):
    """Processes that load the base model (trainer, sampler). They answer the scheduler only: calls
    must carry internal_token, and without one they refuse to start unless internal_auth is disabled."""

    internal_auth: Literal["token", "disabled"] = Field(
        "token", description="token: every call but health and reflection needs internal_token; disabled: the port "
                             "answers anyone who reaches it (only behind a network that admits the scheduler alone).")

    base_model: str = Field("HuggingFaceTB/SmolLM2-135M-Instruct", description="Base model name, local folder or hub id.")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Base model dtype (adapters always train in float32).")
    num_threads: int = Field(0, description="torch intra-op threads; 0 keeps torch's default.")
