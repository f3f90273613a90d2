"""What is kept once built: compiled grammars in memory and on disk, a tokenizer's decoded vocabulary in memory and
on disk, and the atomic file writes they share.
"""
