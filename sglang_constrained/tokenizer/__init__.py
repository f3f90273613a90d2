"""A model's tokenizer and chat template: from a GGUF file (converted once and cached on disk) or a model folder."""
