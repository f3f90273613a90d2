"""The shortest ending of a constrained output from a grammar's current state: a search over the grammar contract,
and the exact answer where the engine exposes its state.
"""
