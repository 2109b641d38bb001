"""A cookbook RL run on a tiny synthetic environment, written only with the cookbook's public RL API
(Env / EnvGroupBuilder / RLDataset / RLDatasetBuilder) and run by its unmodified trainer
`tinker_cookbook.rl.train.main`. Used by tests/stack/test_cookbook_recipes.py; runnable by hand:

    TINKER_BASE_URL=... TINKER_API_KEY=... python tests/stack/cookbook_even_tokens.py MODEL_DIR LOG_DIR LOSS_FN

The reward is the fraction of sampled tokens with an even id, so a random model's groups are mixed and
the update is not zero (the arithmetic recipe on a random model only ever scores -0.1). A KL penalty
against the base model makes the trainer call compute_logprobs on a base-model sampling client too."""
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import chz
import tinker

from tinker_cookbook.renderers import Renderer, get_renderer
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.tokenizer_utils import get_tokenizer


class EvenTokenEnv(Env):
    """One turn; the reward is the fraction of sampled tokens with an even id (so groups are mixed)."""

    def __init__(self, renderer: Renderer, question: str):
        self.renderer, self.question = renderer, question

    async def initial_observation(self):
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": self.question}])
        return prompt, self.renderer.get_stop_sequences()

    async def step(self, action, *, extra=None):
        reward = sum(t % 2 == 0 for t in action) / max(len(action), 1)
        return StepResult(reward=reward, episode_done=True, next_observation=tinker.ModelInput.from_ints([]),
                          next_stop_condition=self.renderer.get_stop_sequences(), metrics={"even_frac": reward})


@dataclass(frozen=True)
class EvenGroup(EnvGroupBuilder):
    renderer: Renderer
    question: str
    size: int

    async def make_envs(self) -> Sequence[Env]:
        return [EvenTokenEnv(self.renderer, self.question) for _ in range(self.size)]


@dataclass(frozen=True)
class EvenDataset(RLDataset):
    renderer: Renderer
    groups_per_batch: int
    group_size: int
    n_batches: int

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [EvenGroup(self.renderer, f"What is {index} + {i}?", self.group_size) for i in range(self.groups_per_batch)]

    def __len__(self) -> int:
        return self.n_batches


@chz.chz
class EvenDatasetBuilder(RLDatasetBuilder):
    model_name: str
    renderer_name: str = "role_colon"
    groups_per_batch: int = 2
    group_size: int = 4
    n_batches: int = 3

    async def __call__(self):
        renderer = get_renderer(self.renderer_name, get_tokenizer(self.model_name))
        return EvenDataset(renderer, self.groups_per_batch, self.group_size, self.n_batches), None


if __name__ == "__main__":
    model, log_path, loss_fn, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 2
    config = train.Config(
        model_name=model, renderer_name="role_colon", recipe_name="temper_even_tokens", log_path=log_path,
        dataset_builder=EvenDatasetBuilder(model_name=model, n_batches=steps), learning_rate=1e-3, max_tokens=6,
        lora_rank=4, loss_fn=loss_fn, kl_penalty_coef=0.05, kl_reference_config=train.KLReferenceConfig(base_model=model),
        save_every=1, eval_every=0, max_steps=steps,
    )
    asyncio.run(train.main(config))
