"""Tiny random vision-language models (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) for fast tests, built
offline from code.

Each folder is what a real checkpoint of the family holds: the model (Qwen3-VL: a two-layer language
model, a two-block vision tower with one deepstack merger; Qwen3.5: four layers, three gated-delta-net
linear-attention layers and one full-attention layer, as the real models' 3:1 pattern, and a tower
without deepstack), a fast tokenizer whose special tokens sit at the family's real ids (Qwen3:
``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653, ``<|image_pad|>`` 151655, ...; Qwen3.5: the same
tokens in the same order from 248044, so ``<|vision_start|>`` 248053 and ``<|image_pad|>`` 248056 as
``Qwen3_5Config``'s defaults, in a 248,320-entry vocabulary: the vocabulary is padded with unreachable
filler entries up to them), a chat template that renders image
parts as Qwen's does, and a ``preprocessor_config.json`` naming the model's own image processor
(``Qwen2VLImageProcessor``: 16-pixel patches, 2 x 2 merge, so a 64 x 64 image is 4 image tokens). The
pixel bounds are small (``TINY_MAX_PIXELS``) so that images stay a handful of tokens on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from temper.services.models.tiny import _CORPUS, random_model

QWEN3_VOCAB = 151936
QWEN3_FIRST_SPECIAL = 151643
QWEN3_5_VOCAB = 248320          # Qwen3_5TextConfig's vocab_size
QWEN3_5_FIRST_SPECIAL = 248044  # so that image_token_id is Qwen3_5Config's 248056 (Qwen3's specials, in order)
# Qwen3's added tokens in id order from 151643 (tokenizer_config.json of the Qwen3 / Qwen3-VL checkpoints)
QWEN3_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
# the text tests, examples and recipes put around images, so that the trained BPE spells them in whole words
# (a 500-entry vocabulary learned from the text corpus alone takes most words letter by letter)
_VISION_CORPUS = [
    "What is the name of the subject in this photo?", "The subject in this photo is: red green blue yellow",
    "Where is the shape? Answer top left, top right, bottom left or bottom right.",
    "A photo of a red circle, a green square, a blue triangle and a yellow shape.",
]
# The language model's init: at transformers' 0.02 a 64-wide random model's tied embeddings are so short that its
# logits stay within about +-1.3 whatever the hidden state, so no adapter can make it confident and fine-tuning
# learns the answers' marginal instead of reading the image (measured: the cookbook's vlm_classifier stayed at
# chance); at 0.1 it can be as peaked as a pretrained model. (The Qwen3.5 tiny models keep 0.02: no learning
# test runs on them, and their reference linear attention's float32 error grows past 1e-5 with the larger init.)
TEXT_INIT_RANGE = 0.1
TINY_MIN_PIXELS = 32 * 32       # at least one image token
TINY_MAX_PIXELS = 128 * 128     # at most 16 image tokens
# Qwen-VL's chat template, shortened: text and image parts of a message's content in order
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_vl_model(target: Path, family: str = "qwen3_vl_moe", seed: int = 0, hidden_size: int = 64,
                        layers: int | None = None, vocab_size: int | None = None) -> Path:
    """Write a tiny ``family`` (a key of ``TINY_VL_FAMILIES``) folder to ``target`` (idempotent).

    ``layers``: the family's default (``TINY_VL_LAYERS``) when None. ``vocab_size`` below the family's
    real one puts the special tokens at the end of the smaller vocabulary instead (other ids than the
    real ones, written into the config as a checkpoint with its own ids would have them): benchmarks use
    it so that a 151,936-row head does not dwarf a 64-wide model's decoder and tower."""
    target = Path(target)
    if (target / "config.json").is_file() and (target / "preprocessor_config.json").is_file():
        return target
    from transformers import AutoModelForImageTextToText

    real_vocab, real_first = TINY_VL_IDS[family]
    vocab_size = real_vocab if vocab_size is None else vocab_size
    first_special = real_first if vocab_size >= real_vocab else vocab_size - len(QWEN3_SPECIALS)
    tokenizer = qwen_tokenizer(first_special)
    config = TINY_VL_FAMILIES[family](hidden_size, layers or TINY_VL_LAYERS[family], tokenizer)
    config.text_config.vocab_size = vocab_size
    # the ids the tokenizer gives are the config's (the real ones at the family's own vocabulary size)
    for field, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                         ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        setattr(config, field, tokenizer.convert_tokens_to_ids(token))
    model = random_model(AutoModelForImageTextToText, config, seed)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(config), indent=2))
    return target


def qwen_tokenizer(first_special: int = QWEN3_FIRST_SPECIAL):
    """A byte-level BPE trained on a small corpus, its vocabulary padded with filler entries (never
    produced: no merge leads to them) so that Qwen3's special tokens take their real ids (from
    ``first_special`` on, 151643 for Qwen3's own)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((_CORPUS + _VISION_CORPUS) * 4, trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab = dict(trained["vocab"])
    for i in range(len(vocab), first_special):
        vocab[f"\u0000filler{i}"] = i
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    padded = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    padded.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    padded.decoder = decoders.ByteLevel()
    padded.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIALS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=padded, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == first_special + 12, "Qwen3 special ids moved"
    return tokenizer


def _rope(head_dim: int) -> dict:
    quarter = head_dim // 8  # mrope sections (temporal, height, width) sum to head_dim / 2
    return {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter],
            "mrope_interleaved": True}


def _text(hidden: int, layers: int, tokenizer) -> dict:
    head_dim = hidden // 4
    return dict(vocab_size=QWEN3_VOCAB, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rope_parameters=_rope(head_dim),
                max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=None, initializer_range=TEXT_INIT_RANGE)


def _vision(hidden: int) -> dict:
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                temporal_patch_size=2, out_hidden_size=hidden, num_position_embeddings=64, deepstack_visual_indexes=[1])


def _qwen3_vl(hidden, layers, tokenizer):
    from transformers import Qwen3VLConfig
    return Qwen3VLConfig(text_config=_text(hidden, layers, tokenizer), vision_config=_vision(hidden),
                         tie_word_embeddings=True)


def _qwen3_vl_moe(hidden, layers, tokenizer):
    from transformers import Qwen3VLMoeConfig
    # 8 routed experts, top-2, as the text MoE tiny models
    text = dict(_text(hidden, layers, tokenizer), moe_intermediate_size=hidden // 2, num_experts=8,
                num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
    return Qwen3VLMoeConfig(text_config=text, vision_config=_vision(hidden), tie_word_embeddings=True)


def _qwen3_5_text(hidden: int, layers: int, tokenizer) -> dict:
    """Qwen3.5's hybrid decoder: gated-delta-net linear attention with a full-attention layer every fourth
    (the real models' ``full_attention_interval``); gated full attention with partial rotary (a quarter of
    the head), interleaved multimodal sections summing to the rotary half."""
    head_dim = hidden // 2
    rotary_half = int(head_dim * 0.25) // 2
    quarter = rotary_half // 4
    return dict(
        vocab_size=QWEN3_5_VOCAB, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                         "mrope_section": [rotary_half - 2 * quarter, quarter, quarter], "mrope_interleaved": True},
        max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None)


def _qwen3_5_vision(hidden: int) -> dict:
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                temporal_patch_size=2, out_hidden_size=hidden, num_position_embeddings=64)


def _qwen3_5(hidden, layers, tokenizer):
    from transformers import Qwen3_5Config
    return Qwen3_5Config(text_config=_qwen3_5_text(hidden, layers, tokenizer), vision_config=_qwen3_5_vision(hidden),
                         tie_word_embeddings=True)


def _qwen3_5_moe(hidden, layers, tokenizer):
    from transformers import Qwen3_5MoeConfig
    # 8 routed experts, top-2, and the shared expert (gated) of every Qwen3.5-MoE layer
    text = dict(_qwen3_5_text(hidden, layers, tokenizer), moe_intermediate_size=hidden // 2,
                shared_expert_intermediate_size=hidden // 2, num_experts=8, num_experts_per_tok=2)
    text.pop("intermediate_size")
    return Qwen3_5MoeConfig(text_config=text, vision_config=_qwen3_5_vision(hidden), tie_word_embeddings=True)


def _preprocessor_config(config) -> dict:
    vision = config.vision_config
    return {
        "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "size": {"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS},
    }


TINY_VL_FAMILIES = {"qwen3_vl": _qwen3_vl, "qwen3_vl_moe": _qwen3_vl_moe, "qwen3_5": _qwen3_5,
                    "qwen3_5_moe": _qwen3_5_moe}
# each family's real vocabulary size and the id of its first special token (<|endoftext|>)
TINY_VL_IDS = {"qwen3_vl": (QWEN3_VOCAB, QWEN3_FIRST_SPECIAL), "qwen3_vl_moe": (QWEN3_VOCAB, QWEN3_FIRST_SPECIAL),
               "qwen3_5": (QWEN3_5_VOCAB, QWEN3_5_FIRST_SPECIAL), "qwen3_5_moe": (QWEN3_5_VOCAB, QWEN3_5_FIRST_SPECIAL)}
TINY_VL_LAYERS = {"qwen3_vl": 2, "qwen3_vl_moe": 2, "qwen3_5": 4, "qwen3_5_moe": 4}
TINY_VL_NAMES = {family: f"temper/tiny-{family.replace('_', '-')}" for family in TINY_VL_FAMILIES}
