"""What the tests, the benchmarks and the conformance report share, kept off the library's serving surface.

Walking texts through a grammar as decoding does, checking a backend against cases of known answer, reading
MaskBench cases, and the two real tokenizers everything is checked with. Needs the ``test`` extra.
"""
