"""Projects (issue 33): a tenant's named groups of sessions, as Tinker has them. A session joins one
at creation (the SDK's ``ServiceClient(project_id=...)``) or later (``assign_session_project``), and
lists and searches filter by it. A project belongs to one tenant: another tenant's project id answers
NOT_FOUND, the same as a missing one, and changes nothing. A mixin of ``Store``.

Also here: session expiry (a session whose heartbeats and work stopped is closed with close_status
``expired``), since both write the ``sessions`` row outside the open/close path of ``store.py``.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from temper.common.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from temper.common.strings import check_text
from temper.scheduler.db import models as m
from temper.scheduler.db.audit import SCHEDULER, Actor, record
from temper.scheduler.db.outage import database_errors, now
from temper.scheduler.db.views import unix_ms

EXPIRED = "expired"  # close_status of a session whose heartbeats stopped
MAX_PROJECTS_PER_TENANT = 1000


def new_project_id() -> str:
    return f"proj-{secrets.token_hex(8)}"


def check_project_name(name: str) -> str:
    """1 to 256 characters, not only spaces, no control characters (the API's string checks make the
    same ones; the admin command comes here directly)."""
    if not name.strip():
        raise InvalidArgument("a project needs a name (1 to 256 characters, not only spaces)")
    check_text(name, "the project name", identifier=True)
    return name


@database_errors
class ProjectStore:
    sessions = None  # sessionmaker, set by Store

    def create_project(self, tenant: str, name: str, actor: Actor | None = None) -> m.Project:
        check_project_name(name)
        tenant_id = self.ensure_tenant(tenant)
        try:
            with self.sessions.begin() as db:
                if db.scalar(select(m.Project.name).where(m.Project.tenant_id == tenant_id, m.Project.name == name)) is not None:
                    raise AlreadyExists(f"project {name!r} already exists")
                count = db.scalar(select(func.count()).select_from(m.Project).where(m.Project.tenant_id == tenant_id))
                if count >= MAX_PROJECTS_PER_TENANT:
                    raise ResourceExhausted(f"a tenant has at most {MAX_PROJECTS_PER_TENANT} projects")
                row = m.Project(id=new_project_id(), tenant_id=tenant_id, name=name, created_at=now())
                db.add(row)
                record(db, actor, "project.create", tenant, row.id, name=name)
                return row
        except IntegrityError:  # the same name created at the same moment by another call
            raise AlreadyExists(f"project {name!r} already exists") from None

    def tenant_projects(self, tenant: str) -> list[m.Project]:
        with self.sessions() as db:
            return list(db.scalars(select(m.Project).join(m.Tenant, m.Tenant.id == m.Project.tenant_id)
                                   .where(m.Tenant.name == tenant).order_by(m.Project.created_at, m.Project.id)))

    def check_projects(self, project_ids: list[str], tenant: str) -> None:
        """NotFound unless every id is one of the tenant's projects (another tenant's: as missing)."""
        wanted = set(project_ids)
        if not wanted:
            return
        with self.sessions() as db:
            found = set(db.scalars(select(m.Project.id).join(m.Tenant, m.Tenant.id == m.Project.tenant_id)
                                   .where(m.Tenant.name == tenant, m.Project.id.in_(sorted(wanted)))))
        missing = sorted(wanted - found)
        if missing:
            raise NotFound(f"project {missing[0]!r} not found")

    def assign_session_project(self, session_id: str, project_id: str, tenant: str, actor: Actor | None = None) -> None:
        """Moves the tenant's session (open or closed) into the tenant's project; NotFound for either of
        another tenant, nothing changed."""
        if not project_id:
            raise InvalidArgument("project_id is required (a session cannot be moved out of a project)")
        self.check_projects([project_id], tenant)
        with self.sessions.begin() as db:
            owner = db.scalar(select(m.Tenant.name).join(m.Session, m.Session.tenant_id == m.Tenant.id).where(m.Session.id == session_id))
            if owner != tenant:
                raise NotFound(f"session {session_id!r} not found")
            before = db.scalar(select(m.Session.project_id).where(m.Session.id == session_id))
            if before == project_id:
                return
            db.execute(update(m.Session).where(m.Session.id == session_id).values(project_id=project_id))
            record(db, actor, "session.project", tenant, session_id, project_id=project_id, previous=before or "")

    # ---- expiry ---------------------------------------------------------------------------------

    def expire_sessions(self, timeout_seconds: float) -> list[str]:
        """Closes every open session neither heard from nor working for ``timeout_seconds`` (close
        status ``expired``) and returns their ids. Working: a run of it had a request recorded, or a
        sampling client of it sampled, in that time (a raw gRPC client that sends no heartbeats is not
        cut off mid-work). One UPDATE ... RETURNING: two replicas sweeping at once expire each session
        once (the row lock orders them; the second finds it closed), and each expiry is audited once,
        in the same transaction."""
        stamp = now()
        cutoff = stamp - timedelta(seconds=timeout_seconds)
        s, run, sampled = m.Session, m.TrainingRun, m.SamplingRecord
        training = select(run.id).where(run.session_id == s.id, run.last_request_at >= cutoff).exists()
        sampling = select(sampled.id).where(sampled.session_id == s.id, sampled.started_ms >= unix_ms(cutoff)).exists()
        with self.sessions.begin() as db:
            expired = db.execute(update(s).where(s.closed_at.is_(None), s.last_heartbeat_at < cutoff, ~training, ~sampling)
                                 .values(closed_at=stamp, close_status=EXPIRED)
                                 .returning(s.id, s.tenant_id)).all()
            if not expired:
                return []
            names = dict(db.execute(select(m.Tenant.id, m.Tenant.name).where(m.Tenant.id.in_(sorted({t for _, t in expired})))).all())
            for session_id, tenant_id in sorted(expired):
                record(db, SCHEDULER, "session.expire", names.get(tenant_id, ""), session_id, timeout_seconds=timeout_seconds)
        return sorted(session_id for session_id, _ in expired)

    def expired_since(self, since: datetime) -> list[str]:
        """Sessions expired at or after ``since`` (by any replica): each replica releases their clients."""
        with self.sessions() as db:
            return sorted(db.scalars(select(m.Session.id).where(m.Session.close_status == EXPIRED, m.Session.closed_at >= since)))

    def project_run_ids(self, project_ids: list[str], tenant: str) -> set[str]:
        """The training runs of the tenant's sessions in any of ``project_ids`` (checked first)."""
        self.check_projects(project_ids, tenant)
        with self.sessions() as db:
            return set(db.scalars(select(m.TrainingRun.id).join(m.Session, m.Session.id == m.TrainingRun.session_id)
                                  .where(m.Session.project_id.in_(sorted(set(project_ids))))))
