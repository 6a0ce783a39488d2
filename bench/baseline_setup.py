"""Build what a config file describes, without the CLI: for the benchmarks' baselines."""

from __future__ import annotations

import yaml

from phasewatch.tasks import task_class, task_names
from phasewatch.trainers.model import ModelConfig
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
