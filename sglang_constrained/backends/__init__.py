"""The grammar backends: the contract every backend writes (``base``), the registry that names and builds them,
one package per engine (xgrammar, llguidance, outlines), ``auto`` over several engines, and the reasoner that
lets a reasoning model think before its constraint applies.
"""
