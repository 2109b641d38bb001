"""The colour task's pictures and its answers: one filled shape (circle, square or triangle, at a random place
and size, in a shade of one of six colours) on a light, slightly noisy background, 64 x 64. Generated from a
seed, no files."""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

COLOURS = {"red": (215, 35, 35), "green": (35, 165, 50), "blue": (40, 70, 215), "yellow": (230, 205, 30),
           "purple": (135, 45, 170), "orange": (240, 135, 20)}
ANSWERS = tuple(COLOURS)
SIZE = 64


@dataclass(frozen=True)
class Example:
    png: bytes
    answer: str


def make_examples(count: int, seed: int) -> list[Example]:
    """``count`` examples, the colours in turn (balanced), each picture drawn from ``seed``."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    examples = []
    for i in range(count):
        answer = ANSWERS[i % len(ANSWERS)]
        shade = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLOURS[answer])
        image = Image.new("RGB", (SIZE, SIZE), tuple(rng.randint(220, 255) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        extent = rng.randint(SIZE // 2, SIZE - 4)
        x, y = rng.randint(0, SIZE - extent), rng.randint(0, SIZE - extent)
        shape = rng.choice(("circle", "square", "triangle"))
        if shape == "circle":
            draw.ellipse((x, y, x + extent, y + extent), fill=shade)
        elif shape == "square":
            draw.rectangle((x, y, x + extent, y + extent), fill=shade)
        else:
            draw.polygon([(x, y + extent), (x + extent, y + extent), (x + extent // 2, y)], fill=shade)
        out = io.BytesIO()
        image.save(out, "PNG")
        examples.append(Example(out.getvalue(), answer))
    rng.shuffle(examples)
    return examples
