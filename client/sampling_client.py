"""SamplingClient: sample and compute_logprobs against a base model or a saved adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from temper.client import convert
from temper.client import types as t
from temper.client.errors import unsupported
from temper.client.futures import APIFuture
from temper.client.tokenizer import load_tokenizer
from temper.client.versions import WeightsVersion, weights_from_proto
from temper.v1 import service_pb2

if TYPE_CHECKING:
    from temper.client.service_client import ServiceClient


class SamplingClient:
    def __init__(self, service: "ServiceClient", info: service_pb2.SamplingClientInfo):
        self.service = service
        self._runtime = service.runtime
        self.sampler_id = info.sampler_id
        self.base_model = info.base_model
        self.model_path = info.model_path or None
        self.tokenizer_id = info.tokenizer_id
        self.deterministic = info.deterministic  # samples and logprobs equal the trainer's (docs/deterministic.md)
        # an in-flight client (docs/async_rl.md): the run whose target it follows, and the version current when it was made
        self.inflight_training_run_id = info.inflight_training_run_id or None
        self.min_version = info.min_version

    def sample(
        self, prompt: t.ModelInput, num_samples: int = 1, sampling_params: t.SamplingParams | None = None,
        include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
        target_prompt_logprobs: t.TensorData | None = None, prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None, *, topk_logprobs: int | None = None, pin_version: bool = False,
    ) -> APIFuture[t.SampleResponse]:
        """Tinker's arguments, in Tinker's order. ``topk_sample_logprobs`` (``topk_logprobs``, its
        older Temper name) returns the k most likely tokens at each generated position,
        ``topk_prompt_logprobs`` at each prompt position; ``prompt_logprobs_last_n`` scores only the
        last N prompt positions (the server computes only those). ``pin_version`` (in-flight clients):
        each sequence decodes wholly on the version it starts on; each sequence's ``versions`` says
        which weights decoded each token (docs/async_rl.md)."""
        for name, value in (("target_prompt_logprobs", target_prompt_logprobs), ("prompt_alt_tokens_k", prompt_alt_tokens_k)):
            if value:
                raise unsupported(f"sample({name}=...)", "sample with include_prompt_logprobs=True or topk_prompt_logprobs")
        if prompt_logprobs_last_n is not None and not include_prompt_logprobs:
            raise ValueError("prompt_logprobs_last_n applies to prompt logprobs; set include_prompt_logprobs")
        request = service_pb2.SampleRequest(
            sampler_id=self.sampler_id, prompt=convert.model_input_to_proto(prompt), num_samples=num_samples,
            sampling_params=convert.sampling_params_to_proto(sampling_params or t.SamplingParams()),
            include_prompt_logprobs=include_prompt_logprobs, topk_logprobs=topk_logprobs or topk_sample_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs, pin_version=pin_version,
        )
        if prompt_logprobs_last_n is not None:
            request.prompt_logprobs_last_n = prompt_logprobs_last_n
        return APIFuture(self._runtime.rpc("Sample", request), convert.sample_from_proto)

    async def sample_async(self, *args: Any, **kwargs: Any) -> t.SampleResponse:
        return await self.sample(*args, **kwargs)

    def compute_logprobs(self, prompt: t.ModelInput, prompt_logprobs_last_n: int | None = None) -> APIFuture[list[float | None]]:
        """log p(token_i | tokens_<i) for each prompt token; the first is None. ``prompt_logprobs_last_n``:
        only the last N are computed and given, earlier ones are None (as in Tinker)."""
        request = service_pb2.ComputeLogprobsRequest(sampler_id=self.sampler_id, prompt=convert.model_input_to_proto(prompt))
        if prompt_logprobs_last_n is not None:
            request.prompt_logprobs_last_n = prompt_logprobs_last_n
        return APIFuture(self._runtime.rpc("ComputeLogprobs", request), lambda r: convert.logprobs_list(r.logprobs))

    def compute_logprobs_with_version(self, prompt: t.ModelInput, prompt_logprobs_last_n: int | None = None
                                      ) -> APIFuture[tuple[list[float | None], WeightsVersion]]:
        """compute_logprobs, and the weights that scored the prompt (an in-flight client's target then)."""
        request = service_pb2.ComputeLogprobsRequest(sampler_id=self.sampler_id, prompt=convert.model_input_to_proto(prompt))
        if prompt_logprobs_last_n is not None:
            request.prompt_logprobs_last_n = prompt_logprobs_last_n
        return APIFuture(self._runtime.rpc("ComputeLogprobs", request),
                         lambda r: (convert.logprobs_list(r.logprobs), weights_from_proto(r.weights)))

    async def compute_logprobs_async(self, prompt: t.ModelInput, prompt_logprobs_last_n: int | None = None) -> list[float | None]:
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n)

    def get_base_model(self) -> str:
        return self.base_model

    async def get_base_model_async(self) -> str:
        return self.base_model

    def get_tokenizer(self) -> Any:
        return load_tokenizer(self._runtime, self.base_model, self.tokenizer_id)
