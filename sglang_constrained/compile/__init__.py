"""Where grammars compile: the service (slots, deadlines, in-flight deduplication), compile processes and fork
servers, and the identity that names a compiled grammar across processes and restarts.
"""
