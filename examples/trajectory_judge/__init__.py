"""Trajectory-judge demo: SFT a small model to pick the better of two agent attempts.

- ``data``: deterministic generator of judge examples (writes train.jsonl / heldout.jsonl).
- ``render``: chat rendering, SFT token/weight construction and answer parsing.
- ``tune``: in-process LoRA tuning script used to verify learnability and pick hyperparameters.
"""
