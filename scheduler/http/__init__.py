"""The OpenAI-compatible HTTP frontend (and SGLang's ``/generate``): a process of its own, talking to the
scheduler over zmq. It never imports the loop, the model or torch."""
