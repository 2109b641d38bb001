"""RestClient: training runs and checkpoints under the Tinker SDK's RestClient method names, mapped
to Temper's gRPC verbs. Every method returns an APIFuture; each ``*_async`` gives the result.

Temper's gRPC API has no sessions listing, audit log, billing events or signed download URLs (the
HTTP gateway serves them to the tinker SDK): those methods raise ``UnsupportedError`` (a NotImplementedError) naming what to use instead.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from temper.client import convert
from temper.client import types as t
from temper.client.errors import unsupported
from temper.client.futures import APIFuture
from temper.common import checkpoint_search
from temper.v1 import records_pb2, service_pb2, types_pb2

if TYPE_CHECKING:
    from temper.client.runtime import Runtime


def _async_of(method: Callable[..., APIFuture]) -> Callable[..., Awaitable[Any]]:
    async def run(self, *args: Any, **kwargs: Any):
        return await method(self, *args, **kwargs)

    run.__name__ = f"{method.__name__}_async"
    run.__doc__ = f"The result of ``{method.__name__}``, awaited."
    return run


def _unsupported(name: str, hint: str) -> Callable[..., APIFuture]:
    def method(self, *args: Any, **kwargs: Any) -> APIFuture:
        raise unsupported(f"RestClient.{name}", hint)

    method.__name__ = name
    return method


class RestClient:
    def __init__(self, _runtime: "Runtime | None" = None, *, base_url: str | None = None, api_key: str | None = None,
                 connect_timeout: float | None = None):
        """On a ServiceClient's connection (``service_client.create_rest_client()``), or on its own, as
        ``tinker.RestClient()`` is: then ``base_url`` / ``api_key`` are read as ServiceClient reads them."""
        from temper.client.runtime import open_runtime

        self._owns_runtime = _runtime is None
        self._runtime = _runtime if _runtime is not None else open_runtime(base_url, api_key, connect_timeout=connect_timeout)

    def _submit(self, coro) -> APIFuture:
        return APIFuture(self._runtime.call_soon(coro))

    async def _call(self, method: str, request):
        return await self._runtime._call(method, request)

    def close(self) -> None:
        if self._owns_runtime:
            self._runtime.close()

    # ---- server -------------------------------------------------------------------------------

    def get_server_capabilities(self) -> APIFuture[t.GetServerCapabilitiesResponse]:
        async def run():
            r = await self._call("GetServerCapabilities", service_pb2.GetServerCapabilitiesRequest())
            return convert.capabilities_from_proto(r)

        return self._submit(run())

    # ---- training runs ------------------------------------------------------------------------

    async def _run(self, run_id: str) -> t.TrainingRun:
        info = await self._call("GetInfo", service_pb2.GetInfoRequest(training_run_id=run_id))
        checkpoints = (await self._call("ListCheckpoints", service_pb2.ListCheckpointsRequest(training_run_id=run_id))).checkpoints
        return _training_run(info, list(checkpoints))

    def get_training_run(self, training_run_id: str, access_scope: str = "owned") -> APIFuture[t.TrainingRun]:
        return self._submit(self._run(training_run_id))

    def get_training_run_by_tinker_path(self, tinker_path: str, access_scope: str = "owned") -> APIFuture[t.TrainingRun]:
        return self.get_training_run(t.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id)

    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[t.WeightsInfoResponse]:
        t.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)  # a malformed path fails here

        async def run():
            # from the checkpoint: also another tenant's published one
            checkpoint = await self._call("GetCheckpoint", service_pb2.GetCheckpointRequest(path=tinker_path))
            lora = checkpoint.lora_config
            return t.WeightsInfoResponse(base_model=checkpoint.base_model, is_lora=True, lora_rank=lora.rank,
                                         train_unembed=lora.train_unembed, train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                                         expert_rank=lora.expert_rank)

        return self._submit(run())

    def list_training_runs(self, limit: int = 20, offset: int = 0, access_scope: str = "owned",
                           project_id: str | None = None) -> APIFuture[t.TrainingRunsResponse]:
        """The caller's runs, newest first."""
        async def run():
            listed = await self._call("ListTrainingRuns", service_pb2.ListTrainingRunsRequest(limit=limit, offset=offset))
            checkpoints = []
            if listed.training_runs:
                checkpoints = list((await self._call("ListCheckpoints", service_pb2.ListCheckpointsRequest())).checkpoints)
            page = [_training_run(info, checkpoints) for info in listed.training_runs]
            return t.TrainingRunsResponse(page, t.Cursor(offset, limit, listed.total_count))

        return self._submit(run())

    # ---- checkpoints --------------------------------------------------------------------------

    def list_checkpoints(self, training_run_id: str) -> APIFuture[t.CheckpointsListResponse]:
        async def run():
            r = await self._call("ListCheckpoints", service_pb2.ListCheckpointsRequest(training_run_id=training_run_id))
            return t.CheckpointsListResponse([convert.checkpoint_from_proto(c) for c in r.checkpoints])

        return self._submit(run())

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[t.CheckpointsListResponse]:
        async def run():
            r = await self._call("ListCheckpoints", service_pb2.ListCheckpointsRequest())
            every = sorted((convert.checkpoint_from_proto(c) for c in r.checkpoints), key=lambda c: c.time, reverse=True)
            return t.CheckpointsListResponse(every[offset: offset + limit], t.Cursor(offset, limit, len(every)))

        return self._submit(run())

    def search_checkpoints(self, request: t.CheckpointSearchRequest) -> APIFuture[t.CheckpointSearchResponse]:
        """Tinker 0.39's search: the caller's checkpoints matching ``request``, newest first, a page at a
        time (pass ``next_cursor`` back as ``request.cursor``); the gateway's POST /api/v1/checkpoints/search
        runs the same filter (temper.common.checkpoint_search). A bad request raises ValueError here."""
        query = checkpoint_search.parse_query(request.to_json())

        async def run():
            caller = None
            if query.owner == "user":
                runs = await self._call("ListTrainingRuns", service_pb2.ListTrainingRunsRequest(limit=1))
                caller = checkpoint_search.owner_of(runs.training_runs)
            listed = (await self._call("ListCheckpoints", service_pb2.ListCheckpointsRequest(project_ids=query.project_ids))).checkpoints
            page, after = checkpoint_search.search(listed, query, caller)
            cursor = None if after is None else t.CheckpointSearchCursor(
                datetime.fromisoformat(after["last_created_at"]), after["last_checkpoint_uuid"])
            return t.CheckpointSearchResponse([convert.checkpoint_from_proto(c) for c in page], cursor)

        return self._submit(run())

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        """``checkpoint_id``: ``weights/<name>`` or ``sampler_weights/<name>``."""
        return self.delete_checkpoint_from_tinker_path(f"tinker://{training_run_id}/{checkpoint_id}")

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self._none(self._call("DeleteCheckpoint", service_pb2.DeleteCheckpointRequest(path=tinker_path)))

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self._update(tinker_path, published=True)

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self._update(tinker_path, published=False)

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: int | None) -> APIFuture[None]:
        """``ttl_seconds`` from now; None removes the expiry."""
        return self._update(tinker_path, ttl_seconds=ttl_seconds or 0)

    def _update(self, path: str, **fields: Any) -> APIFuture[None]:
        return self._none(self._call("UpdateCheckpoint", service_pb2.UpdateCheckpointRequest(path=path, **fields)))

    def _none(self, call: Awaitable[Any]) -> APIFuture[None]:
        async def run():
            await call
            return None

        return self._submit(run())

    def get_sampler(self, sampler_id: str) -> APIFuture[t.GetSamplerResponse]:
        async def run():
            info = await self._call("GetSamplingClient", service_pb2.GetSamplingClientRequest(sampler_id=sampler_id))
            return t.GetSamplerResponse(sampler_id=info.sampler_id, base_model=info.base_model, model_path=info.model_path or None)

        return self._submit(run())

    def copy_weights(self, path: str, destination_project_id: str | None = None, *,
                     ttl_seconds: int | None = None) -> APIFuture[str]:
        """The tinker path of a copy of ``path`` (the caller's checkpoint, or one published to it) made
        for the caller, in ``destination_project_id`` (one of its projects) if given; ``ttl_seconds``:
        1 hour to 10 years, None for no expiry. The copy outlives its source (CopyCheckpoint)."""
        async def run():
            copied = await self._call("CopyCheckpoint", service_pb2.CopyCheckpointRequest(
                source_path=path, ttl_seconds=ttl_seconds or 0, project_id=destination_project_id or ""))
            return copied.path

        return self._submit(run())

    def assign_session_project(self, session_id: str, project_id: str) -> APIFuture[None]:
        """Moves one of the caller's sessions into one of its projects (AssignSessionProject; either of
        another tenant, or unknown: NotFoundError, nothing changed)."""
        async def run():
            await self._call("AssignSessionProject", records_pb2.AssignSessionProjectRequest(session_id=session_id,
                                                                                            project_id=project_id))

        return self._submit(run())

    # ---- what Temper does not serve -----------------------------------------------------------

    get_external_weights_urls = _unsupported("get_external_weights_urls", "download with ServiceClient.download_checkpoint")
    get_session = _unsupported("get_session", "the gRPC API has no session queries")
    list_sessions = _unsupported("list_sessions", "the gRPC API has no session queries")
    search_sessions = _unsupported("search_sessions", "the gRPC API has no session queries")
    export_session_trace = _unsupported("export_session_trace", "the gRPC API has no session traces")
    get_audit_log = _unsupported("get_audit_log", "Temper keeps no audit log")
    whoami = _unsupported("whoami", "ServiceClient.get_usage() names the caller's tenant")
    get_billing_usage = _unsupported("get_billing_usage", "ServiceClient.get_usage() gives tokens and steps; the gateway "
                                     "serves hourly events (GET /api/v1/billing/usage/events) to the tinker SDK")
    get_current_checkpoint_storage_usage = _unsupported("get_current_checkpoint_storage_usage",
                                                        "ServiceClient.get_usage()['storage_bytes']")

    get_server_capabilities_async = _async_of(get_server_capabilities)
    get_training_run_async = _async_of(get_training_run)
    get_training_run_by_tinker_path_async = _async_of(get_training_run_by_tinker_path)
    get_weights_info_by_tinker_path_async = _async_of(get_weights_info_by_tinker_path)
    list_training_runs_async = _async_of(list_training_runs)
    get_sampler_async = _async_of(get_sampler)
    copy_weights_async = _async_of(copy_weights)
    list_checkpoints_async = _async_of(list_checkpoints)
    list_user_checkpoints_async = _async_of(list_user_checkpoints)
    search_checkpoints_async = _async_of(search_checkpoints)
    delete_checkpoint_async = _async_of(delete_checkpoint)
    delete_checkpoint_from_tinker_path_async = _async_of(delete_checkpoint_from_tinker_path)
    publish_checkpoint_from_tinker_path_async = _async_of(publish_checkpoint_from_tinker_path)
    unpublish_checkpoint_from_tinker_path_async = _async_of(unpublish_checkpoint_from_tinker_path)
    set_checkpoint_ttl_from_tinker_path_async = _async_of(set_checkpoint_ttl_from_tinker_path)


def _ms(unix_ms: int) -> datetime:
    return datetime.fromtimestamp(unix_ms / 1000, tz=timezone.utc)


def _training_run(info: service_pb2.TrainingRunInfo, checkpoints: list[types_pb2.Checkpoint]) -> t.TrainingRun:
    """``checkpoints``: any (those of other runs are skipped); the newest of each kind is shown."""
    mine = [convert.checkpoint_from_proto(c) for c in checkpoints if c.training_run_id == info.training_run_id]
    newest = {kind: max((c for c in mine if c.checkpoint_type == kind), key=lambda c: c.time, default=None)
              for kind in ("training", "sampler")}
    times = [_ms(ms) for ms in (info.last_request_unix_ms, info.created_unix_ms) if ms] + [c.time for c in mine]
    return t.TrainingRun(
        training_run_id=info.training_run_id, base_model=info.base_model, model_owner=info.owner, is_lora=True,
        last_request_time=max(times, default=datetime.now(timezone.utc)), lora_rank=info.lora_config.rank,
        last_checkpoint=newest["training"], last_sampler_checkpoint=newest["sampler"], user_metadata=dict(info.user_metadata) or None,
        expert_rank=info.lora_config.expert_rank)
