"""A tiny random causal LM plus a locally trained byte-level BPE tokenizer, for fast tests.

Everything is built from code (no downloads): a config of ~0.1-0.2M parameters per family Temper
trains (Qwen3 dense by default; Llama, Qwen3-MoE, GPT-OSS, DeepSeek-V3: ``TINY_FAMILIES``) and a ChatML
chat template, saved as an ordinary transformers folder that every service can load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TINY_MODEL_NAME = "temper/tiny-random"
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris.",
    "Which attempt is better? Answer A or B.",
    "receipt: pytest 14 passed, exit code 0",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 + - * / = ( ) [ ] { } , . ; : ! ? ' \"",
    "Temper trains many LoRA adapters on one shared base model.",
]


def build_tiny_model(target: Path, vocab_size: int = 512, hidden_size: int = 64, layers: int = 2, seed: int = 0,
                     family: str = "qwen3") -> Path:
    """Write a tiny model + tokenizer folder of ``family`` (``TINY_FAMILIES``) to ``target`` (idempotent)."""
    target = Path(target)
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer(vocab_size)
    ids = dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = TINY_FAMILIES[family](vocab_size, hidden_size, layers, ids)
    model = random_model(AutoModelForCausalLM, config, seed)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def random_model(auto_class, config, seed: int):
    """``auto_class.from_config(config)`` in float32 from ``seed`` (the global RNG left as it was), with
    random biases: transformers starts them at zero, and tests should see them at work."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = auto_class.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias") and not param.any():
                    param.normal_(0.0, 0.02)
    return model


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


# Every family's tiny config: (vocab, hidden, layers, token ids) -> a transformers config. The MoE ones
# have 8 routed experts, top-2, so that routing, ties and unseen experts all happen in a short test.
def _qwen3(vocab, hidden, layers, ids):
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, tie_word_embeddings=True,
                       max_position_embeddings=2048, **ids)


def _llama(vocab, hidden, layers, ids):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, tie_word_embeddings=True,
                       max_position_embeddings=2048, **ids)


def _qwen3_moe(vocab, hidden, layers, ids):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, moe_intermediate_size=hidden // 2,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, tie_word_embeddings=False,
                          max_position_embeddings=2048, **ids)


def _gpt_oss(vocab, hidden, layers, ids):
    from transformers import GptOssConfig
    # sliding and full attention alternate; a window of 8 tokens is shorter than the test sequences
    return GptOssConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden // 2, num_local_experts=8,
                        num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=hidden // 4, sliding_window=8, tie_word_embeddings=False, max_position_embeddings=2048,
                        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
                        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)], **ids)


def _deepseek_v3(vocab, hidden, layers, ids):
    from transformers import DeepseekV3Config
    # layer 0 dense (first_k_dense_replace), the others one shared expert + 8 routed ones in 2 groups
    return DeepseekV3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, moe_intermediate_size=hidden // 2,
                            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                            first_k_dense_replace=1, num_hidden_layers=max(layers, 2), num_attention_heads=4,
                            num_key_value_heads=4, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 2, qk_rope_head_dim=8,
                            qk_nope_head_dim=16, v_head_dim=16, tie_word_embeddings=False, max_position_embeddings=2048,
                            rope_interleave=True, **ids)


TINY_FAMILIES = {"qwen3": _qwen3, "llama": _llama, "qwen3_moe": _qwen3_moe, "gpt_oss": _gpt_oss, "deepseek_v3": _deepseek_v3}
TINY_FAMILY_NAMES = {family: f"temper/tiny-{family.replace('_', '-')}" for family in TINY_FAMILIES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the tiny random test model folder.")
    parser.add_argument("target", type=Path)
    parser.add_argument("--family", choices=sorted(TINY_FAMILIES), default="qwen3")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.target, family=args.family))
    return 0


if __name__ == "__main__":
    sys.exit(main())
