"""The xgrammar backend: the backend and its grammar objects, the rules it adds to JSON schemas, its fork server and
what its compiled grammars cost to export.
"""
