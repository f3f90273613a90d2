"""Where the model runner is documented to live; it is ``scheduler.model.runner`` now, with the rest of the model
(the contract every runner fulfils: ``scheduler.model.runner_contract``)."""

from scheduler.model.runner import ModelRunner
from scheduler.model.runner_contract import BaseModelRunner

__all__ = ["BaseModelRunner", "ModelRunner"]
