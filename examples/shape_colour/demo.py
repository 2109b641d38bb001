"""Images through Temper: LoRA-train a tiny vision-language model to name the colour of a shape.

Starts scheduler, trainer and sampler as separate processes on loopback (SQLite under the data folder) on
a tiny random Qwen3-VL-MoE built from code (services/models/tiny_vision.py; --base-model takes another
vision-language folder), uploads every picture once (``upload_image``: content-addressed, it answers the
image tokens the model makes of it), measures held-out accuracy from the uploaded images
(``ImageAssetPointerChunk`` prompts scored with ``compute_logprobs``: the likeliest of the six answers), trains a LoRA adapter with forward_backward + optim_step on
``ImageChunk`` datums, measures again, writes a loss-curve PNG and metrics JSONL, and prints a final
JSON line; the trained model's greedy replies go to heldout_predictions.jsonl. A few minutes on two CPU cores.

    python -m examples.shape_colour.demo
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from examples.shape_colour.data import ANSWERS, make_examples
from recipes.common import end_token_id, plot_panels
from temper.client import AdamParams, Datum, EncodedTextChunk, ImageChunk, ModelInput, SamplingParams
from temper.localstack import LocalStack

QUESTION = "What colour is the shape? Answer " + ", ".join(ANSWERS[:-1]) + " or " + ANSWERS[-1] + "."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-model", default="", help="a vision-language model folder (default: build the tiny one)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--train", type=int, default=192, help="training pictures")
    p.add_argument("--heldout", type=int, default=32, help="held-out pictures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("runs/shape_colour"))
    p.add_argument("--data-dir", type=Path, default=Path("data/shape_colour"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per service")
    return p.parse_args(argv)


class Renderer:
    """The chat template's tokens around the picture: the template renders an image part as
    <|vision_start|><|image_pad|><|vision_end|>, and the one image-pad token becomes the ImageChunk
    (the server expands it into the image's N tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.end = end_token_id(tokenizer)

    def prompt(self) -> tuple[list[int], list[int]]:
        """(tokens before the image, tokens after it, up to the assistant's turn)."""
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        at = ids.index(self.image_token)
        return ids[:at], ids[at + 1:]

    def answer(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(" " + text, add_special_tokens=False)) + [self.end]

    def sft_datum(self, image: ImageChunk, answer: str) -> Datum:
        """Next-token datum: the image's N positions and the prompt carry weight 0, the answer 1."""
        before, after = self.prompt()
        reply = self.answer(answer)
        n = image.expected_tokens
        flat = before + [self.image_token] * n + after + reply  # the sequence as the model sees it
        weights = np.zeros(len(flat) - 1, np.float32)
        weights[len(flat) - 1 - len(reply):] = 1.0
        model_input = ModelInput([EncodedTextChunk(before), image, EncodedTextChunk((after + reply)[:-1])])
        return Datum(model_input, {"target_tokens": np.asarray(flat[1:], np.int64), "weights": weights})


def evaluate(sampler, renderer: Renderer, pointers, answers, desc: str) -> tuple[float, list[str]]:
    """Held-out accuracy by likelihood: the answer whose tokens the model scores highest after the prompt
    (``compute_logprobs`` over the prompt with the picture and each candidate: chance is 1/6 before training)."""
    before, after = renderer.prompt()
    candidates = [renderer.answer(answer) for answer in ANSWERS]
    futures = [[sampler.compute_logprobs(ModelInput([EncodedTextChunk(before), pointer, EncodedTextChunk(after + reply)]),
                                         prompt_logprobs_last_n=len(reply)) for reply in candidates]
               for pointer in pointers]  # all submitted before any wait: the sampler batches them
    chosen = []
    for per_answer in tqdm(futures, desc=desc, unit="picture", leave=False):
        scores = [sum(f.result()[-len(reply):]) for f, reply in zip(per_answer, candidates)]
        chosen.append(ANSWERS[int(np.argmax(scores))])
    return float(np.mean([c == a for c, a in zip(chosen, answers)])), chosen


def greedy_replies(sampler, renderer: Renderer, pointers) -> list[str]:
    """What the model writes when asked (greedy), for the predictions file."""
    before, after = renderer.prompt()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    futures = [sampler.sample(ModelInput([EncodedTextChunk(before), pointer, EncodedTextChunk(after)]), 1, params)
               for pointer in pointers]
    return [renderer.tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True).strip() for f in futures]


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base_model = args.base_model
    if not base_model:
        from temper.services.models.tiny_vision import build_tiny_vl_model

        base_model = str(build_tiny_vl_model(args.data_dir / "tiny-qwen3-vl-moe", "qwen3_vl_moe").resolve())
    train = make_examples(args.train, args.seed)
    heldout = make_examples(args.heldout, args.seed + 1)
    rng = random.Random(args.seed)

    with LocalStack(base_model, args.data_dir / time.strftime("%Y%m%d-%H%M%S"), num_threads=args.threads) as stack:
        print("starting scheduler, trainer and sampler ...", file=sys.stderr)
        stack.start()
        with stack.client() as client:
            training = client.create_lora_training_client(base_model, rank=args.rank, seed=args.seed)
            renderer = Renderer(training.get_tokenizer())
            # every picture uploaded once: the server answers its image tokens (N) and a pointer to it
            assets = [client.upload_image(ex.png, base_model=base_model)
                      for ex in tqdm(train + heldout, desc="upload", unit="picture", leave=False)]
            train_assets, heldout_assets = assets[:len(train)], assets[len(train):]
            heldout_answers = [ex.answer for ex in heldout]
            base_sampler = client.create_sampling_client(base_model=base_model)
            pointers = [a.pointer() for a in heldout_assets]
            before, _ = evaluate(base_sampler, renderer, pointers, heldout_answers, "eval before")

            data = [renderer.sft_datum(ImageChunk(ex.png, "png", asset.expected_tokens), ex.answer)
                    for ex, asset in zip(train, train_assets)]
            adam = AdamParams(learning_rate=args.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
            losses, order = [], []
            with open(args.out_dir / "metrics.jsonl", "w") as log, tqdm(total=args.steps, desc="train", unit="step") as bar:
                for step in range(args.steps):
                    if len(order) < args.batch_size:
                        order += rng.sample(range(len(data)), len(data))  # reshuffled each epoch
                    batch, order = order[:args.batch_size], order[args.batch_size:]
                    fb = training.forward_backward([data[i] for i in batch], "cross_entropy")
                    opt = training.optim_step(adam)  # submitted before waiting: the same scheduler cycle
                    loss = fb.result().metrics["loss:sum"]
                    opt.result()
                    losses.append(loss)
                    log.write(json.dumps({"step": step + 1, "loss": loss,
                                          "elapsed_s": round(time.monotonic() - started, 1)}) + "\n")
                    bar.set_postfix(loss=f"{loss:.3f}")
                    bar.update()
            trained = training.save_weights_and_get_sampling_client("colour-final")
            after, chosen = evaluate(trained, renderer, pointers, heldout_answers, "eval after")
            replies = greedy_replies(trained, renderer, pointers)
    with open(args.out_dir / "heldout_predictions.jsonl", "w") as f:
        f.writelines(json.dumps({"answer": a, "chosen": c, "greedy_reply": r}) + "\n"
                     for a, c, r in zip(heldout_answers, chosen, replies))

    plot_panels(args.out_dir / "loss.png",
                f"Shape colour, tiny Qwen3-VL-MoE + LoRA: held-out accuracy {before:.2f} → {after:.2f}",
                [{"ylabel": "cross-entropy on the answer (sum over batch)",
                  "series": [("loss per step", range(1, len(losses) + 1), losses)]}])
    summary = {"accuracy_before": round(before, 4), "accuracy_after": round(after, 4),
               "chance": round(1 / len(ANSWERS), 4), "answers": list(ANSWERS),
               "steps": args.steps, "train": len(train), "heldout": len(heldout),
               "image_tokens": train_assets[0].expected_tokens, "loss_first": round(losses[0], 4),
               "loss_last": round(losses[-1], 4), "seconds": round(time.monotonic() - started, 1),
               "plot": str(args.out_dir / "loss.png")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
