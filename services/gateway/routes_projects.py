"""Projects and session search (issue 33), in the SDK's shapes.

- ``POST /api/v1/sessions/search``: ``RestClient.search_sessions`` (a ``SessionSearchRequest`` body,
  a ``SessionSearchResponse``; ``session_search.py`` maps the filters). Malformed filters are 400 and
  nothing is asked of the scheduler.
- ``PUT /api/v1/sessions/{id}/project``: ``RestClient.assign_session_project`` (``{"project_id"}``).
- ``POST /api/v1/projects`` (``{"name"}``) and ``GET /api/v1/projects``: Temper's own, since the SDK
  has no call that creates a project (``python -m temper.scheduler.admin create-project`` does the
  same from the operator's side). A project's id goes to ``ServiceClient(project_id=...)`` (or
  ``TINKER_PROJECT_ID``) and to every ``project_id`` filter.

A caller sees its own tenant's only: another tenant's project or session is 404, as a missing one, and
nothing changes.
"""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Request

from temper.services.gateway import fields, session_search
from temper.services.gateway.app import api_key, gateway, json_body
from temper.services.gateway.errors import invalid
from temper.v1 import records_pb2

router = APIRouter(prefix="/api/v1")


def project_json(project: records_pb2.Project) -> dict:
    created = session_search.EPOCH + timedelta(milliseconds=project.created_unix_ms)
    return {"project_id": project.project_id, "name": project.name, "created_at": created.isoformat()}


@router.post("/sessions/search")
async def search_sessions(request: Request):
    key, body = api_key(request), await json_body(request)
    try:
        query, owners = session_search.search_request(body)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    answer = await gateway(request).scheduler.call("SearchSessions", query, key)
    if owners and answer.tenant not in owners:  # a "user" owner that is not the caller: none of its sessions are listable
        return {"sessions": [], "next_cursor": None}
    return {"sessions": [session_search.summary(s, answer.tenant) for s in answer.sessions],
            "next_cursor": session_search.next_cursor(answer)}


@router.put("/sessions/{session_id}/project")
async def assign_session_project(session_id: str, request: Request):
    key, body = api_key(request), await json_body(request)
    fields.text(session_id, "session_id")
    project_id = fields.string(body, "project_id")
    if not project_id:
        raise invalid("project_id is required (a session cannot be moved out of a project)")
    await gateway(request).scheduler.call(
        "AssignSessionProject", records_pb2.AssignSessionProjectRequest(session_id=session_id, project_id=project_id), key)
    return None


@router.post("/projects")
async def create_project(request: Request):
    key, body = api_key(request), await json_body(request)
    name = fields.string(body, "name")  # the scheduler checks it: 1 to 256 characters, no control characters
    project = await gateway(request).scheduler.call("CreateProject", records_pb2.CreateProjectRequest(name=name), key)
    return project_json(project)


@router.get("/projects")
async def list_projects(request: Request):
    key = api_key(request)
    listed = await gateway(request).scheduler.call("ListProjects", records_pb2.ListProjectsRequest(), key)
    return {"projects": [project_json(p) for p in listed.projects]}
