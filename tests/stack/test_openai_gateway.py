"""The `openai` client against the gateway's OpenAI-compatible routes (routes_openai.py) on the tiny
model: completions and chat on the base model and on a trained checkpoint give exactly what
temper.client's Sample gives for the same tokens and seed; errors come in OpenAI's shape."""

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")  # the `gateway` test extra (make venv installs it)

from fixtures_stack import sft_datum  # noqa: E402
from temper.client import AdamParams, ModelInput, SamplingParams  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Which attempt is better?"}]


@pytest.fixture(scope="module")
def oa_stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_openai")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("openai"), database_url=url, num_threads=1, gateway=True) as local:
        local.start()
        yield local


@pytest.fixture(scope="module")
def oa(oa_stack):
    client = openai.OpenAI(base_url=f"{oa_stack.gateway_url}/v1", api_key=oa_stack.api_key, max_retries=0, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def ours(oa_stack):
    client = oa_stack.client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def checkpoint(ours, tiny_model_dir, tokenizer):
    tc = ours.create_lora_training_client(tiny_model_dir, rank=4, seed=2)
    tokens = tokenizer.encode("The capital of France is Paris.")
    for _ in range(2):
        tc.forward_backward([sft_datum(tokens)], "cross_entropy").result()
        tc.optim_step(AdamParams(learning_rate=5e-2)).result()
    return tc.save_weights_for_sampler("openai").result().path


def grpc_sample(ours, tokens, n, params, **source):
    sc = ours.create_sampling_client(**source)
    return sc.sample(ModelInput.from_ints(tokens), num_samples=n, sampling_params=SamplingParams(**params),
                     topk_sample_logprobs=2).result()


def test_completions_on_the_base_model_equal_sample(oa, ours, tiny_model_dir, tokenizer):
    prompt = "The capital of France is"
    tokens = tokenizer.encode(prompt)
    got = oa.completions.create(model=tiny_model_dir, prompt=prompt, max_tokens=8, temperature=0.8, seed=5, n=2, logprobs=2)
    want = grpc_sample(ours, tokens, 2, dict(max_tokens=8, temperature=0.8, seed=5), base_model=tiny_model_dir)
    assert [c.index for c in got.choices] == [0, 1]
    for choice, seq in zip(got.choices, want.sequences, strict=True):
        assert choice.logprobs.token_logprobs == seq.logprobs
        assert choice.text == tokenizer.decode(seq.tokens, skip_special_tokens=True)
        assert choice.finish_reason == seq.stop_reason
        assert len(choice.logprobs.top_logprobs) == len(seq.tokens)  # a dict by text: ids that decode alike merge
        assert all(max(top.values()) == pytest.approx(max(lp for _, lp in alts)) and 1 <= len(top) <= 2
                   for top, alts in zip(choice.logprobs.top_logprobs, seq.topk_logprobs))
    assert got.usage.prompt_tokens == len(tokens)
    assert got.usage.completion_tokens == sum(len(s.tokens) for s in want.sequences)
    # echo with max_tokens=0 scores the prompt (what eval harnesses ask for)
    scored = oa.completions.create(model=tiny_model_dir, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    want_lps = ours.create_sampling_client(base_model=tiny_model_dir).compute_logprobs(ModelInput.from_ints(tokens)).result()
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(scored.choices[0].logprobs.token_logprobs[1:], want_lps[1:], rtol=1e-5, atol=1e-6)
    # token-id prompts and a batch of prompts: one Sample per prompt, one choice per (prompt, n)
    one = oa.completions.create(model=tiny_model_dir, prompt=prompt, max_tokens=8, temperature=0.8, seed=5)
    batch = oa.completions.create(model=tiny_model_dir, prompt=[tokens, tokens], max_tokens=8, temperature=0.8, seed=5)
    assert [c.text for c in batch.choices] == [one.choices[0].text] * 2 and [c.index for c in batch.choices] == [0, 1]


def test_chat_on_a_checkpoint_equals_sample_and_is_deterministic(oa, ours, checkpoint, tokenizer, tiny_model_dir):
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    params = dict(max_tokens=6, temperature=0.7, seed=3)
    got = oa.chat.completions.create(model=checkpoint, messages=MESSAGES, logprobs=True, top_logprobs=2, **params)
    want = grpc_sample(ours, tokens, 1, params, model_path=checkpoint).sequences[0]
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(want.tokens, skip_special_tokens=True)
    assert [t.logprob for t in choice.logprobs.content] == want.logprobs
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert got.usage.prompt_tokens == len(tokens) and got.usage.completion_tokens == len(want.tokens)
    again = oa.chat.completions.create(model=f"{tiny_model_dir};{checkpoint}", messages=MESSAGES, **params)
    assert again.choices[0].message.content == choice.message.content
    # the adapter matters: the base model answers differently
    base = grpc_sample(ours, tokens, 1, params, base_model=tiny_model_dir).sequences[0]
    assert not np.array_equal(base.logprobs, want.logprobs)


def test_stop_strings_and_streaming(oa, tiny_model_dir):
    plain = oa.completions.create(model=tiny_model_dir, prompt="The quick brown", max_tokens=12, temperature=0.9, seed=7)
    text = plain.choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in oa.completions.create(
        model=tiny_model_dir, prompt="The quick brown", max_tokens=12, temperature=0.9, seed=7, stream=True) if chunk.choices)
    assert streamed == text
    if len(text.strip()) > 2:
        stop = text.strip()[1:3]
        cut = oa.completions.create(model=tiny_model_dir, prompt="The quick brown", max_tokens=12, temperature=0.9, seed=7, stop=[stop])
        assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    chunks = list(oa.chat.completions.create(model=tiny_model_dir, messages=MESSAGES, max_tokens=4, seed=1, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens >= 1 and chunks[0].choices[0].delta.role == "assistant"


def test_models_and_errors(oa, oa_stack, tiny_model_dir):
    assert tiny_model_dir in [m.id for m in oa.models.list().data]
    with pytest.raises(openai.NotFoundError) as err:
        oa.completions.create(model="no/such-model", prompt="hi", max_tokens=2)
    assert err.value.status_code == 404 and err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        oa.chat.completions.create(model="tinker://nope:train:0/sampler_weights/x", messages=MESSAGES, max_tokens=2)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        oa.completions.create(model=tiny_model_dir, prompt="hi", max_tokens=2, presence_penalty=1.0)
    assert "presence_penalty" in err.value.message and err.value.type == "invalid_request_error"
    bad = openai.OpenAI(base_url=f"{oa_stack.gateway_url}/v1", api_key="tml-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=tiny_model_dir, prompt="hi", max_tokens=2)
    # Tinker's path for the beta, and the raw shape of an error
    resp = httpx.post(f"{oa_stack.gateway_url}/oai/api/v1/completions", json={"model": tiny_model_dir, "prompt": "hi"},
                      timeout=60)
    assert resp.status_code == 401 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
