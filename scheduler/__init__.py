"""The constrained-decoding scheduler: server arguments, messages, grammar manager, model runner, loop."""
