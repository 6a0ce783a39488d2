"""Probes: pure measurements (model, task) -> named values. No Lightning, no wandb.

Importing this package registers every probe: `grokking` (probes/fourier.py) and
`digit_tokens` (probes/digits.py).
"""

from phasewatch.probes import digits, fourier  # noqa: F401  (registration)
from phasewatch.probes.registry import Probe, default_probes, get_probe, probe_names, register_probe

__all__ = ["Probe", "default_probes", "get_probe", "probe_names", "register_probe"]
