"""Probes: pure measurements (model, task) -> named values. No Lightning, no wandb.

Importing this package registers every probe: `grokking` (probes/grokking.py),
`composition` (probes/composition.py), `heads` (probes/heads.py), `digit_tokens`
(probes/digits.py), `llc` (probes/llc.py), `ablation` (probes/ablation.py) and `tracr`
(probes/tracr.py, the comparison with tracr's compiled model), each with the
declaration of what its metric keys mean (probes/keys.py); then the probes of installed
plug-ins (entry points in the group `phasewatch.probes`, phasewatch/plugins.py).
"""

from phasewatch.plugins import load_entry_points
from phasewatch.probes import grokking, digits, heads, composition, tracr, llc, ablation  # noqa: F401,I001  (registration, in the order of the report's panels)
from phasewatch.probes.keys import KeyFamilies, Panel
from phasewatch.probes.registry import Probe, check_options, default_probes, get_probe, probe_names, register_probe

__all__ = ["KeyFamilies", "Panel", "Probe", "check_options", "default_probes", "get_probe", "probe_names",
           "register_probe"]

load_entry_points("phasewatch.probes")
