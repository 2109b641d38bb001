"""Multi-adapter LoRA: one pass over the base model where every row uses its own adapter."""
