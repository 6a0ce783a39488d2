"""Build what a config file describes, without the CLI: for the benchmarks' baselines."""

from __future__ import annotations

import yaml

from phasewatch.models import ModelConfig
from phasewatch.tasks import task_class, task_names
from phasewatch.trainers.module import TrainModule


def build_from_config(path: str) -> tuple[dict, TrainModule]:
    """The parsed YAML and a TrainModule (task and model) built from its data and model sections."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    classes = {c.__name__: c for c in map(task_class, task_names())}
    task_cfg = cfg["data"]["task"]
    task = classes[task_cfg["class_path"].rsplit(".", 1)[-1]](**task_cfg.get("init_args", {}))
    model_args = dict(cfg.get("model", {}))
    return cfg, TrainModule(task=task, arch=ModelConfig(**model_args.pop("arch", {})), **model_args)


def fit_with_callback(argv: list[str], callback) -> int:
    """`phasewatch fit ARGV` with one more Lightning callback on its Trainer (the benchmarks'
    clocks); its exit status."""
    from phasewatch.trainers import cli, lightning_cli

    original = lightning_cli.PhasewatchCLI.instantiate_trainer

    def with_callback(self, **kwargs):
        trainer = original(self, **kwargs)
        trainer.callbacks.append(callback)
        return trainer

    lightning_cli.PhasewatchCLI.instantiate_trainer = with_callback
    try:
        return cli.main(["fit", *argv])
    finally:
        lightning_cli.PhasewatchCLI.instantiate_trainer = original
