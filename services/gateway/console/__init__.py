"""The web console at /console: a few static pages (no build step, nothing fetched from elsewhere:
uPlot is vendored under static/vendor/) whose scripts call the JSON routes under /console/api with
the API key the user logged in with, kept in the browser's sessionStorage and sent as the
``X-API-Key`` header (never in a URL, no cookie: a cross-site page cannot send that header, so there
is nothing for CSRF to ride on). Every route answers from the scheduler's public gRPC API with the
caller's own key: the same tenant, ownership and limits as gRPC, another tenant's ids NOT_FOUND (404).
GETs change nothing; changes are POSTs with a JSON body validated here (forms.py) and by the scheduler.

Modules: pages.py (the HTML shell, static files, security headers), api_tenant.py (runs,
checkpoints, usage, the Playground's models), api_sessions.py (sessions, Session Metrics: series.py,
a run's kept metrics), api_admin.py (who am I, API keys, audit log, cluster status), forms.py (POST
bodies), records.py and ranges.py (reading kept rows within a range and a row budget), trace.py
(Chrome trace-event JSON from those rows) and trace_route.py (GET /api/v1/sessions/{id}/trace),
views.py (protobuf -> JSON).
"""

from __future__ import annotations

from fastapi import FastAPI


def install(app: FastAPI) -> None:
    """Adds the console's routes; call before the gateway's catch-all 404 route."""
    from temper.services.gateway.console import api_admin, api_sessions, api_tenant, pages, trace_route

    for module in (api_tenant, api_sessions, api_admin, trace_route):
        app.include_router(module.router)
    pages.install(app)
