"""A plug-in task: (a - b) mod p, registered under its own name."""

from phasewatch.tasks import ModularAddition, register_task


@register_task("mylab_subtraction")
class ModularSubtraction(ModularAddition):
    def __init__(self, p: int = 13, frac_train: float = 0.5, seed: int = 0):
        super().__init__(p=p, op="-", frac_train=frac_train, seed=seed)
