"""Runnable scripts (``python scripts/<name>.py``): the demo, the benchmarks, the conformance report. Nothing imports
them; what they share lives in ``sglang_constrained.testing``."""
