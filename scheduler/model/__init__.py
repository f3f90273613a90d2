"""The model: a Llama-style forward in plain torch, its loader, its KV cache, and the runner the loop calls."""
