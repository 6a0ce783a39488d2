"""Build what a config file describes, without the CLI: for the benchmarks' baselines."""

from __future__ import annotations

import yaml

from phasewatch.training.lightning_cli import instantiate_config
from phasewatch.training.module import TrainModule


#: the CPU proxy of a GPU (issue 45): the config's model shrunk until its arithmetic costs
#: almost nothing (d_model 8, one head, batch 2, a held-out set of a few sequences, modulus
#: 13), so that what is timed is the host's work per step; on one thread (a shared machine's
#: busy cores make threads wait). Task arguments apply where the config's task takes them.
PROXY_ARCH = {"d_model": 8, "n_heads": 1, "d_head": 8, "d_mlp": 16}
PROXY_TASK = {"batch_size": 2, "n_val": 8, "n_val_per_length": 2, "p": 13}


def proxy_flags(path: str) -> list[str]:
    """The proxy's command-line flags for `path`'s config."""
    import importlib
    import inspect

    with open(path) as f:
        cfg = yaml.safe_load(f)
    arch = (cfg.get("model") or {}).get("arch") or {}
    flags = [x for key, value in PROXY_ARCH.items() if key != "d_mlp" or not arch.get("attn_only")
             for x in (f"--model.arch.{key}", str(value))]
    class_path = cfg["data"]["task"]["class_path"]
    module, name = class_path.rsplit(".", 1)
    takes = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    return flags + [x for key, value in PROXY_TASK.items() if key in takes
                    for x in (f"--data.task.init_args.{key}", str(value))]


def build_from_config(path: str, flags: list[str] = ()) -> tuple[dict, TrainModule]:
    """The parsed YAML and a TrainModule (task and model) built from it by fit's own parser
    (with `flags`: command-line overrides such as `proxy_flags`)."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    for flag, value in zip(flags[::2], flags[1::2]):
        *parents, key = flag[2:].split(".")
        node = cfg
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = yaml.safe_load(value)
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
