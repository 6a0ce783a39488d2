"""Probes: pure measurements (model, task) -> named values. No Lightning, no wandb.

Importing this package registers every probe: `grokking` (probes/fourier.py),
`composition` (probes/composition.py), `heads` (probes/heads.py) and
`digit_tokens` (probes/digits.py).
"""

from phasewatch.probes import composition, digits, fourier, heads, llc  # noqa: F401  (registration)
from phasewatch.probes.registry import Probe, default_probes, get_probe, probe_names, register_probe

__all__ = ["Probe", "default_probes", "get_probe", "probe_names", "register_probe"]
