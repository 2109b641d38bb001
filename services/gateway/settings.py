"""Gateway process settings (environment variables with the TEMPER_GATEWAY_ prefix)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from temper.common.billing import ModelPrices, parse_price_table
from temper.common.settings import ProcessSettings
from temper.services.gateway.body_limit import JSON_LIMIT, PROTOBUF_LIMIT


class GatewaySettings(ProcessSettings):
    """bind, metrics_bind, log_level, log_format, the TLS of our own port (tls_cert_file,
    tls_key_file, tls_client_ca_file: HTTPS, optionally mutual) and the image limits of the chat routes'
    early checks (image_max_*: TEMPER_GATEWAY_IMAGE_MAX_BYTES, ...) come from ProcessSettings."""

    model_config = SettingsConfigDict(env_prefix="TEMPER_GATEWAY_")

    bind: str = Field("127.0.0.1:8000", description="host:port of the HTTP server (port 0 picks a free one).")
    scheduler_address: str = Field("127.0.0.1:50051", description="host:port of the scheduler's public gRPC API; for several "
                                                                  "replicas a list 10.0.0.1:50051,10.0.0.2:50051 or "
                                                                  "dns:///name:port (round_robin over them).")
    scheduler_tls: bool = Field(False, description="Reach the scheduler over TLS, checked against the system's roots "
                                                   "(or scheduler_tls_ca_file).")
    scheduler_tls_ca_file: Path | None = Field(None, description="PEM CA of the scheduler's certificate; set: TLS.")
    scheduler_tls_client_cert_file: Path | None = Field(None, description="PEM client certificate for a scheduler that "
                                                                          "requires one (mutual TLS).")
    scheduler_tls_client_key_file: Path | None = Field(None, description="PEM private key of the client certificate.")
    rpc_timeout_seconds: float = Field(60.0, gt=0, description="Deadline of the scheduler calls that answer at once "
                                                               "(sessions, info, checkpoints).")
    unavailable_retry_seconds: float = Field(120.0, ge=0, description="How long a verb behind a future is resent while the "
                                                                      "scheduler is unreachable before it fails.")
    long_poll_seconds: float = Field(25.0, gt=0, description="How long retrieve_future holds a poll before answering "
                                                            "try_again (the SDK's poll times out at 45 s).")
    future_keep_seconds: float = Field(3600.0, gt=0, description="How long an answered future nobody retrieves is kept.")
    max_json_body_bytes: int = Field(JSON_LIMIT, gt=0, description="Largest JSON request body; a larger one is refused "
                                                                   "with 413 (parsing takes several times its size).")
    max_protobuf_body_bytes: int = Field(PROTOBUF_LIMIT, gt=0, description="Largest protobuf request body (forward_backward); "
                                                                           "a larger one is refused with 413. Default: the "
                                                                           "scheduler's message limit.")
    console_max_rows: int = Field(20000, gt=0, le=1_000_000,
                                  description="Most kept rows (requests and sampling calls) one console trace or Session "
                                              "Metrics answer reads; a range holding more is refused (400): narrow it.")
    price_table: str = Field("", description="USD rates per base model, as JSON {model: {train_per_mtok, sample_per_mtok, "
                                             "prefill_per_mtok, storage_per_gb_month, cached_prefill_per_mtok?}}: "
                                             "the costs of billing usage events and the cookbook's /tinker/models.json. "
                                             "Empty: usage is answered without costs. A malformed table stops the start.")

    def prices(self) -> dict[str, ModelPrices]:
        return parse_price_table(self.price_table)
