"""JSON schemas and grammar texts before an engine sees them: supported features, soundness rewrites, whitespace
rules, string formats and patterns, and Lark grammars.
"""
