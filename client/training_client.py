"""TrainingClient: the training verbs of one training run (a LoRA adapter on the server).

Every verb returns an APIFuture at once. Each call takes the run's next seq_id when it is
submitted, and the scheduler executes the run's requests in seq_id order, so
``fb = tc.forward_backward(...); opt = tc.optim_step(...)`` pipelines both into one cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import uuid
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from temper.client import convert
from temper.client import types as t
from temper.client.futures import APIFuture
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
        return APIFuture(self._runtime.rpc("ForwardBackward", request), convert.forward_backward_from_proto)

    def forward_backward_custom(
        self, data: Sequence[t.Datum], loss_fn: Callable[[Sequence[t.Datum], list[Any]], tuple[Any, dict[str, float]]]
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """A loss written in torch on the client, as in the Tinker SDK: a forward pass returns each
        datum's target logprobs, ``loss_fn(data, logprobs)`` gives (loss, metrics), and a
        cross_entropy backward with weights = -dloss/dlogprobs puts exactly that gradient into the
        adapter. Needs torch on the client."""
        import torch

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
                outputs = await self._runtime._call("ForwardBackward", forward)
                loss, metrics, backward_data = await asyncio.to_thread(surrogate, outputs)
            except BaseException:
                # Spend the reserved seq (an empty request is rejected at once) so later work is not held up.
                empty = service_pb2.ForwardBackwardRequest(training_run_id=self.model_id, seq_id=backward_seq, loss_fn="cross_entropy")
                with contextlib.suppress(Exception):
                    await self._runtime._call("ForwardBackward", empty)
                raise
            backward = service_pb2.ForwardBackwardRequest(
                training_run_id=self.model_id, seq_id=backward_seq, data=[convert.datum_to_proto(d) for d in backward_data],
                loss_fn="cross_entropy",
            )
            result = convert.forward_backward_from_proto(await self._runtime._call("ForwardBackward", backward))
            result.metrics["surrogate_loss:sum"] = result.metrics["loss:sum"]
            result.metrics.update(metrics)
            result.metrics["loss:sum"] = loss
            return result

        return APIFuture(self._runtime.call_soon(run()))

    def optim_step(self, adam_params: t.AdamParams | None = None) -> APIFuture[t.OptimStepResponse]:
        request = service_pb2.OptimStepRequest(
            training_run_id=self.model_id, adam_params=convert.adam_to_proto(adam_params or t.AdamParams())
        )
        request.seq_id = self._next_seq()
        return APIFuture(self._runtime.rpc("OptimStep", request), lambda r: t.OptimStepResponse(metrics=t.metrics_dict(r.metrics)))

    # ---- checkpoints --------------------------------------------------------------------------

    def _save(self, name: str, kind: int, ttl_seconds: int | None = None, ephemeral: bool = False):
        request = service_pb2.SaveWeightsRequest(training_run_id=self.model_id, seq_id=self._next_seq(), name=name, kind=kind,
                                                 ttl_seconds=ttl_seconds or 0, ephemeral=ephemeral)
        return self._runtime.rpc("SaveWeights", request)

    def save_state(self, name: str, ttl_seconds: int | None = None) -> APIFuture[t.SaveWeightsResponse]:
        """Adapter weights + optimizer state: resumable with load_state_with_optimizer. ``ttl_seconds``:
        deleted that long after saving (None: kept until deleted)."""
        def done(r):
            return t.SaveWeightsResponse(path=r.checkpoint.path, checkpoint=convert.checkpoint_from_proto(r.checkpoint))

        return APIFuture(self._save(name, types_pb2.CHECKPOINT_KIND_TRAINING, ttl_seconds), done)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> APIFuture[t.SaveWeightsForSamplerResponse]:
        """Adapter weights only (peft format), pushed to the samplers."""
        return self._save_for_sampler(name, ttl_seconds)

    def _save_for_sampler(self, name: str, ttl_seconds: int | None = None, ephemeral: bool = False):
        def done(r):
            return t.SaveWeightsForSamplerResponse(path=r.checkpoint.path, checkpoint=convert.checkpoint_from_proto(r.checkpoint))

        return APIFuture(self._save(name, types_pb2.CHECKPOINT_KIND_SAMPLER, ttl_seconds, ephemeral), done)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> "SamplingClient":
        """Without a name the weights are an unlisted snapshot, deleted once no sampling client has used
        it for a while (TEMPER_SCHEDULER_SNAPSHOT_IDLE_SECONDS) and a newer one exists."""
        if name is None:
            path = self._save_for_sampler(f"snapshot-{uuid.uuid4().hex[:12]}", ephemeral=True).result().path
        else:
            path = self.save_weights_for_sampler(name).result().path
        return self.service.create_sampling_client(model_path=path)

    def load_state(self, path: str) -> APIFuture[t.LoadWeightsResponse]:
        return self._load(path, with_optimizer=False)

    def load_state_with_optimizer(self, path: str) -> APIFuture[t.LoadWeightsResponse]:
        return self._load(path, with_optimizer=True)

    def _load(self, path: str, with_optimizer: bool) -> APIFuture[t.LoadWeightsResponse]:
        request = service_pb2.LoadWeightsRequest(
            training_run_id=self.model_id, seq_id=self._next_seq(), path=path, with_optimizer=with_optimizer
        )
        return APIFuture(self._runtime.rpc("LoadWeights", request), lambda r: t.LoadWeightsResponse(path=r.path))

    def create_sampling_client(self, model_path: str) -> "SamplingClient":
        return self.service.create_sampling_client(model_path=model_path)

    def list_checkpoints(self) -> list[t.Checkpoint]:
        return self.service.list_checkpoints(self.model_id)

    # ---- info ---------------------------------------------------------------------------------

    def get_info(self) -> t.GetInfoResponse:
        return self._info

    def get_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self._info.model_data.tokenizer_id)
