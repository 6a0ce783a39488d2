"""Tasks: data only. The Task protocol, the registry, and one module per task family.

`make_task("modular_addition", p=113)` builds a task by registry name; `task_names()`
lists them. Tasks never import a model.
"""

from phasewatch.tasks.base import Batch, Task, make_task, register_task, task_class, task_names
from phasewatch.errors import ConfigError
from phasewatch.tasks.digit_addition import DigitAddition
from phasewatch.tasks.induction import Induction
from phasewatch.tasks.modular_addition import ModularAddition
from phasewatch.tasks.rasp import RaspTask

__all__ = [
    "Batch", "ConfigError", "DigitAddition", "Induction", "ModularAddition", "RaspTask", "Task",
    "make_task", "register_task", "task_class", "task_names",
]
