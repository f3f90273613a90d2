"""The llguidance backend, and xgrammar's structural tags written as llguidance Lark grammars."""
