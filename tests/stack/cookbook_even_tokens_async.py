"""The cookbook's asynchronous RL trainer (`rl.train.AsyncConfig`), unmodified, on the even-token environment
of cookbook_even_tokens.py, whose rewards vary, so every step changes the weights and a stale group's sampled
logprobs really differ from the trainer's. Used by tests/stack/test_cookbook_async.py; runnable by hand:

    TINKER_BASE_URL=... TINKER_API_KEY=... python tests/stack/cookbook_even_tokens_async.py MODEL_DIR LOG_DIR STEPS OFF_POLICY"""
import asyncio
import sys

from cookbook_even_tokens import EvenDatasetBuilder
from tinker_cookbook.rl import train

if __name__ == "__main__":
    model, log_path, steps, off_policy = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    groups = 2
    config = train.Config(
        model_name=model, renderer_name="role_colon", recipe_name="temper_even_tokens_async", log_path=log_path,
        # one more batch than steps: sampling runs ahead of training by up to off_policy batches
        dataset_builder=EvenDatasetBuilder(model_name=model, groups_per_batch=groups, n_batches=steps + off_policy),
        learning_rate=1e-2, max_tokens=6, lora_rank=4, save_every=0, eval_every=0, max_steps=steps,
        async_config=train.AsyncConfig(max_steps_off_policy=off_policy, groups_per_batch=groups),
    )
    asyncio.run(train.main(config))
