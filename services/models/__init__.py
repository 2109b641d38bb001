"""Base-model resolution: the embedded SmolLM2 default, a tiny test model, or any local/HF path."""
