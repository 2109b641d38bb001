"""SamplingClient: sample and compute_logprobs against a base model or a saved adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from temper.client import convert
from temper.client import types as t
from temper.client.futures import APIFuture
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

    def sample(
        self, prompt: t.ModelInput, num_samples: int = 1, sampling_params: t.SamplingParams | None = None,
        include_prompt_logprobs: bool = False, topk_logprobs: int = 0,
    ) -> APIFuture[t.SampleResponse]:
        request = service_pb2.SampleRequest(
            sampler_id=self.sampler_id, prompt=convert.model_input_to_proto(prompt), num_samples=num_samples,
            sampling_params=convert.sampling_params_to_proto(sampling_params or t.SamplingParams()),
            include_prompt_logprobs=include_prompt_logprobs, topk_logprobs=topk_logprobs,
        )
        return APIFuture(self._runtime.rpc("Sample", request), convert.sample_from_proto)

    def compute_logprobs(self, prompt: t.ModelInput) -> APIFuture[list[float | None]]:
        """log p(token_i | tokens_<i) for each prompt token; the first is None."""
        request = service_pb2.ComputeLogprobsRequest(sampler_id=self.sampler_id, prompt=convert.model_input_to_proto(prompt))
        return APIFuture(self._runtime.rpc("ComputeLogprobs", request), lambda r: convert.logprobs_list(r.logprobs))

    def get_base_model(self) -> str:
        return self.base_model

    def get_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_id)
