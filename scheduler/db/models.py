"""SQLAlchemy models: what must survive a scheduler restart. Tensors never go here, except inside
the serialized answers of each run's most recent requests (``RequestRecord.result``, pruned to a
window), kept so that a retry after a restart still gets its answer, and inside the serialized
requests not yet covered by their run's latest adapter snapshot (``RequestRecord.payload``), kept so
that a trainer's death loses nothing acknowledged (``scheduler/planning/recovery.py``)."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, LargeBinary, String, Text, UniqueConstraint
from sqlalchemy import false as sa_false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)  # fair-share weight (co-batching scheduler)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Per-tenant limits (scheduler/tenancy/quotas.py); NULL: the scheduler's default for that limit, 0: unlimited.
    max_training_runs: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_resident_adapters: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_queued_requests: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    train_tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    sample_tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_storage_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class ApiKey(Base):
    """A tenant's API key. Only its SHA-256 is stored (keys are 256-bit random, so a fast hash is
    enough); the prefix identifies it in listings and logs."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    key_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    label: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # An operator's key (create-key --admin): GetClusterStatus and every tenant's audit log.
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())


class Session(Base):
    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    tags: Mapped[list] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    close_status: Mapped[str | None] = mapped_column(String(32), nullable=True)
    num_training_runs: Mapped[int] = mapped_column(Integer, default=0)
    num_samplers: Mapped[int] = mapped_column(Integer, default=0)
    # issue 33: the SDK's ServiceClient(display_name=..., project_id=...) (migration 0019)
    display_name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    project_id: Mapped[str | None] = mapped_column(ForeignKey("projects.id"), nullable=True, index=True)

    __table_args__ = (Index("ix_sessions_open_heartbeat", "closed_at", "last_heartbeat_at"),)


class Project(Base):
    """A tenant's named group of sessions (Tinker's projects); lists and searches filter by it."""

    __tablename__ = "projects"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_projects_tenant_name"),)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "proj-<hex>"
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TrainingRun(Base):
    __tablename__ = "training_runs"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)  # "<session_id>:train:<n>"
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    lora_rank: Mapped[int] = mapped_column(Integer)
    lora_alpha: Mapped[float] = mapped_column(Float)
    lora_dropout: Mapped[float] = mapped_column(Float, default=0.0)
    # Mixture-of-experts models: each routed expert's LoRA rank in effect, as the trainer answered its
    # CreateAdapter (the default rank // num_experts_per_tok or the one asked for); 0: no expert LoRA.
    lora_expert_rank: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # deterministic mode (docs/deterministic.md): its items run batch-invariant, its checkpoints sample so
    deterministic: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())
    seed: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    train_attn: Mapped[bool] = mapped_column(Boolean)
    train_mlp: Mapped[bool] = mapped_column(Boolean)
    train_unembed: Mapped[bool] = mapped_column(Boolean)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    next_seq_id: Mapped[int] = mapped_column(BigInteger, default=1)
    steps: Mapped[int] = mapped_column(Integer, default=0)
    tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_request_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the trainer holding its adapter (host:port), chosen by load at creation; NULL: placed by hash (before 0005).
    # Moved when that trainer dies and the run is restored on another (scheduler/planning/recovery.py).
    trainer: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # The run's latest adapter snapshot (checkpoint key "<run>/snapshots/<seq>") and the seq it holds
    # applied; NULL: none yet (restored from a fresh adapter of its config and seed, replayed from seq 1).
    snapshot_key: Mapped[str | None] = mapped_column(String(512), nullable=True)
    snapshot_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # A restore of its adapter is under way: set before the snapshot (or a fresh adapter) goes to the
    # trainer, cleared after the replay. Found set by a new scheduler process: restored again.
    restoring: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())
    # The highest seq of the run sent (or about to be sent) to its trainer: its requests still "queued"
    # at or below it may have been applied and count as "running" (request_log.py; migration 0017).
    dispatched_seq: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The run's in-flight target (docs/async_rl.md): its newest in-flight save's version (1, 2, ...; 0:
    # none yet) and checkpoint path. Advanced with that checkpoint's row, in one transaction, never back.
    inflight_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    inflight_path: Mapped[str | None] = mapped_column(String(512), nullable=True)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("training_run_id", "kind", "name", name="uq_checkpoint_run_kind_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    training_run_id: Mapped[str] = mapped_column(ForeignKey("training_runs.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # "sampler" | "training"
    name: Mapped[str] = mapped_column(String(128))
    path: Mapped[str] = mapped_column(String(512), unique=True)  # tinker://<run>/<kind_dir>/<name>
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    published: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())  # readable by other tenants
    ephemeral: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())  # unlisted sampler snapshot
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)  # by a sampling client
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # as given to its save (NULL before 0007)
    inflight_version: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # an in-flight save's version; else NULL


class ImageAsset(Base):
    """An image a tenant uploaded (UploadImage; issue 30), content-addressed per tenant: the same bytes
    uploaded again by the same tenant are this row. Its bytes live here (images are at most
    image_max_bytes), counted in the tenant's storage beside its checkpoints. ``data`` is deferred:
    listing and counting never read it."""

    __tablename__ = "images"
    __table_args__ = (UniqueConstraint("tenant_id", "sha256", name="uq_image_tenant_sha256"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    sha256: Mapped[str] = mapped_column(String(64))   # hex digest of data: the location temper-image://<sha256>
    format: Mapped[str] = mapped_column(String(8))    # png | jpeg
    width: Mapped[int] = mapped_column(Integer)
    height: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SamplingClient(Base):
    __tablename__ = "sampling_clients"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)  # "<session_id>:sample:<n>"
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    model_path: Mapped[str | None] = mapped_column(String(512), nullable=True)
    tokens_sampled: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    deterministic: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())  # docs/deterministic.md
    # An in-flight client (docs/async_rl.md): the run whose target it follows (model_path NULL) and the
    # target's version when it was made; NULL for every other client.
    inflight_run_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    min_version: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class RequestRecord(Base):
    """One sequenced training request. (run, seq) is unique: a retry finds the first record."""

    __tablename__ = "requests"
    __table_args__ = (UniqueConstraint("training_run_id", "seq_id", name="uq_request_run_seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    training_run_id: Mapped[str] = mapped_column(ForeignKey("training_runs.id"), index=True)
    seq_id: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(32))  # forward_backward | forward | optim_step | save_weights | load_weights
    payload_sha256: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # queued | running | done | failed
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    num_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # the response message, serialized; cleared once the request falls out of its run's result window
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    # the request itself, serialized (state-changing verbs, recovery on): replayed onto a restored adapter;
    # cleared once the run's latest snapshot covers its seq
    payload: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)


class AuditEntry(Base):
    """Who did what to which object, and when (scheduler/db/audit.py writes it in the transaction of the
    change itself). Append-only: no code path updates or deletes a row, and the database refuses to
    (triggers of migration 0011)."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)   # whose object: the tenant it is shown to
    key_prefix: Mapped[str] = mapped_column(String(16), default="")  # the acting key's; "" for the admin command
    actor: Mapped[str] = mapped_column(String(16))                  # api | admin-command | scheduler
    action: Mapped[str] = mapped_column(String(32), index=True)     # e.g. checkpoint.publish (AUDIT_ACTIONS in audit.py)
    target: Mapped[str] = mapped_column(String(512), default="")
    details: Mapped[dict] = mapped_column(JSON, default=dict)


class RunMetric(Base):
    """One answered sequenced request of a run, kept after its answer (issue 22; migration 0010):
    written with the request's outcome (``Store.finish_requests``), read by ListRunMetrics, pruned
    by age and per run (``db/records.py``). Times are unix milliseconds."""

    __tablename__ = "run_metrics"
    __table_args__ = (Index("ix_run_metrics_run_step", "training_run_id", "step"),)

    training_run_id: Mapped[str] = mapped_column(String(128), ForeignKey("training_runs.id"), primary_key=True)
    seq_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger)  # the run's optimizer steps when answered (an optim_step counts itself)
    kind: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # done | failed
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    num_tokens: Mapped[int] = mapped_column(BigInteger)
    grad_norm: Mapped[float | None] = mapped_column(Float, nullable=True)
    learning_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    metrics: Mapped[dict] = mapped_column(JSON)
    queued_seconds: Mapped[float] = mapped_column(Float)
    trainer_seconds: Mapped[float] = mapped_column(Float)
    cobatched_with: Mapped[int] = mapped_column(Integer)
    trainer: Mapped[str] = mapped_column(String(256))
    cycle: Mapped[int] = mapped_column(BigInteger)
    created_ms: Mapped[int] = mapped_column(BigInteger)
    started_ms: Mapped[int] = mapped_column(BigInteger)
    answered_ms: Mapped[int] = mapped_column(BigInteger, index=True)


class SamplingRecord(Base):
    """One answered Sample or ComputeLogprobs (issue 22; migration 0010), by session and start time."""

    __tablename__ = "sampling_records"
    __table_args__ = (Index("ix_sampling_records_session_started", "session_id", "started_ms"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"))
    sampler_id: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(32))  # sample | compute_logprobs
    num_samples: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    tokens_sampled: Mapped[int] = mapped_column(BigInteger)
    started_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    answered_ms: Mapped[int] = mapped_column(BigInteger)


class LaneLease(Base):
    """Which scheduler replica owns a trainer's lane, until when, under which fencing token (issue 32;
    migration 0015; scheduler/cluster/). Times are only ever the database's clock (written by SQL,
    no Python default), so a replica's own clock never decides a lease. A row is never deleted: a
    released lease is expired in place, so the lane's next token still counts up from it."""

    __tablename__ = "lane_leases"

    lane: Mapped[str] = mapped_column(String(256), primary_key=True)  # the trainer's address, as training_runs.trainer
    owner: Mapped[str] = mapped_column(String(256))                   # the replica's id (one per process incarnation)
    token: Mapped[int] = mapped_column(BigInteger)                    # strictly increasing per lane, never reused
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    renewed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class SchedulerReplica(Base):
    """A scheduler replica process incarnation (issue 32; migration 0016; scheduler/cluster/directory.py):
    where other replicas reach it to forward a lane's verbs, and when it was last heard by the
    database's clock. ``stopped``: it shut down cleanly (its leases released)."""

    __tablename__ = "scheduler_replicas"

    owner: Mapped[str] = mapped_column(String(256), primary_key=True)   # as lane_leases.owner
    address: Mapped[str] = mapped_column(String(256))                   # host:port of its Temper service
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    stopped: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())


class SigningKey(Base):
    """A secret that signs short-lived tokens (issue 33; migration 0018; scheduler/db/signing_keys.py),
    shared by every scheduler replica. ``purpose`` keeps uses apart ("jwt", "download"); the newest
    ``generation`` of a purpose is its current key, and (purpose, generation) is unique, so two
    replicas that rotate at once agree on one new key instead of making two."""

    __tablename__ = "signing_keys"
    __table_args__ = (UniqueConstraint("purpose", "generation", name="uq_signing_keys_purpose_generation"),)

    kid: Mapped[str] = mapped_column(String(64), primary_key=True)   # the "kid" a token's header names
    purpose: Mapped[str] = mapped_column(String(32))
    generation: Mapped[int] = mapped_column(BigInteger)               # 0, 1, 2, ... per purpose
    secret: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
