"""An offline image dataset for tinker-cookbook's `recipes.vlm_classifier`, and the small wrapper that
registers it in the recipe's tables (`data.DATASETS`, `eval.EVALUATORS`) before running the recipe's own
entry points unchanged.

The dataset is an imagefolder (``<root>/{train,test}/<colour>/*.png``) of filled shapes (circles,
squares, triangles at random places and sizes) whose class is their colour, on a light background
with a little noise. The recipe's `datasets.load_dataset(<root>)` reads it as an imagefolder with a
`ClassLabel` per colour.

    python tests/stack/vlm_shapes.py make <root>                   # write the dataset
    TEMPER_SHAPES_DIR=<root> python tests/stack/vlm_shapes.py train key=value ...   # recipes.vlm_classifier.train
    TEMPER_SHAPES_DIR=<root> python tests/stack/vlm_shapes.py eval key=value ...    # recipes.vlm_classifier.eval
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 210, 20)}
DATASET = "shapes"


def make_dataset(root: Path, train_per_class: int = 32, test_per_class: int = 8, size: int = 64, seed: int = 0) -> Path:
    """Write the imagefolder (idempotent for the same arguments)."""
    from PIL import Image, ImageDraw

    root = Path(root)
    rng = random.Random(seed)
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for colour, rgb in COLOURS.items():
            folder = root / split / colour
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                shade = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in rgb)
                image = Image.new("RGB", (size, size), tuple(rng.randint(225, 255) for _ in range(3)))
                draw = ImageDraw.Draw(image)
                extent = rng.randint(size * 5 // 8, size - 4)
                x, y = rng.randint(0, size - extent), rng.randint(0, size - extent)
                box = (x, y, x + extent, y + extent)
                shape = rng.choice(("circle", "square", "triangle"))
                if shape == "circle":
                    draw.ellipse(box, fill=shade)
                elif shape == "square":
                    draw.rectangle(box, fill=shade)
                else:
                    draw.polygon([(x, y + extent), (x + extent, y + extent), (x + extent // 2, y)], fill=shade)
                image.save(folder / f"{i:03d}.png")
    return root


def _register(root: str) -> None:
    """Adds DATASET to the recipe's dataset and evaluator tables, built as its own builders are."""
    import chz
    from tinker_cookbook.recipes.vlm_classifier import data, eval as recipe_eval
    from tinker_cookbook.renderers import TrainOnWhat

    @chz.chz
    class ShapesDatasetBuilder(data.SupervisedDatasetBuilder):
        model_name_for_tokenizer: str
        renderer_name: str
        num_repeats: float = 1
        batch_size: int = 32
        max_length: int = 8192
        train_on_what: TrainOnWhat | None = None
        examples_per_class: int | None = None
        subset_seed: int = 0
        max_image_size: int = 480
        run_nll_evaluator: bool = False

        def __call__(self):
            common = dict(dataset=root, image_column_name="image", label_column_name="label",
                          renderer_name=self.renderer_name, model_name_for_tokenizer=self.model_name_for_tokenizer,
                          batch_size=self.batch_size, max_length=self.max_length,
                          train_on_what=self.train_on_what or TrainOnWhat.LAST_ASSISTANT_MESSAGE,
                          max_image_size=self.max_image_size)
            train = data.ClassifierDataset(data.ClassifierDatasetConfig(
                dataset_split="train", num_repeats=self.num_repeats, examples_per_class=self.examples_per_class,
                subset_seed=self.subset_seed, hflip_probability=0.5, **common))
            if not self.run_nll_evaluator:
                return train, None
            return train, data.ClassifierDataset(data.ClassifierDatasetConfig(dataset_split="test", hflip_probability=0.0,
                                                                              **common))

    @chz.chz
    class ShapesEvaluatorBuilder:
        model_name_for_tokenizer: str
        renderer_name: str
        temperature: float = 0.0
        max_tokens: int = 128
        top_p: float = 1.0
        top_k: int = -1
        n_eval: int | None = None
        max_parallel_tasks: int = 128
        max_image_size: int = 480

        def __call__(self):
            return recipe_eval.ClassifierEvaluator(recipe_eval.ClassifierEvaluatorConfig(
                dataset=root, dataset_split="test", renderer_name=self.renderer_name,
                model_name_for_tokenizer=self.model_name_for_tokenizer, temperature=self.temperature,
                max_tokens=self.max_tokens, top_p=self.top_p, top_k=self.top_k, image_column_name="image",
                label_column_name="label", n_eval=self.n_eval, max_parallel_tasks=self.max_parallel_tasks,
                max_image_size=self.max_image_size))

    data.DATASETS[DATASET] = ShapesDatasetBuilder
    recipe_eval.EVALUATORS[DATASET] = ShapesEvaluatorBuilder


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    if command == "make":
        print(make_dataset(Path(rest[0])))
        return 0
    _register(os.environ["TEMPER_SHAPES_DIR"])
    import chz

    if command == "train":
        from tinker_cookbook.recipes.vlm_classifier import train

        # the recipe's augmentation (a horizontal flip with probability 0.5) draws from Python's global
        # random, unseeded: seeded here, so the data a run trains on, and its accuracy, repeat
        random.seed(0)

        train.run_experiment(chz.entrypoint(train.ExperimentConfig, argv=rest))
    elif command == "eval":
        from tinker_cookbook.recipes.vlm_classifier import eval as recipe_eval

        chz.nested_entrypoint(recipe_eval.run_eval, argv=rest)
    else:
        raise SystemExit(f"unknown command {command!r}: make, train or eval")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
