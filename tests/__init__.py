"""The test suite: ``unit/`` (pure logic, kernels, registry), ``backends/`` (each grammar engine against real
tokenizers, conformance), ``serving/`` (model runner, scheduler, HTTP API on the real model), ``distributed/``
(several ranks over gloo). Shared helpers live in ``tests/helpers.py``; fixtures in ``tests/conftest.py``."""
