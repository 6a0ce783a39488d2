"""A bridge's native model without the bridge: `plain_twin(model)` is TransformerLens's plain
`NativeModel` built again from the bridge's config (no hook points, no bridge components around
its modules), for passes that supply every parameter (`call_with`) and read no hook: the
vectorised step of a population and of a member re-run alone. Its parameter names are the
bridge's native module's without `._original_component` (`plain_twin`'s second value maps
them). It computes what the bridge computes, but rounds otherwise in places (reverse's key
biases' gradients, zero in exact arithmetic), so a pass to be repeated bit for bit must be
run through the twin both times. Any other model is its own twin."""

from __future__ import annotations

import copy

import torch

from phasewatch.models.factory import native_module

_KEPT = "_phasewatch_plain_twin"  # in the bridge's __dict__: kept, not registered as a submodule


def plain_twin(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, str]]:
    """(the twin, {the native module's parameter name: the twin's}), built once per model
    (without touching the global random state) and kept on it (a deep copy carries its own);
    (the native module, names unchanged) where the model is not a bridge around a
    `NativeModel` or the twin's names do not match."""
    native = native_module(model)
    kept = model.__dict__.get(_KEPT)
    if kept is None:
        kept = model.__dict__[_KEPT] = _build(native)
    twin, names = kept
    device = next(native.parameters()).device
    if next(twin.parameters()).device != device:  # the bridge moved since (buffers such as the causal mask)
        twin.to(device)
    return twin, names


def _build(native: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, str]]:
    from transformer_lens.model_bridge.sources.native import NativeModel

    same = (native, {name: name for name, _ in native.named_parameters()})
    if type(native) is not NativeModel:
        return same
    with torch.random.fork_rng(devices=[]):
        twin = NativeModel(copy.deepcopy(native.cfg))
    names = {name: name.replace("._original_component", "") for name, _ in native.named_parameters()}
    shapes = {name: p.shape for name, p in twin.named_parameters()}
    if sorted(names.values()) != sorted(shapes) or any(
            shapes[names[name]] != p.shape for name, p in native.named_parameters()):
        return same
    param = next(native.parameters())
    return twin.to(device=param.device, dtype=param.dtype), names
