"""Probes: pure measurements (model, task) -> named values. No Lightning, no wandb.

Importing this package registers every probe: `grokking` (probes/fourier.py),
`composition` (probes/composition.py), `heads` (probes/heads.py), `digit_tokens`
(probes/digits.py), `llc` (probes/llc.py), `ablation` (probes/ablation.py) and `tracr`
(probes/tracr_match.py, the comparison with tracr's compiled model).
"""

from phasewatch.probes import ablation, composition, digits, fourier, heads, llc, tracr_match  # noqa: F401  (registration)
from phasewatch.probes.registry import Probe, check_options, default_probes, get_probe, probe_names, register_probe

__all__ = ["Probe", "check_options", "default_probes", "get_probe", "probe_names", "register_probe"]
