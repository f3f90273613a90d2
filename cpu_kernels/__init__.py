"""The exact model runner's own CPU kernels: batch-invariant matmuls over packed weights, attention over a token KV
pool, RMSNorm, the gated activations, soft-capping and whole decoder layers, in C++ (``csrc/``, one header per
concern; ``csrc/cpu_kernels.cpp``'s header states the mechanism) called through ctypes.

Why our own kernels: a BLAS picks its kernel per shape, CPU and thread count, and a float32 row's rounding changes
with it (MKL on an Intel Xeon takes another kernel from 16 rows on; on an AMD EPYC rows 1 and 2-3 differ). Here
every output element is one fixed chain of fused multiply-adds whatever shares the call, so a token's logits are
bit for bit the same alone, in any batch, beside drafts or a long prompt, on any thread count, and the AVX-512,
AVX2 and scalar builds agree with each other too.

The modules: ``build`` (compiling once per machine, per instruction set), ``library`` (loading, the entry points'
signatures, the thread count), ``structs`` (the C++ structs in ctypes), ``packed_weights`` (formats, packing,
stacks), ``ops`` (one kernel a call), ``decoder`` (every layer in one call), ``cpu_info`` (the CPU's model and flags).

The same library holds the grammar's mask loop and the sampler's draws (``csrc/mask_logits.h``,
``csrc/sampling_noise.h``), which run on its thread pool; their Python sides are ``triton_ops.bitmask_cpu`` and
``triton_ops.sampling_noise``, above this package.
"""
