"""TrainingClient: the training verbs of one training run (a LoRA adapter on the server).

Every verb returns an APIFuture at once. Each call takes the run's next seq_id when it is
submitted, and the scheduler executes the run's requests in seq_id order, so
``fb = tc.forward_backward(...); opt = tc.optim_step(...)`` pipelines both into one cycle.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from temper.client import convert
from temper.client import types as t
from temper.client.errors import unsupported
from temper.client.futures import APIFuture, ClientFuture
from temper.client.tokenizer import load_tokenizer
from temper.v1 import service_pb2, types_pb2

if TYPE_CHECKING:
    from temper.client.sampling_client import SamplingClient
    from temper.client.service_client import ServiceClient


class TrainingClient:
    def __init__(self, service: "ServiceClient", info: service_pb2.TrainingRunInfo):
        self.service = service
        self._runtime = service.runtime
        self._info = convert.info_from_proto(info)
        self.model_id = info.training_run_id
        self._seq = itertools.count(info.next_seq_id)
        self._seq_lock = threading.Lock()

    def _send(self, method: str, request):
        """A sequenced verb: a concurrent.futures.Future (a seq it fails to settle is abandoned: Runtime.sequenced)."""
        return self._runtime.call_soon(self._runtime.sequenced(method, request))

    def _next_seq(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    # ---- training verbs -----------------------------------------------------------------------

    def forward_backward(
        self, data: Sequence[t.Datum], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float | str] | None = None
    ) -> APIFuture[t.ForwardBackwardOutput]:
        return self._forward(data, loss_fn, loss_fn_config, forward_only=False)

    def forward(
        self, data: Sequence[t.Datum], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float | str] | None = None
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """Outputs and metrics of the loss without touching gradients."""
        return self._forward(data, loss_fn, loss_fn_config, forward_only=True)

    def _forward(self, data, loss_fn, loss_fn_config, forward_only: bool) -> APIFuture[t.ForwardBackwardOutput]:
        request = service_pb2.ForwardBackwardRequest(
            training_run_id=self.model_id, data=[convert.datum_to_proto(d) for d in data],
            loss_fn=loss_fn, loss_fn_config=convert.loss_config_to_proto(loss_fn_config), forward_only=forward_only,
        )
        # The seq is taken only once the request is built: a local error must not leave a gap
        # that the scheduler would wait on.
        request.seq_id = self._next_seq()
        return APIFuture(self._send("ForwardBackward", request), convert.forward_backward_from_proto)

    async def forward_async(self, *args: Any, **kwargs: Any) -> APIFuture[t.ForwardBackwardOutput]:
        """As Tinker's ``*_async`` verbs: awaiting submits and gives the future (await it too)."""
        return self.forward(*args, **kwargs)

    async def forward_backward_async(self, *args: Any, **kwargs: Any) -> APIFuture[t.ForwardBackwardOutput]:
        return self.forward_backward(*args, **kwargs)

    def forward_backward_custom(
        self, data: Sequence[t.Datum], loss_fn: Callable[[Sequence[t.Datum], list[Any]], tuple[Any, dict[str, float]]],
        *, loss_type_input: str | None = None,
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """A loss written in torch on the client, as in the Tinker SDK: a forward pass returns each
        datum's target logprobs, ``loss_fn(data, logprobs)`` gives (loss, metrics), and a
        cross_entropy backward with weights = -dloss/dlogprobs puts exactly that gradient into the
        adapter. Needs torch on the client. (Tinker's traced ``LossHandle`` losses are not supported.)"""
        import torch

        if loss_type_input not in (None, "logprobs"):
            raise ValueError(f"loss_type_input must be 'logprobs' or None, got {loss_type_input!r}")
        if not callable(loss_fn):
            raise unsupported("forward_backward_custom with a LossHandle (create_custom_loss)", "pass the loss function itself")

        def zeros_like_targets(d: t.Datum) -> t.TensorData:
            shape = d.loss_fn_inputs["target_tokens"].to_numpy().shape
            return t.TensorData.from_numpy(np.zeros(shape, dtype=np.float32))

        forward_data = [
            t.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                                               "weights": d.loss_fn_inputs.get("weights") or zeros_like_targets(d)})
            for d in data
        ]
        forward = service_pb2.ForwardBackwardRequest(
            training_run_id=self.model_id, data=[convert.datum_to_proto(d) for d in forward_data], loss_fn="cross_entropy", forward_only=True
        )
        # Both seq ids are taken now so the pair keeps its place among this run's requests.
        forward.seq_id, backward_seq = self._next_seq(), self._next_seq()

        def surrogate(outputs: types_pb2.ForwardBackwardOutput):
            logprobs = [torch.tensor(convert.tensor_from_proto(o.fields["logprobs"]).to_numpy(), requires_grad=True)
                        for o in outputs.loss_fn_outputs]
            loss, metrics = loss_fn(data, logprobs)
            loss.backward()
            backward_data = [
                t.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                                                   "weights": t.TensorData.from_torch(-lp.grad.float())})
                for d, lp in zip(data, logprobs)
            ]
            return float(loss.detach()), dict(metrics), backward_data

        async def run():
            try:
                outputs = await self._runtime.sequenced("ForwardBackward", forward)
                loss, metrics, backward_data = await asyncio.to_thread(surrogate, outputs)
            except BaseException:
                # The reserved seq is never sent: given up, so later work is not held up.
                self._runtime.abandon(self.model_id, backward_seq)
                raise
            backward = service_pb2.ForwardBackwardRequest(
                training_run_id=self.model_id, seq_id=backward_seq, data=[convert.datum_to_proto(d) for d in backward_data],
                loss_fn="cross_entropy",
            )
            result = convert.forward_backward_from_proto(await self._runtime.sequenced("ForwardBackward", backward))
            result.metrics["surrogate_loss:sum"] = result.metrics["loss:sum"]
            result.metrics.update(metrics)
            result.metrics["loss:sum"] = loss
            return result

        return APIFuture(self._runtime.call_soon(run()))

    async def forward_backward_custom_async(self, *args: Any, **kwargs: Any) -> APIFuture[t.ForwardBackwardOutput]:
        return self.forward_backward_custom(*args, **kwargs)

    def optim_step(self, optim_params: t.AdamParams | None = None, *, adam_params: t.AdamParams | None = None) -> APIFuture[t.OptimStepResponse]:
        """``optim_params`` or ``adam_params`` (Tinker's two names): Adam only, Temper has no other optimizer."""
        params = optim_params or adam_params or t.AdamParams()
        if not isinstance(params, t.AdamParams):
            raise unsupported(f"the optimizer of {type(params).__name__}", "Temper trains with AdamW (AdamParams)")
        request = service_pb2.OptimStepRequest(training_run_id=self.model_id, adam_params=convert.adam_to_proto(params))
        request.seq_id = self._next_seq()
        return APIFuture(self._send("OptimStep", request), lambda r: t.OptimStepResponse(metrics=t.metrics_dict(r.metrics)))

    async def optim_step_async(self, *args: Any, **kwargs: Any) -> APIFuture[t.OptimStepResponse]:
        return self.optim_step(*args, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------------

    def _save(self, name: str, kind: int, ttl_seconds: int | None = None, ephemeral: bool = False, overwrite: bool = False,
              user_metadata: dict[str, str] | None = None):
        request = service_pb2.SaveWeightsRequest(training_run_id=self.model_id, seq_id=self._next_seq(), name=name, kind=kind,
                                                 ttl_seconds=ttl_seconds or 0, ephemeral=ephemeral, overwrite=overwrite,
                                                 user_metadata=user_metadata or {})
        return self._send("SaveWeights", request)

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[t.SaveWeightsResponse]:
        """Adapter weights + optimizer state: resumable with load_state_with_optimizer. ``ttl_seconds``:
        deleted that long after saving (None: kept until deleted). ``overwrite``: replace a checkpoint of
        that name when the save runs (else a taken name is refused). ``user_metadata``: kept with it."""

        def done(r):
            return t.SaveWeightsResponse(path=r.checkpoint.path, checkpoint=convert.checkpoint_from_proto(r.checkpoint))

        return APIFuture(self._save(name, types_pb2.CHECKPOINT_KIND_TRAINING, ttl_seconds, overwrite=overwrite,
                                    user_metadata=user_metadata), done)

    async def save_state_async(self, *args: Any, **kwargs: Any) -> APIFuture[t.SaveWeightsResponse]:
        return self.save_state(*args, **kwargs)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None) -> APIFuture[t.SaveWeightsForSamplerResponse]:
        """Adapter weights only (peft format), pushed to the samplers."""
        return self._save_for_sampler(name, ttl_seconds, user_metadata=user_metadata)

    async def save_weights_for_sampler_async(self, *args: Any, **kwargs: Any) -> APIFuture[t.SaveWeightsForSamplerResponse]:
        return self.save_weights_for_sampler(*args, **kwargs)

    def _save_for_sampler(self, name: str, ttl_seconds: int | None = None, ephemeral: bool = False,
                          user_metadata: dict[str, str] | None = None):
        def done(r):
            return t.SaveWeightsForSamplerResponse(path=r.checkpoint.path, checkpoint=convert.checkpoint_from_proto(r.checkpoint))

        return APIFuture(self._save(name, types_pb2.CHECKPOINT_KIND_SAMPLER, ttl_seconds, ephemeral, user_metadata=user_metadata), done)

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False, kind: str = "snapshot") -> "ClientFuture[SamplingClient]":
        """A future of the SamplingClient, usable as the client itself. Without a name the weights are an
        unlisted snapshot, deleted once no sampling client has used it for a while
        (TEMPER_SCHEDULER_SNAPSHOT_IDLE_SECONDS) and a newer one exists. ``kind="inflight"``: the run's
        next in-flight version, and a client that follows the run's target from it on (later in-flight
        saves move it, for this client too; docs/async_rl.md)."""
        if kind not in ("snapshot", "inflight"):
            raise ValueError(f"kind must be 'snapshot' or 'inflight', got {kind!r}")
        if kind == "inflight" and name is not None:
            raise ValueError("an inflight save takes no name (its versions are unlisted)")
        self.service._check_sampling_options(record_stability_info)
        if kind == "inflight":
            saved = self.save_weights_inflight()

            async def follow() -> "SamplingClient":
                await saved
                return await self.service._new_sampling_client(inflight_training_run_id=self.model_id)

            return ClientFuture(self._runtime.call_soon(follow()))
        if name is None:
            saved = self._save_for_sampler(f"snapshot-{uuid.uuid4().hex[:12]}", ephemeral=True)
        else:
            saved = self.save_weights_for_sampler(name)

        async def create() -> "SamplingClient":
            return await self.service._new_sampling_client(model_path=(await saved).path)

        return ClientFuture(self._runtime.call_soon(create()))

    def save_weights_inflight(self) -> APIFuture[t.WeightsVersion]:
        """The run's weights as its next in-flight version (an unlisted sampler save): its path and version
        once durable, before any sampler has loaded it."""
        request = service_pb2.SaveWeightsRequest(training_run_id=self.model_id, seq_id=self._next_seq(), kind=types_pb2.CHECKPOINT_KIND_SAMPLER,
                                                 name=f"inflight-{uuid.uuid4().hex[:12]}", ephemeral=True, inflight=True)
        return APIFuture(self._send("SaveWeights", request), lambda r: t.WeightsVersion(r.weights.path, r.weights.version))

    async def save_weights_and_get_sampling_client_async(self, *args: Any, **kwargs: Any) -> "SamplingClient":
        return await self.save_weights_and_get_sampling_client(*args, **kwargs)

    def load_state(self, path: str, weights_access_token: str | None = None) -> APIFuture[t.LoadWeightsResponse]:
        """``weights_access_token`` is not needed: another tenant's checkpoint loads once it is published."""
        return self._load(path, with_optimizer=False)

    async def load_state_async(self, *args: Any, **kwargs: Any) -> APIFuture[t.LoadWeightsResponse]:
        return self.load_state(*args, **kwargs)

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None) -> APIFuture[t.LoadWeightsResponse]:
        return self._load(path, with_optimizer=True)

    async def load_state_with_optimizer_async(self, *args: Any, **kwargs: Any) -> APIFuture[t.LoadWeightsResponse]:
        return self.load_state_with_optimizer(*args, **kwargs)

    def _load(self, path: str, with_optimizer: bool) -> APIFuture[t.LoadWeightsResponse]:
        request = service_pb2.LoadWeightsRequest(
            training_run_id=self.model_id, seq_id=self._next_seq(), path=path, with_optimizer=with_optimizer
        )
        return APIFuture(self._send("LoadWeights", request), lambda r: t.LoadWeightsResponse(path=r.path))

    def create_sampling_client(self, model_path: str, retry_config: Any = None,
                               record_stability_info: bool = False) -> "ClientFuture[SamplingClient]":
        return self.service.create_sampling_client(model_path=model_path, record_stability_info=record_stability_info)

    async def create_sampling_client_async(self, *args: Any, **kwargs: Any) -> "SamplingClient":
        return await self.create_sampling_client(*args, **kwargs)

    def list_checkpoints(self) -> list[t.Checkpoint]:
        return self.service.list_checkpoints(self.model_id)

    # ---- info ---------------------------------------------------------------------------------

    def get_info(self) -> t.GetInfoResponse:
        return self._info

    async def get_info_async(self) -> t.GetInfoResponse:
        return self._info

    def get_tokenizer(self) -> Any:
        """The server's tokenizer, fetched from it on a machine without the model (cached: client/tokenizer.py)."""
        return load_tokenizer(self._runtime, self._info.model_data.model_name, self._info.model_data.tokenizer_id)
