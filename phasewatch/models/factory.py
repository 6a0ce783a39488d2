"""The model factory: `ModelConfig`, `build_model` (`one_build`: a bridge's construction paid
once for many models of one architecture), a fresh copy of a model's architecture
(`fresh_like`), and the plain PyTorch module inside a bridge (`native_module`).

Models are TransformerLens 4 bridges built with `TransformerBridge.boot_native` from a
`ModelConfig`, with the usual hooks (`blocks.L.attn.hook_pattern`, ...) and weight views
(`W_E`, `W_Q`, `W_U`, ...). Unset fields (None) take the task's default
(`Task.default_model()`), then the generic defaults below.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import dataclasses
import re
import types
import weakref
from collections import OrderedDict
from typing import Any, Iterator

import torch

from phasewatch.tasks.base import Task, require, require_int
from phasewatch.errors import ConfigError

ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu", "solu")
NORMALIZATIONS = ("none", "LN", "LNPre", "RMS", "RMSPre")
ATTENTION = ("causal", "bidirectional")

GENERIC_DEFAULTS: dict[str, Any] = dict(
    n_layers=2, d_model=128, n_heads=4, d_head=None, d_mlp=None, attn_only=False, act_fn="relu",
    normalization="none", attention="causal", n_ctx=None, attn_bias=True, seed=None,
)


@dataclasses.dataclass
class ModelConfig:
    """Architecture of the trained transformer. None means "the task's default".

    Attributes:
        n_layers, d_model, n_heads: depth and width.
        d_head: per-head width (default d_model // n_heads).
        d_mlp: MLP width (default 4 * d_model); ignored when attn_only.
        attn_only: no MLP layers.
        act_fn: one of relu, gelu, gelu_new, silu, solu.
        normalization: none, LN, LNPre, RMS or RMSPre.
        attention: causal or bidirectional.
        n_ctx: context length (default: the task's longest input).
        attn_bias: learn biases in the attention (False keeps them at zero, as in
            Nanda et al. 2023, whose model has biases only in the MLP).
        seed: weight-initialisation seed (default: drawn from the global seed).
    """

    n_layers: int | None = None
    d_model: int | None = None
    n_heads: int | None = None
    d_head: int | None = None
    d_mlp: int | None = None
    attn_only: bool | None = None
    act_fn: str | None = None
    normalization: str | None = None
    attention: str | None = None
    n_ctx: int | None = None
    attn_bias: bool | None = None
    seed: int | None = None

    def resolve(self, task: Task) -> "ModelConfig":
        """A copy with every unset field filled from the task and the generic defaults,
        checked against the task. Raises ConfigError naming the field and the fix."""
        values = {**GENERIC_DEFAULTS, **task.default_model()}
        values.update({k: v for k, v in dataclasses.asdict(self).items() if v is not None})
        for field in ("n_layers", "d_model", "n_heads"):
            require_int(values[field], f"model.arch.{field}", 1)
        if values["d_head"] is None:
            require(values["d_model"] % values["n_heads"] == 0, "model.arch.n_heads",
                    f"d_model {values['d_model']} is not divisible by n_heads {values['n_heads']}",
                    "Set d_head explicitly or choose n_heads dividing d_model.")
            values["d_head"] = values["d_model"] // values["n_heads"]
        require_int(values["d_head"], "model.arch.d_head", 1)
        if values["d_mlp"] is None:
            values["d_mlp"] = 4 * values["d_model"]
        require_int(values["d_mlp"], "model.arch.d_mlp", 1)
        require(values["act_fn"] in ACTIVATIONS, "model.arch.act_fn", f"unknown activation {values['act_fn']!r}",
                f"Use one of {', '.join(ACTIVATIONS)}.")
        require(values["normalization"] in NORMALIZATIONS, "model.arch.normalization",
                f"unknown normalization {values['normalization']!r}", f"Use one of {', '.join(NORMALIZATIONS)}.")
        require(values["attention"] in ATTENTION, "model.arch.attention",
                f"unknown attention direction {values['attention']!r}", f"Use one of {', '.join(ATTENTION)}.")
        if values["attention"] == "causal" and not task.causal:
            raise ConfigError(
                "model.arch.attention",
                f"the task ({task.name}) reads later positions, which causal attention cannot see",
                "Use attention: bidirectional (the default for this task).",
            )
        if values["n_ctx"] is None:
            values["n_ctx"] = task.n_ctx
        require_int(values["n_ctx"], "model.arch.n_ctx", 1)
        require(values["n_ctx"] >= task.n_ctx, "model.arch.n_ctx",
                f"context {values['n_ctx']} is shorter than the task's inputs ({task.n_ctx} tokens)",
                f"Set n_ctx >= {task.n_ctx} or leave it unset.")
        if values["seed"] is not None:
            require_int(values["seed"], "model.arch.seed", 0, "Use a seed >= 0, or leave it unset.")
        for flag in ("attn_only", "attn_bias"):
            require(isinstance(values[flag], bool), f"model.arch.{flag}", f"must be true or false, got {values[flag]!r}",
                    f"Set {flag}: true or false.")
        return ModelConfig(**values)


def build_model(cfg: ModelConfig, task: Task) -> torch.nn.Module:
    """A freshly initialised TransformerBridge for `task` (cfg is resolved first)."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge
    import transformer_lens.model_bridge.sources.native  # noqa: F401  (attaches boot_native)

    c = cfg.resolve(task)
    bridge_cfg = TransformerBridgeConfig(
        d_model=c.d_model, d_head=c.d_head, n_layers=c.n_layers, n_ctx=c.n_ctx, n_heads=c.n_heads,
        d_vocab=task.d_vocab, d_vocab_out=task.d_vocab_out, d_mlp=c.d_mlp, act_fn=c.act_fn,
        normalization_type=None if c.normalization == "none" else c.normalization, attn_only=c.attn_only,
        attention_dir=c.attention, seed=c.seed, tokenizer_prepends_bos=False,
    )
    key = (*dataclasses.astuple(c), task.d_vocab, task.d_vocab_out, torch.get_default_dtype())
    built = _BUILT[-1] if _BUILT and c.seed is None else None  # (a seeded build forks the RNG: built alone)
    if built is not None and built.get(key) is not None:
        model = _drawn_copy(built[key], bridge_cfg)
    else:
        state = torch.get_rng_state() if built is not None and key not in built else None
        model = TransformerBridge.boot_native(bridge_cfg)
        if state is not None:
            built[key] = _template(model, bridge_cfg, state)
    if not c.attn_bias:
        for block in model.original_model.layers:
            for proj in (block.attn.q, block.attn.k, block.attn.v, block.attn.o):
                torch.nn.init.zeros_(proj.bias)
                proj.bias.requires_grad_(False)
    return model


#: `one_build`'s bridges by architecture, innermost last
_BUILT: list[dict[tuple, torch.nn.Module]] = []


@contextlib.contextmanager
def one_build() -> Iterator[None]:
    """Within it, `build_model` constructs a bridge once per architecture (its scan of hook
    points and components: most of a small model's build, 37 ms of induction_2l's proxy) and
    gives later builds of that architecture a copy of it holding the weights that `boot_native`
    draws at that state of the global RNG (`_drawn_copy`): the same model, bit for bit, as a
    build alone (tests/unit/test_population.py), checked on the first build of each architecture
    (`_template`: where the copy would differ, every model is built alone). For building many
    models, e.g. a population's members (training/population.py). A build with `arch.seed` set
    is built alone."""
    _BUILT.append({})
    try:
        yield
    finally:
        _BUILT.pop()


def _template(model: torch.nn.Module, bridge_cfg: Any, state: torch.Tensor) -> torch.nn.Module | None:
    """A copy of `model`, just built by `boot_native` from the global RNG state `state`, for
    `_drawn_copy` to copy later models from, if `_drawn_copy` gives this very model from that
    state (every tensor bit for bit, the RNG left where `boot_native` left it); else None, and
    every later model of the architecture is built by `boot_native` (a TransformerLens whose
    `boot_native` draws or builds otherwise than `_drawn_copy` repeats: never a different model)."""
    template, after = copy.deepcopy(model), torch.get_rng_state()
    try:
        torch.set_rng_state(state)
        again = _drawn_copy(template, bridge_cfg)
        ours, theirs = native_module(model).state_dict(), native_module(again).state_dict()
        same = (torch.equal(torch.get_rng_state(), after) and ours.keys() == theirs.keys()
                and all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours))
    except (ImportError, AttributeError, RuntimeError, TypeError):
        same = False
    finally:
        torch.set_rng_state(after)
    return template if same else None


def _drawn_copy(template: torch.nn.Module, bridge_cfg: Any) -> torch.nn.Module:
    """A copy of the bridge `template` holding the weights that `boot_native(bridge_cfg)` draws
    now: TransformerLens's native model constructed and initialised as `boot_native` does it
    (its every draw from the global RNG, in the same order), its tensors then copied into the
    copy's own model, matched by name (the bridge wraps each of its model's submodules as
    `_original_component`)."""
    from transformer_lens.model_bridge.sources.native.init import initialize_native_model
    from transformer_lens.model_bridge.sources.native.model import NativeModel

    cfg = copy.deepcopy(bridge_cfg)
    drawn = NativeModel(cfg)
    if cfg.init_weights:
        initialize_native_model(drawn, cfg)
    model = tree_copy(template)
    native = native_module(model)
    own = {_UNWRAPPED.sub("", name): t for name, t in (*native.named_parameters(), *native.named_buffers())}
    fresh = dict((*drawn.named_parameters(), *drawn.named_buffers()))
    params = {_UNWRAPPED.sub("", name) for name, _ in native.named_parameters()}
    if not fresh.keys() <= own.keys() or not params <= fresh.keys():  # (the bridge adds buffers, e.g. head.bias)
        raise RuntimeError("the bridge's model does not hold what TransformerLens builds: "
                           f"{sorted((own.keys() ^ fresh.keys()) - (own.keys() - params - fresh.keys()))}")
    with torch.no_grad():
        for name, tensor in fresh.items():
            own[name].copy_(tensor)
    return model


#: what `copy.deepcopy` returns as it is (its `_deepcopy_atomic` types)
_ATOMIC = frozenset({type(None), int, float, bool, complex, bytes, str, types.CodeType, type, range,
                     types.BuiltinFunctionType, type(Ellipsis), type(NotImplemented), types.FunctionType,
                     weakref.ref, property})


def tree_copy(x: Any) -> Any:
    """`copy.deepcopy(x)`: the same copy (every object copied or kept as deepcopy does, shared
    objects shared alike: tests/unit/test_tree_copy.py), in fewer Python calls for what a bridge
    is mostly made of (about 2,700 objects for the proxy's two layers, half of them modules'
    OrderedDicts of hooks, parameters and submodules): plain dicts, lists, tuples, sets of atoms
    and OrderedDicts without attributes are copied directly, and an object without its own copy
    or reduce protocol is rebuilt from its `__reduce_ex__(4)` as deepcopy's `_reconstruct` does;
    every other object (tensors, bound methods, classes with their own `__deepcopy__`,
    `__reduce__` or copyreg entry) goes to `copy.deepcopy` with the same memo. A member's bridge
    copied in about 55% of deepcopy's time (bench/README.md, population, session 20)."""
    return _copy(x, {})


def _copy(x: Any, memo: dict) -> Any:
    cls = type(x)
    if cls in _ATOMIC:
        return x
    d = id(x)
    y = memo.get(d, memo)
    if y is not memo:
        return y
    if cls is dict or (cls is OrderedDict and not vars(x)):
        y = cls()
        memo[d] = y
        for k, v in x.items():  # (atoms, mostly the keys, kept without a call)
            y[k if type(k) in _ATOMIC else _copy(k, memo)] = v if type(v) in _ATOMIC else _copy(v, memo)
    elif cls is list:
        y = []
        memo[d] = y
        y.extend(v if type(v) in _ATOMIC else _copy(v, memo) for v in x)
    elif cls is set and all(type(v) in _ATOMIC for v in x):  # (a module's `_non_persistent_buffers_set`)
        y = set(x)
        memo[d] = y
    elif cls is tuple:  # as copy's _deepcopy_tuple: the same tuple where every item is kept
        items = [_copy(v, memo) for v in x]
        if d in memo:
            return memo[d]
        y = tuple(items) if any(a is not b for a, b in zip(x, items)) else x
        memo[d] = y
    elif (cls in copy._deepcopy_dispatch or issubclass(cls, type) or cls in copyreg.dispatch_table
          or getattr(x, "__deepcopy__", None) is not None or isinstance(x, (dict, list, set))):
        return copy.deepcopy(x, memo)
    else:
        rv = x.__reduce_ex__(4)
        if isinstance(rv, str):
            return copy.deepcopy(x, memo)
        y = _reconstruct(x, memo, *rv)
    memo.setdefault(id(memo), []).append(x)  # (deepcopy's _keep_alive)
    return y


def _reconstruct(x: Any, memo: dict, func, args, state=None, listiter=None, dictiter=None) -> Any:
    """copy's `_reconstruct` (deep), copying through `_copy`."""
    y = func(*(_copy(args, memo) if args else args))
    memo[id(x)] = y
    if state is not None:
        state = _copy(state, memo)
        if hasattr(y, "__setstate__"):
            y.__setstate__(state)
        else:
            state, slots = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
            if state is not None:
                y.__dict__.update(state)
            for key, value in (slots or {}).items():
                setattr(y, key, value)
    for item in listiter or ():
        y.append(_copy(item, memo))
    for key, value in dictiter or ():
        key = _copy(key, memo)  # the key first, as copy's _reconstruct
        y[key] = _copy(value, memo)
    return y


_UNWRAPPED = re.compile(r"\._original_component(?=\.|$)|^_original_component\.")


def fresh_like(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A newly initialised bridge of `model`'s architecture (a copy of its config with
    weight seed `seed`), built without touching the global RNG."""
    from transformer_lens.model_bridge import TransformerBridge
    import transformer_lens.model_bridge.sources.native  # noqa: F401  (attaches boot_native)

    cfg = copy.copy(model.cfg)
    cfg.seed = seed
    with torch.random.fork_rng():
        return TransformerBridge.boot_native(cfg)


def native_module(model: torch.nn.Module) -> torch.nn.Module:
    """The plain PyTorch module inside a bridge (no hooks): use it where hooks are not
    needed and speed matters (the training step). Any other module is returned as it is."""
    return getattr(model, "original_model", model)


def eval_mode(*models: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """Every module of `models` in eval mode, as `model.eval()` leaves them (a bridge's own
    model too: not a registered submodule, its `train` reaches it), each set once; returns each
    module's mode before, for `restore_modes`. `nn.Module.train` visits a bridge's modules along
    every path that reaches them (over 400 visits of under 100 modules; bench/README.md, fit_speed)."""
    modules: set[torch.nn.Module] = set()
    for root in (root for model in models for root in (model, native_module(model))):
        if root not in modules:  # a root already reached was walked with everything below it
            modules.update(root.modules())
    modes = [(module, module.training) for module in modules]
    for module in modules:
        module.training = False
    return modes


def restore_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Each module's mode as `eval_mode` found it."""
    for module, training in modes:
        module.training = training


def _slots(module: torch.nn.Module) -> tuple[list[tuple[torch.nn.Module, str, torch.Tensor]], dict[str, list[str]]]:
    """Every parameter entry of `module`'s submodules once, as (submodule, name, what it holds)
    (a submodule reached under several paths counted once), and for each parameter's name (as
    `named_parameters` names it) the paths of the other entries that hold the same parameter
    (tied weights; None where a name is not the first such path). Walking a bridge's modules
    costs more than a small model's step, so this is kept on the module (a deep copy carries
    its own) and walked again only when an entry no longer holds what it held."""
    kept = module.__dict__.get("_phasewatch_slots")
    if kept is not None and all(sub._parameters.get(name) is held for sub, name, held in kept[0]):
        return kept
    seen: set[tuple[int, str]] = set()
    slots, paths = [], {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, held in sub._parameters.items():
            if held is not None and (id(sub), name) not in seen:
                seen.add((id(sub), name))
                slots.append((sub, name, held))
                paths.setdefault(id(held), []).append(f"{prefix}.{name}" if prefix else name)
    ties = {}
    for name, param in module.named_parameters():
        first, *others = paths[id(param)]
        if first != name:  # not the path `named_parameters` gives: let functional_call untie them
            ties = None
            break
        ties[name] = others
    module.__dict__["_phasewatch_slots"] = kept = (slots, ties)
    return kept


def call_with(module: torch.nn.Module, params: dict[str, torch.Tensor], args: tuple) -> Any:
    """`torch.func.functional_call(module, params, args)` for `params` named as
    `module.named_parameters()` names them, each put once into every entry that holds it: what
    functional_call's `tie_weights` does, without walking the module at every call."""
    from torch.func import functional_call

    _, ties = _slots(module)
    if ties is None or not params.keys() <= ties.keys():
        return functional_call(module, params, args)
    tied = {path: params[name] for name in params for path in ties[name]}
    return functional_call(module, {**params, **tied} if tied else params, args, tie_weights=False)


@contextlib.contextmanager
def parameters_kept(module: torch.nn.Module):
    """Put every parameter entry of every submodule back as it was on leaving. A bridge
    reaches its weights under several module paths, and `torch.func.functional_call` under
    `vmap` leaves the batched stand-ins in some of them (a later plain forward then fails
    with "tensor escaped from inside a function being vmapped")."""
    kept = list(_slots(module)[0])
    try:
        yield
    finally:
        for sub, name, param in kept:
            setattr(sub, name, param)
