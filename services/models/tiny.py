"""A tiny random causal LM plus a locally trained byte-level BPE tokenizer, for fast tests.

Everything is built from code (no downloads): a Qwen3-shaped config with ~1M parameters and a
ChatML chat template, saved as an ordinary transformers folder that every service can load.
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


def build_tiny_model(target: Path, vocab_size: int = 512, hidden_size: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Write a tiny model + tokenizer folder to ``target`` (idempotent) and return it."""
    target = Path(target)
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

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
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4, tie_word_embeddings=True,
        max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the tiny random test model folder.")
    parser.add_argument("target", type=Path)
    args = parser.parse_args(argv)
    print(build_tiny_model(args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
