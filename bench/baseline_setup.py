"""Build what a config file describes, without the CLI: for the benchmarks' baselines."""

from __future__ import annotations

import yaml

from phasewatch.training.lightning_cli import instantiate_config
from phasewatch.training.module import TrainModule


def build_from_config(path: str) -> tuple[dict, TrainModule]:
    """The parsed YAML and a TrainModule (task and model) built from it by fit's own parser."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    return cfg, instantiate_config(cfg, path).model


def fit_with_callback(argv: list[str], callback) -> int:
    """`phasewatch fit ARGV` with one more Lightning callback on its Trainer (the benchmarks'
    clocks); its exit status."""
    from phasewatch.cli import main as cli
    from phasewatch.training import lightning_cli

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
