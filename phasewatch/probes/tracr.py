"""Learned vs compiled: how close is the model being trained to tracr's compiled model of the same
RASP program? (docs/reference.md, "tracr: compiled references"; docs/tracr.md.) Both models read
the same tokens, one batch per input length (at most `per_length` inputs each, so every length
weighs the same). `tracr_probe` measures: behavioural agreement (argmax against the compiled
model's, per length); attention match (`pattern_overlap`, sum_k min(A, S) over queries) of each
compiled head that writes something, for the best learned head and two-head path; variable probes
(`variable_probes`: a linear classifier, "lda" by default, "logistic" or "lstsq", of every
categorical RASP variable at every residual site) beside the same probe on the run's step-0
weights (`initial`, the baseline); linear CKA (Kornblith et al. 2019) between every learned and
every compiled residual site (`cka_matrix`).

Keys `tracr/agreement[/len<n>]`, `tracr/attn_match/<ref head>[/path]`,
`tracr/probe[_baseline]/<variable>/<site>`, `tracr/cka/<site>`; arrays `cka`, `attn_match`,
`match_heads`. ConfigError for a task without a RASP program, a causal model against a
non-causal program, or a program tracr cannot compile.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from phasewatch.models import native_module
from phasewatch.probes.keys import KeyFamilies, Panel
from phasewatch.probes.registry import register_probe
from phasewatch.probes.residual import ResidualPass
from phasewatch.tasks.base import Batch, Task, mask_kwargs, padded
from phasewatch.errors import ConfigError

_REFERENCES: dict[tuple, tuple] = {}
_BASELINES: "weakref.WeakKeyDictionary[Any, dict[tuple, dict[str, float]]]" = weakref.WeakKeyDictionary()
_LABELS: dict[tuple, dict[str, list[Tensor]]] = {}
_REFERENCE_RUNS: dict[tuple, tuple] = {}


# --- measures (pure) -----------------------------------------------------------------

def pattern_overlap(a: Float[Tensor, "... q k"], s: Float[Tensor, "... q k"]) -> Float[Tensor, "..."]:
    """Mean over queries of sum_k min(a, s): 1 for equal patterns, a's mass on the
    target for a one-hot s."""
    return torch.minimum(a, s).sum(-1).mean(-1)


def linear_cka(x: Float[Tensor, "n d1"], y: Float[Tensor, "n d2"]) -> float:
    """Linear CKA of two representations of the same n rows (columns centred here)."""
    (x, nx), (y, ny) = centred(x), centred(y)
    denom = nx * ny
    return float(torch.linalg.matrix_norm(y.T @ x) ** 2 / denom) if denom > 0 else 0.0


def centred(t: Tensor) -> tuple[Tensor, Tensor]:
    """A representation's columns centred (float64) and the Frobenius norm of its Gram matrix:
    what linear CKA needs of each side, computed once per representation. Columns that are
    constant (zero once centred) add nothing to either and are dropped: most of a compiled
    model's residual dimensions at a site are written only later, or never on these inputs."""
    t = (t - t.mean(0)).double()
    if len(t):
        varies = t.abs().amax(0) > 0
        if not varies.all():  # a copy only where a column goes
            t = t[:, varies]
    return t, torch.linalg.matrix_norm(t.T @ t)


class CkaSide(NamedTuple):
    """Representations prepared for `cka_matrix` (`cka_side`): the distinct columns of them all,
    centred (float64), how often each is a column of each representation, and each one's
    Gram-matrix norm."""
    columns: Tensor  # [n, distinct]
    counts: Tensor  # [distinct, representations]
    norms: Tensor  # [representations]


def cka_side(ys: list[Tensor]) -> CkaSide:
    """`ys` `centred` and their columns pooled: a column that several representations share
    (a compiled residual stream keeps what earlier layers wrote, to the last bit) is kept once,
    so `cka_matrix` multiplies by each distinct column once (on the RASP configs, a fifth of them)."""
    prepared = [centred(y) for y in ys]
    if not prepared or not len(prepared[0][0]):  # nothing to compare: every CKA is 0
        return CkaSide(torch.zeros(0, 0, dtype=torch.float64), torch.zeros(0, len(ys), dtype=torch.float64),
                       torch.zeros(len(ys), dtype=torch.float64))
    joined = torch.cat([y for y, _ in prepared], 1)
    owner = torch.repeat_interleave(torch.arange(len(ys)), torch.tensor([y.shape[1] for y, _ in prepared]))
    columns, which = torch.unique(joined, dim=1, return_inverse=True)
    counts = torch.zeros(columns.shape[1], len(ys), dtype=torch.float64)
    counts.index_put_((which, owner), torch.ones(len(owner), dtype=torch.float64), accumulate=True)
    return CkaSide(columns, counts, torch.stack([n for _, n in prepared]))


def cka_matrix(xs: list[Tensor], ys: list[Tensor] | None = None, prepared: CkaSide | None = None) -> Tensor:
    """`linear_cka(x, y)` for every x of `xs` (rows) and y of `ys` (columns); `prepared`
    (`cka_side(ys)`) in place of `ys` when it is kept from an earlier call. One product of the
    ys' distinct columns with every x's: ||Y^T X||_F^2 is the sum over Y's columns c of
    ||c^T X||^2, each distinct c counted as often as Y has it."""
    side = prepared or cka_side(ys)
    px = [centred(x) for x in xs]
    if not px or not len(side.columns):
        return torch.zeros(len(xs), len(side.norms), dtype=torch.float64)
    x_norms = torch.stack([n for _, n in px])
    widths = [x.shape[1] for x, _ in px]
    products = (side.columns.T @ torch.cat([x for x, _ in px], 1)).square()  # [distinct, every x's columns]
    per_x = torch.stack([part.sum(1) for part in products.split(widths, 1)], 1)  # [distinct, xs]
    cross = per_x.T @ side.counts  # [xs, ys]
    denom = x_norms[:, None] * side.norms[None, :]
    return torch.where(denom > 0, cross / denom.clamp_min(1e-300), torch.zeros_like(cross))


def _standardised(x_train: Tensor, x_test: Tensor) -> tuple[Tensor, Tensor]:
    """Both sets standardised (float64) with the training set's mean and deviation
    ([..., rows, features]: leading dimensions, such as several residual sites, each on its own)."""
    x_train, x_test = x_train.double(), x_test.double()
    mean = x_train.mean(-2, keepdim=True)
    x_train, x_test = x_train - mean, x_test - mean
    std = (x_train.square().sum(-2, keepdim=True) / max(x_train.shape[-2] - 1, 1)).sqrt().clamp_min(1e-6)
    return x_train / std, x_test / std


def _with_bias(x: Tensor) -> Tensor:
    """A column of ones added (the bias of the least-squares and logistic classifiers)."""
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], -1)


def probe_accuracy(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, ridge: float = 1e-3) -> float:
    """Held-out accuracy of a ridge least-squares linear classifier (one-hot targets,
    standardised features, a bias). Cheap, but it underestimates what is linearly
    decodable: a class between two others along a direction never gets the largest score."""
    return _lstsq(*_standardised(x_train, x_test), y_train, y_test, ridge)


def _lstsq(a: Tensor, test: Tensor, y_train: Tensor, y_test: Tensor, ridge: float = 1e-3) -> float:
    a, test = _with_bias(a), _with_bias(test)
    n_classes = int(max(y_train.max(), y_test.max())) + 1
    targets = torch.nn.functional.one_hot(y_train, n_classes).double()
    gram = a.T @ a
    gram += ridge * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
    weights = torch.linalg.solve(gram, a.T @ targets)
    return float((test @ weights).argmax(-1).eq(y_test).double().mean())


def lda_probe_accuracy(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor,
                       shrinkage: float = 1e-3) -> float:
    """Held-out accuracy of linear discriminant analysis (standardised features; class
    means, the pooled within-class covariance shrunk by `shrinkage` towards its mean
    variance plus 1e-6, class priors from the training set): a linear classifier that,
    unlike a least-squares fit to one-hot targets, can single out a class between two others."""
    a, test = _standardised(x_train, x_test)
    return _lda(a[None], test[None], [y_train], [y_test], shrinkage)[0][0]


def _lda(a: Tensor, test: Tensor, y_trains: list[Tensor], y_tests: list[Tensor], shrinkage: float = 1e-3
         ) -> list[list[float]]:
    """LDA for several variables on each of several feature sets (a: [sets, rows, features],
    from `_standardised`) at once, one batched solve: the within-class scatter of each is the
    features' Gram matrix less its classes' n_c mu_c mu_c^T. The classes of all variables side
    by side, each variable's own only (0 to its largest label). Accuracies [set][variable]."""
    sizes = [int(max(y.max(), t.max())) + 1 for y, t in zip(y_trains, y_tests)]
    onehot = torch.cat([torch.nn.functional.one_hot(y, k) for y, k in zip(y_trains, sizes)], 1).double()  # [n, class]
    counts = onehot.sum(0)  # [class]
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))  # class -> its variable
    member = torch.nn.functional.one_hot(owner, len(sizes)).T.double()  # [var, class]
    means = (onehot.T @ a) / counts.clamp_min(1)[:, None]  # [set, class, feature]: one product per set
    gram = a.transpose(1, 2) @ a  # [set, feature, feature]
    scatter = gram[:, None] - torch.einsum("vc,scd,sce->svde", member, means * counts[:, None], means)
    present = counts > 0
    cov = scatter / (a.shape[1] - member @ present.double()).clamp_min(1)[:, None, None]  # [set, var, d, d]
    cov = cov + (shrinkage * cov.diagonal(dim1=-2, dim2=-1).mean(-1) + 1e-6)[..., None, None] * torch.eye(
        a.shape[-1], dtype=a.dtype)
    solved = torch.linalg.solve(cov, means.transpose(-1, -2)[:, None])  # [set, var, feature, class]
    weights = solved[:, owner, :, torch.arange(len(owner))].permute(1, 2, 0)  # each class by its variable's: [set, d, class]
    bias = -0.5 * (means * weights.transpose(-1, -2)).sum(-1) + torch.log(counts.clamp_min(1) / len(a[0]))
    scores = (test @ weights + bias[:, None]).masked_fill(~present, -torch.inf)  # [set, row, class]
    right = [part.argmax(-1).eq(y) for part, y in zip(scores.split(sizes, -1), y_tests)]  # [set, row] per variable
    return torch.stack(right, 1).double().mean(-1).tolist()


def logistic_probe_accuracy(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor,
                            l2: float = 1e-4, max_iter: int = 50) -> float:
    """Held-out accuracy of a multinomial logistic regression (standardised features, a
    bias, an L2 penalty of `l2` per weight): the maximum-likelihood linear classifier.
    Fitted by Newton's method with backtracking, until the loss changes by less than 1e-9
    of itself (at most `max_iter` steps); about a hundred times the cost of the others."""
    return _logistic(*_standardised(x_train, x_test), y_train, y_test, l2, max_iter)


def _logistic(a: Tensor, test: Tensor, y_train: Tensor, y_test: Tensor, l2: float = 1e-4, max_iter: int = 50) -> float:
    a, test = _with_bias(a), _with_bias(test)
    n, d = a.shape
    n_classes = int(max(y_train.max(), y_test.max())) + 1
    targets = torch.nn.functional.one_hot(y_train, n_classes).double()

    def objective(w: Tensor) -> Tensor:
        return torch.nn.functional.cross_entropy(a @ w, y_train) + l2 * w.square().sum()

    w = torch.zeros(d, n_classes, dtype=a.dtype)
    value = objective(w)
    for _ in range(max_iter):
        p = torch.softmax(a @ w, -1)
        grad = (a.T @ (p - targets) / n + 2 * l2 * w).flatten()
        # Hessian of the mean cross-entropy: sum_i (diag(p_i) - p_i p_i^T) (x) x_i x_i^T / n
        curvature = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # [n, class, class]
        hessian = (a[:, :, None] * a[:, None, :]).reshape(n, d * d).T @ curvature.reshape(n, -1) / n
        hessian = hessian.reshape(d, d, n_classes, n_classes).permute(0, 2, 1, 3).reshape(d * n_classes, -1)
        hessian += 2 * l2 * torch.eye(d * n_classes, dtype=a.dtype)
        direction = torch.linalg.solve(hessian, -grad).reshape(d, n_classes)
        step, slope = 1.0, float(grad @ direction.flatten())
        while step > 1e-6:  # backtracking: the Newton step, or a fraction of it that lowers the loss
            candidate = objective(w + step * direction)
            if candidate <= value + 1e-4 * step * slope:
                break
            step /= 2
        converged = float(value - candidate) < 1e-9 * max(1.0, float(value))
        w, value = w + step * direction, candidate
        if converged:
            break
    return float((test @ w).argmax(-1).eq(y_test).double().mean())


def _each(fit: Callable[..., float]) -> Callable[..., list[list[float]]]:
    """A classifier of one variable on one feature set made one of several on several."""
    def fit_each(a: Tensor, test: Tensor, y_trains: list[Tensor], y_tests: list[Tensor], **options) -> list[list[float]]:
        return [[fit(a_set, test_set, y_train, y_test, **options) for y_train, y_test in zip(y_trains, y_tests)]
                for a_set, test_set in zip(a, test)]
    return fit_each


#: each classifier's fits and held-out accuracies [feature set][variable], on feature sets
#: [sets, rows, features] from `_standardised`; LDA fits them all
#: in one batched solve
CLASSIFIERS = {"lda": _lda, "logistic": _each(_logistic), "lstsq": _each(_lstsq)}


def attention_match(patterns: list[Tensor], ref_patterns: list[Tensor], active: list[tuple[int, int]]
                    ) -> tuple[Tensor, Tensor]:
    """The attention match of each compiled head in `active` ((layer, head)) with every learned
    head, [ref head, layer, head], and with every two-head path, [ref head, layer b, head g,
    layer a, head h]: head g of layer b reading through head h of layer a (a < b; q -> j -> k,
    j any position): `pattern_overlap` over queries without BOS, averaged over the inputs of
    each length, then over lengths. `patterns`, `ref_patterns`: per length, [input, layer,
    head, q, k] of the learned and the compiled model."""
    n_layers, n_heads = patterns[0].shape[1:3]
    single = torch.zeros(len(active), n_layers, n_heads, dtype=torch.float64)
    paths = torch.zeros(len(active), n_layers, n_heads, n_layers, n_heads, dtype=torch.float64)
    for a, s in zip(patterns, ref_patterns):
        composites = {(la, lb): torch.einsum("ngqj,nhjk->nghqk", a[:, lb, :, 1:], a[:, la])
                      for la in range(n_layers) for lb in range(la + 1, n_layers)}
        # every compiled head at once: [input, ref head, 1, 1, q, k], queries without BOS
        targets = s[:, [rl for rl, _ in active], [rh for _, rh in active], 1:][:, :, None, None]
        single += pattern_overlap(a[:, None, :, :, 1:], targets).mean(0) / len(patterns)
        for (la, lb), composite in composites.items():
            paths[:, lb, :, la, :] += pattern_overlap(composite[:, None], targets).mean(0) / len(patterns)
    return single, paths


# --- data ----------------------------------------------------------------------------

def comparison_batches(task: Task, per_length: int) -> list[Batch]:
    """One batch per input length: the task's held-out inputs, at most `per_length` of
    them per length, spread evenly over the (distinct) held-out set."""
    return [batch.spread(per_length) for batch in task.val_batches()]


def variable_labels(task: Task, batches: list[Batch]) -> dict[str, list[Tensor]]:
    """Class index of every categorical RASP variable at every input position (RASP
    index i = model position i + 1), one [batch, n] tensor per length."""
    key = (task.program.name, task.program.vocab, task.program.max_seq_len, tuple(len(b.tokens) for b in batches))
    if key not in _LABELS:
        program = task.program
        names = [n for n in program.variables if program.is_categorical(n) and len(program.value_sets[n]) > 1]
        index = {n: {v: i for i, v in enumerate(program.sorted_values(n))} for n in names}
        labels: dict[str, list[Tensor]] = {n: [] for n in names}
        for batch in batches:
            values = [program.intermediates(xs) for xs in task.decode(batch.tokens)]
            for n in names:
                labels[n].append(torch.tensor([[index[n][v] for v in row[n]] for row in values], dtype=torch.long))
        _LABELS[key] = labels
    return _LABELS[key]


def residual_sites(model) -> list[str]:
    """TransformerLens hook names of the residual stream, in depth order."""
    n, attn_only = model.cfg.n_layers, model.cfg.attn_only
    sites = []
    for layer in range(n):
        sites.append(f"blocks.{layer}.hook_resid_pre")
        if not attn_only:
            sites.append(f"blocks.{layer}.hook_resid_mid")
    return sites + [f"blocks.{n - 1}.hook_resid_post"]


def site_name(hook: str) -> str:
    """`blocks.1.hook_resid_mid` -> `resid_mid1`."""
    _, layer, kind = hook.split(".")
    return f"{kind.removeprefix('hook_')}{layer}"


def _run(model, batches: list[Batch], sites: list[str]) -> tuple[list[Tensor], list[Tensor], dict[str, Tensor]]:
    """Per length: argmax predictions [batch, pos] and patterns [batch, layer, head, q, k];
    residual activations at the input positions, rows = input x position, all lengths.
    One forward pass of all lengths padded to the longest (`padded`). The model runs on its
    own device; what it returns comes back to the CPU, where the compiled reference and the
    labels live. The native module runs, with `ResidualPass` keeping the sites (the bridge's
    hooks would cache the same tensors, at about twice the cost)."""
    predictions, patterns, resid = [], [], {s: [] for s in sites}
    device = next(model.parameters()).device
    joined, mask = padded(batches)
    run = ResidualPass(native_module(model), joined.tokens.to(device), mask_kwargs(mask, device).get("attention_mask"))
    values = {s: run.site(s) for s in sites}
    start = 0
    for batch in batches:
        rows, n = slice(start, start + len(batch)), batch.tokens.shape[1]
        start += len(batch)
        predictions.append(run.logits[rows, :n].argmax(-1).cpu())
        patterns.append(torch.stack([pattern[rows, :, :n, :n] for pattern in run.pattern], 1).double().cpu())
        for s in sites:
            resid[s].append(values[s][rows, 1:n].reshape(-1, values[s].shape[-1]).cpu())
    return predictions, patterns, {s: torch.cat(v) for s, v in resid.items()}


def reference_run(reference, batches: list[Batch]) -> tuple[list[Tensor], list[Tensor], dict[str, Tensor], CkaSide]:
    """`_run` of a compiled reference on these inputs, and its residual sites prepared for
    CKA (`cka_side`), once per process: its weights never change, so every probe of a run after the
    first reuses them (keyed by the reference and the inputs themselves)."""
    import hashlib

    digest = hashlib.sha256()
    for batch in batches:
        digest.update(str(tuple(batch.tokens.shape)).encode())
        digest.update(batch.tokens.cpu().numpy().tobytes())
    key = (id(reference), digest.hexdigest())
    if key not in _REFERENCE_RUNS:
        preds, patterns, resid = _run(reference, batches, residual_sites(reference))
        _REFERENCE_RUNS[key] = preds, patterns, resid, cka_side([resid[s] for s in residual_sites(reference)])
    return _REFERENCE_RUNS[key]


# --- the probe -----------------------------------------------------------------------

def compiled_for(task: Task, cache_dir: str | None = None):
    """The task's compiled reference bridge and layout (compiled once per process and
    cached on disk)."""
    from phasewatch.models.compiled import compiled_reference, default_cache_dir

    program = task.program
    cache_dir = cache_dir or default_cache_dir()
    key = (program.name, program.vocab, program.max_seq_len, cache_dir)
    if key not in _REFERENCES:
        bridge, layout = compiled_reference(program, cache_dir=cache_dir)
        bridge.eval()
        _REFERENCES[key] = (bridge, layout)
    return _REFERENCES[key]


def check_comparable(model, task: Task) -> None:
    """ConfigError when the model cannot be compared with the task's compiled program."""
    if not hasattr(task, "program"):
        raise ConfigError("probes.names", f"the task {task.name!r} has no RASP program to compile",
                          "Use the tracr probe with a RASP task (--data.task rasp).")
    if model.cfg.attention_dir == "causal" and not task.causal:
        raise ConfigError("model.arch.attention", f"a causal model cannot match the program {task.program.name!r}, "
                          "which reads later positions (tracr compiles it with bidirectional attention)",
                          "Use --model.arch.attention bidirectional.")


def variable_probes(task: Task, batches: list[Batch], resid: dict[str, Tensor], classifier: str = "lda",
                    ridge: float = 1e-3) -> dict[str, float]:
    """`<variable>/<site>` -> held-out probe accuracy (train on even, test on odd inputs of
    every length), with the `classifier` (a name of CLASSIFIERS; "lstsq" with ridge `ridge`)."""
    fit = CLASSIFIERS.get(classifier)
    if fit is None:
        raise ConfigError("probes.options.tracr.classifier", f"unknown classifier {classifier!r}",
                          f"Use one of {', '.join(CLASSIFIERS)}.")
    labels = variable_labels(task, batches)
    lengths = [b.tokens.shape[1] - 1 for b in batches]
    sizes = [len(b.tokens) for b in batches]
    train_rows, test_rows, start = [], [], 0
    for size, n in zip(sizes, lengths):
        rows = torch.arange(start, start + size * n).reshape(size, n)
        train_rows.append(rows[0::2].flatten())
        test_rows.append(rows[1::2].flatten())
        start += size * n
    train, test = torch.cat(train_rows), torch.cat(test_rows)
    ys = {name: torch.cat([t.flatten() for t in per_length]) for name, per_length in labels.items()}
    if not resid or not ys:
        return {}
    x = torch.stack(list(resid.values()))  # [site, row, feature]: every site standardised, every variable fitted, at once
    accuracies = fit(*_standardised(x[:, train], x[:, test]), [y[train] for y in ys.values()],
                     [y[test] for y in ys.values()], **({"ridge": ridge} if classifier == "lstsq" else {}))
    return {f"{name}/{site_name(site)}": acc for site, per_site in zip(resid, accuracies) for name, acc in zip(ys, per_site)}


def _applies(task: Task) -> bool:
    return hasattr(task, "program") and task.program.categorical


KEYS = KeyFamilies(
    detail=r"^tracr/probe_baseline/|^tracr/agreement/len",  # constant baselines, per-length agreement
    tracked="match_heads",
    tracked_names={"match_heads": "compiled heads and the learned heads matching them (compiled=learned)"},
    panels=(Panel("agreement with the compiled model", ("tracr/agreement",)),
            Panel("attention match with the compiled heads (head; path)", "tracr/attn_match/"),
            Panel("CKA with the compiled residual stream (best compiled site)", "tracr/cka/")),
    hidden=("tracr/",),
    headline=("tracr/agreement",),
)


@register_probe("tracr", applies_to=_applies, keys=KEYS, initial=True)
def tracr_probe(model, task: Task, per_length: int = 96, classifier: str = "lda", ridge: float = 1e-3,
                cache_dir: str | None = None, baseline: bool = True, initial=None) -> dict[str, Any]:
    """Compare with the compiled model (keys in the module docstring). Options:
    per_length (inputs per length), classifier of the variable probes ("lda", "logistic",
    or the underestimating "lstsq" with ridge `ridge`), cache_dir (compiled references;
    default $PHASEWATCH_TRACR_CACHE or ~/.cache/phasewatch/tracr), baseline (also probe
    `initial`, the run's weights at step 0, which the probe runner and `analyze` pass;
    without it there are no baseline keys). Default for RASP tasks with categorical outputs
    (the TransformerLens converter unembeds only categories); the first use of a program
    compiles it (15-60 s), later ones load it from the disk cache."""
    check_comparable(model, task)
    reference, _ = compiled_for(task, cache_dir)
    batches = comparison_batches(task, per_length)
    sites, ref_sites = residual_sites(model), residual_sites(reference)
    preds, patterns, resid = _run(model, batches, sites)
    ref_preds, ref_patterns, _, ref_cka = reference_run(reference, batches)  # references are kept: the id is theirs
    out = _agreement(batches, preds, ref_preds)
    out |= _attention_matches(model, reference, patterns, ref_patterns)
    out |= {f"tracr/probe/{key}": value for key, value in variable_probes(task, batches, resid, classifier, ridge).items()}
    if baseline and initial is not None:
        out |= {f"tracr/probe_baseline/{key}": value
                for key, value in _baseline_probes(initial, task, batches, sites, per_length, classifier, ridge).items()}
    return out | _residual_cka(resid, sites, ref_sites, ref_cka)


def _agreement(batches: list[Batch], preds: list[Tensor], ref_preds: list[Tensor]) -> dict[str, float]:
    """How often the model's output tokens are the compiled model's (the BOS position left
    out): per length, and their mean."""
    out: dict[str, float] = {}
    per_len = []
    for batch, p, r in zip(batches, preds, ref_preds):
        agree = float(p[:, 1:].eq(r[:, 1:]).double().mean())
        out[f"tracr/agreement/len{batch.tokens.shape[1] - 1}"] = agree
        per_len.append(agree)
    out["tracr/agreement"] = sum(per_len) / len(per_len)
    return out


def _attention_matches(model, reference, patterns, ref_patterns) -> dict[str, Any]:
    """Each non-empty compiled head's best-matching learned head (and, with two layers or
    more, pair of heads along a path): the match keys, the matrix and its labels, and the
    tracked set `match_heads` (compiled=learned)."""
    w_o = reference.W_O.detach()  # the bridge stacks every block's weights at each access: once
    active = [(layer, head) for layer in range(reference.cfg.n_layers) for head in range(reference.cfg.n_heads)
              if float(w_o[layer, head].abs().sum()) > 0]
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    single, paths = attention_match(patterns, ref_patterns, active)
    out: dict[str, Any] = {}
    labels = []
    for i, (rl, rh) in enumerate(active):
        ref = f"L{rl}H{rh}"
        best = int(single[i].argmax())
        out[f"tracr/attn_match/{ref}"] = float(single[i].flatten()[best])
        labels.append(f"{ref}=L{best // n_heads}H{best % n_heads}")
        if n_layers > 1:
            flat = int(paths[i].argmax())
            lb, hb, la, ha = (int(v) for v in torch.unravel_index(torch.tensor(flat), paths[i].shape))
            out[f"tracr/attn_match/{ref}/path"] = float(paths[i].flatten()[flat])
            labels.append(f"{ref}=L{la}H{ha}>L{lb}H{hb}")
    out["attn_match"] = single
    out["attn_match_labels"] = [f"compiled L{rl}H{rh}" for rl, rh in active] + [
        f"L{layer}H{head}" for layer in range(n_layers) for head in range(n_heads)]
    out["match_heads"] = labels
    return out


def _baseline_probes(initial, task: Task, batches: list[Batch], sites: list, per_length: int, classifier: str,
                     ridge: float) -> dict[str, float]:
    """`variable_probes` on the run's initial weights, computed once per initial model and
    options (`_BASELINES`)."""
    per_initial = _BASELINES.setdefault(initial, {})
    options = (task.program.name, task.program.vocab, task.program.max_seq_len, per_length, classifier, ridge)
    if options not in per_initial:
        _, _, initial_resid = _run(initial.eval(), batches, sites)
        per_initial[options] = variable_probes(task, batches, initial_resid, classifier, ridge)
    return per_initial[options]


def _residual_cka(resid: dict, sites: list, ref_sites: list, ref_cka) -> dict[str, Any]:
    """CKA of each learned residual site with each compiled one: each site's best, the
    matrix and its labels."""
    matrix = cka_matrix([resid[s] for s in sites], prepared=ref_cka).float()
    out: dict[str, Any] = {f"tracr/cka/{site_name(s)}": float(row.max()) for s, row in zip(sites, matrix)}
    out["cka"] = matrix
    out["cka_labels"] = [site_name(s) for s in sites] + [f"compiled {site_name(r)}" for r in ref_sites]
    return out
