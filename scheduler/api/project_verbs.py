"""Projects and session search (issue 33): CreateProject, ListProjects, AssignSessionProject,
SearchSessions. The caller sees and changes its own tenant's only: another tenant's project or
session answers NOT_FOUND, as a missing one does, and nothing changes. Filters are checked before the
database is asked (INVALID_ARGUMENT). Mixed into TemperServicer (``store`` comes from it)."""

from __future__ import annotations

import asyncio

from temper.scheduler.api.record_verbs import session_message
from temper.scheduler.db.session_search import SessionQuery, unix_us
from temper.scheduler.db.views import unix_ms
from temper.scheduler.tenancy.auth import caller, caller_actor
from temper.v1 import records_pb2


def project_message(row) -> records_pb2.Project:
    return records_pb2.Project(project_id=row.id, name=row.name, created_unix_ms=unix_ms(row.created_at))


class ProjectVerbs:
    async def CreateProject(self, request, context):
        row = await asyncio.to_thread(self.store.create_project, caller(), request.name, caller_actor())
        return project_message(row)

    async def ListProjects(self, request, context):
        rows = await asyncio.to_thread(self.store.tenant_projects, caller())
        return records_pb2.ListProjectsResponse(projects=[project_message(r) for r in rows])

    async def AssignSessionProject(self, request, context):
        tenant = caller()
        await asyncio.to_thread(self.store.assign_session_project, request.session_id, request.project_id, tenant, caller_actor())
        detail = await asyncio.to_thread(self.store.session_detail, request.session_id, tenant)
        return session_message(detail.row)

    async def SearchSessions(self, request, context):
        query = SessionQuery.from_request(request)
        tenant = caller()
        if query.project_ids:
            await asyncio.to_thread(self.store.check_projects, list(query.project_ids), tenant)
        hits, more = await asyncio.to_thread(self.store.search_sessions, tenant, query)
        response = records_pb2.SearchSessionsResponse(more=more)
        for hit in hits:
            info = session_message(hit.row)
            info.checkpoints_count, info.checkpoint_bytes = hit.checkpoints, hit.checkpoint_bytes
            info.created_unix_us = unix_us(hit.row.created_at)
            response.sessions.append(info)
        return response
