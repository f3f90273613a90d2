"""Where the model runner is documented to live; it is ``scheduler.model.runner`` now, with the rest of the model."""

from scheduler.model.runner import ModelRunner

__all__ = ["ModelRunner"]
