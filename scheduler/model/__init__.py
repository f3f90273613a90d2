"""The exact runner's model: a Llama-style forward on our batch-invariant CPU kernels (``cpu_kernels``), its loader,
its KV cache, and the runner the loop calls."""
