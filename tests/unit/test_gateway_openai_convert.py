"""The OpenAI shapes of the gateway (services/gateway/openai_convert.py): request fields -> Sample,
SampleResponse -> answers, errors. No network, a stand-in tokenizer."""

import json

import grpc
import numpy as np
import pytest

from temper.common.codec import decode_tokens, encode_floats, encode_tokens
from temper.services.gateway import openai_convert as oc
from temper.services.gateway.errors import GatewayError
from temper.v1 import types_pb2


class Letters:
    """Token i is the letter chr(97 + i); 0 is a special token ('<eos>', skipped when asked)."""

    eos_token_id = 0

    def decode(self, tokens, skip_special_tokens=False):
        return "".join("" if t == 0 and skip_special_tokens else "<eos>" if t == 0 else chr(97 + t) for t in tokens)


def sequence(tokens, logprobs, stop=types_pb2.STOP_REASON_STOP, topk=None):
    s = types_pb2.SampledSequence(stop_reason=stop, tokens=encode_tokens(tokens), logprobs=encode_floats(logprobs))
    if topk is not None:
        ids, lps = topk
        s.topk, s.topk_token_ids, s.topk_logprobs = len(ids[0]), encode_tokens(np.ravel(ids)), encode_floats(np.ravel(lps))
    return s


def test_generation_reads_openai_fields():
    gen = oc.generation({"model": "m", "n": 2, "max_tokens": 5, "temperature": 0, "top_p": 0.9, "seed": 3,
                         "stop": "\n", "logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
                         "presence_penalty": 0, "logit_bias": {}, "user": "x"}, chat=False)
    assert (gen.n, gen.max_tokens, gen.temperature, gen.top_p, gen.seed, gen.stop, gen.logprobs) == (2, 5, 0.0, 0.9, 3, ("\n",), 2)
    assert gen.stream and gen.include_usage
    chat = oc.generation({"model": "m", "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3}, chat=True)
    assert (chat.max_tokens, chat.logprobs) == (7, 3)
    assert oc.generation({"model": "m", "logprobs": False}, chat=True).logprobs is None
    assert oc.generation({"model": "m"}, chat=True).max_tokens is None  # chat: the context left
    assert oc.generation({"model": "m"}, chat=False).max_tokens == oc.COMPLETIONS_DEFAULT_MAX_TOKENS  # OpenAI's 16


@pytest.mark.parametrize("body", [
    {}, {"model": "m", "presence_penalty": 0.5}, {"model": "m", "frequency_penalty": 1}, {"model": "m", "logit_bias": {"1": 5}},
    {"model": "m", "best_of": 3}, {"model": "m", "n": 0}, {"model": "m", "max_tokens": 0}, {"model": "m", "stop": ["a"] * 5},
    {"model": "m", "stop": [""]}, {"model": "m", "temperature": "hot"}, {"model": "m", "n": 1.5},
    {"model": "m", "tools": [{"type": "function"}]}, {"model": "m", "response_format": {"type": "json_object"}},
    {"model": "m", "logprobs": 21},
])
def test_generation_refuses_what_temper_cannot_honour(body):
    with pytest.raises(GatewayError) as err:
        oc.generation(body, chat=False)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_chat_refuses_completion_only_fields():
    for body in ({"model": "m", "echo": True}, {"model": "m", "top_logprobs": 2}):
        with pytest.raises(GatewayError):
            oc.generation(body, chat=True)


def test_model_source():
    assert oc.model_source("org/base") == ("base_model", "org/base", None)
    assert oc.model_source("tinker://r:train:0/sampler_weights/s") == ("model_path", "tinker://r:train:0/sampler_weights/s", None)
    assert oc.model_source("org/base;tinker://r/sampler_weights/s") == ("model_path", "tinker://r/sampler_weights/s", "org/base")


def test_prompts_and_messages():
    assert oc.completion_prompts({"prompt": "hi"}) == ["hi"]
    assert oc.completion_prompts({"prompt": [1, 2]}) == [[1, 2]]
    assert oc.completion_prompts({"prompt": ["a", "b"]}) == ["a", "b"]
    assert oc.completion_prompts({"prompt": [[1], [2, 3]]}) == [[1], [2, 3]]
    for bad in (None, [], [1, "a"], [[]], 5):
        with pytest.raises(GatewayError):
            oc.completion_prompts({"prompt": bad})
    messages = oc.chat_messages({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]},
                                              {"role": "assistant", "content": None}]})
    assert messages == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
    for bad in ([], [{"content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        with pytest.raises(GatewayError):
            oc.chat_messages({"messages": bad})


def test_sampling_params_keep_eos_when_stop_strings_replace_the_default():
    gen = oc.generation({"model": "m", "seed": 4, "top_k": 5}, chat=False)
    params = oc.sampling_params(gen, 9, eos_ids=[0])
    assert params.max_tokens == 9 and params.seed == 4 and params.top_k == 5
    assert not params.stop_strings and not params.stop_token_ids  # the model's own stop
    params = oc.sampling_params(oc.generation({"model": "m", "stop": ["x", "y"]}, chat=False), 9, eos_ids=[0, 0])
    assert list(params.stop_strings) == ["x", "y"] and decode_tokens(params.stop_token_ids).tolist() == [0]
    assert not oc.sampling_params(oc.generation({"model": "m", "temperature": 0}, chat=False), 1).HasField("seed")


def test_choices_cut_stop_strings_and_skip_special_tokens():
    resp = types_pb2.SampleResponse(sequences=[sequence([1, 2, 3, 0], [-1, -2, -3, -4]),
                                               sequence([7, 23, 4, 4], [-1] * 4, types_pb2.STOP_REASON_LENGTH),
                                               sequence([3, 4], [-1, -1], types_pb2.STOP_REASON_LENGTH)])
    first, second, third = oc.choices_of(resp, Letters(), stop=("xe",))
    assert (first.text, first.finish_reason, first.tokens) == ("bcd", "stop", [1, 2, 3, 0])
    assert (second.text, second.finish_reason) == ("h", "stop")  # "hxee": cut before the stop string
    assert (third.text, third.finish_reason) == ("de", "length")


def test_completion_logprobs_with_echo_and_alternatives():
    resp = types_pb2.SampleResponse(sequences=[sequence([1, 2], [-0.5, -1.5], topk=([[1, 3], [2, 2]], [[-0.5, -2], [-1.5, -9]]))])
    [choice] = oc.choices_of(resp, Letters(), ())
    out = oc.completion_logprobs(Letters(), choice, 2, prompt=[4, 5], prompt_lps=[None, -3.0])
    assert out["tokens"] == ["e", "f", "b", "c"] and out["token_logprobs"] == [None, -3.0, -0.5, -1.5]
    assert out["top_logprobs"] == [None, None, {"b": -0.5, "d": -2.0}, {"c": -1.5}]  # alike ids: the likelier stays
    assert out["text_offset"] == [0, 1, 2, 3]
    assert oc.completion_logprobs(Letters(), choice, 0)["top_logprobs"] is None
    chat = oc.chat_logprobs(Letters(), choice, 1)
    assert chat["content"][0] == {"token": "b", "logprob": -0.5, "bytes": [98], "top_logprobs": [
        {"token": "b", "logprob": -0.5, "bytes": [98]}]}


def test_prompt_logprobs_nan_is_none():
    resp = types_pb2.SampleResponse(prompt_logprobs=types_pb2.Tensor(
        dtype=types_pb2.DTYPE_FLOAT32, shape=[2], data=np.array([np.nan, -1.0], "<f4").tobytes()))
    assert oc.prompt_logprobs(resp) == [None, -1.0]
    assert oc.prompt_logprobs(types_pb2.SampleResponse()) == []


def test_stream_events_carry_the_whole_answer():
    choice = oc.Choice("hi", "stop", [1], [-1.0], None)
    body = oc.chat_body("chatcmpl-1", 5, "m", [oc.chat_choice(0, choice, None)], oc.usage(3, 1))
    events = list(oc.stream_events(body, chat=True, include_usage=True))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 4
    completion = oc.completion_body("cmpl-1", 5, "m", [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}],
                                    oc.usage(1, 1))
    [event, done] = list(oc.stream_events(completion, chat=False, include_usage=False))
    assert json.loads(event[len("data: "):])["choices"][0]["text"] == "x" and done == "data: [DONE]\n\n"


def test_errors_in_openai_shape():
    status, body = oc.error_body(GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    assert status == 400 and body == {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
    status, body = oc.error_body(GatewayError(grpc.StatusCode.UNAUTHENTICATED, "no key"))
    assert status == 401 and body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    assert oc.error_body(GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy"))[0] == 429
    assert oc.error_body(GatewayError(grpc.StatusCode.UNAVAILABLE, "down"))[1]["error"]["type"] == "server_error"
    status, body = oc.model_not_found("x/y", GatewayError(grpc.StatusCode.NOT_FOUND, "no sampler serves base model 'x/y'"))
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert "x/y" in body["error"]["message"]
