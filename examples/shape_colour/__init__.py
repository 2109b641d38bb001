"""Image example: LoRA-train a tiny vision-language model to name the colour of a shape in a picture."""
