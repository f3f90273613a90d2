"""The outlines-core backend (a regex DFA over the vocabulary) and the schema rules it needs."""
