"""The one place that knows TransformerLens internals: the model factory, the plain PyTorch
module inside a bridge, its state-dict keys, and the importers of other code's models.

- `factory`: `ModelConfig`, `build_model`, `fresh_like`, `native_module`, `parameters_kept`,
  `call_with` (`torch.func.functional_call` without walking the module each call), `eval_mode` and
  `restore_modes` (every module's mode set once, a bridge's own model included).
- `plain`: `plain_twin`, a bridge's native model built again without the bridge (the vectorised step).
- `components`: named components (`L1H2`, `L0.attn`, ...), their parameters and hooks.
- `paper_checkpoint`: checkpoints of the progress-measures paper's code (Nanda et al. 2023).
- `tracr_convert`: tracr's compiled transformers, converted by TransformerLens, and
  their saved form.
- `compiled`: the compiled reference of a RASP program (checked, described, cached on disk).

Everything else (probes, callbacks, training) reaches TransformerLens only through the
public bridge (`model.cfg`, hooks, weight views such as `W_E`) and these functions.
"""

from phasewatch.models.components import component_parameters, head_label, parse_component, register_component_hook
from phasewatch.models.factory import (ACTIVATIONS, ATTENTION, GENERIC_DEFAULTS, NORMALIZATIONS, ModelConfig,
                                       build_model, call_with, eval_mode, fresh_like, native_module,
                                       parameters_kept, restore_modes)
from phasewatch.models.paper_checkpoint import load_progress_measures_checkpoint, undo_last_adamw_step
from phasewatch.models.tracr_convert import (SAVED_CONFIG_FIELDS, bridge_from_saved, bridge_from_tracr,
                                             layer_output_weights, saved_config)

__all__ = [
    "head_label",
    "ACTIVATIONS", "ATTENTION", "GENERIC_DEFAULTS", "NORMALIZATIONS", "SAVED_CONFIG_FIELDS", "ModelConfig",
    "bridge_from_saved", "bridge_from_tracr", "build_model", "call_with", "component_parameters", "eval_mode",
    "fresh_like", "layer_output_weights", "load_progress_measures_checkpoint", "native_module", "parameters_kept",
    "parse_component", "register_component_hook", "restore_modes", "saved_config", "undo_last_adamw_step",
]
