"""`phasewatch fit --population.seeds`: every member is the run `phasewatch fit` makes alone
with its config, on every task family; a crashed population resumes every member exactly."""

import math
import shutil

import pytest
import torch
import yaml

from phasewatch.rundir import read_jsonl
from phasewatch.cli.main import main

from .test_fit import TASKS, TINY


def _values(run) -> dict:
    """{(step, key): value} of a run folder's metrics."""
    out = {}
    for record in read_jsonl(run / "metrics.jsonl"):
        step = record.pop("step")
        out |= {(step, key): value for key, value in record.items()}
    return out


def _same_run(a, b, rtol=1e-5):
    """Two run folders hold the same metrics (to float tolerance), events and final weights."""
    va, vb = _values(a), _values(b)
    assert set(va) == set(vb)
    for key, value in vb.items():
        if value is None or va[key] is None:
            assert value == va[key], key
        else:
            assert math.isclose(va[key], value, rel_tol=rtol, abs_tol=1e-6), (key, va[key], value)

    def events(run):
        return [{k: v for k, v in e.items() if k != "magnitude"} for e in read_jsonl(run / "events.jsonl")]

    assert events(a) == events(b)
    wa = torch.load(a / "checkpoints" / "last.ckpt", weights_only=True)
    wb = torch.load(b / "checkpoints" / "last.ckpt", weights_only=True)
    assert wa["global_step"] == wb["global_step"]
    for key, tensor in wb["state_dict"].items():
        torch.testing.assert_close(wa["state_dict"][key], tensor, rtol=1e-4, atol=1e-5)
    return va


SCHEDULE = ["--trainer.val_check_interval", "4", "--trainer.log_every_n_steps", "2"]
ARGS = [*SCHEDULE, "--no_wandb", *TINY]
#: the task's default probes, at three steps (and the cheap ones at every validation)
PROBED = ["--probes.schedule", '{"kind": "list", "steps": [0, 6, 12]}']


@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_member_is_the_run_alone_with_its_seed(tmp_path, task):
    pop = tmp_path / "pop"
    assert main(["fit", *TASKS[task], *ARGS, *PROBED, "--trainer.max_steps", "12", "--run_dir", str(pop),
                 "--population.seeds", "1,2"]) == 0
    m1 = pop / "m01"
    config = yaml.safe_load((m1 / "config.yaml").read_text())
    full_batch = task == "modular_addition"
    assert config["seed_everything"] == 2 and "population" not in config
    assert config["data"]["task"]["init_args"]["seed"] == (0 if full_batch else 2)  # sampled data: its own seed
    assert main(["fit", "--config", str(m1 / "config.yaml"), "--run_dir", str(tmp_path / "alone")]) == 0
    values = _same_run(m1, tmp_path / "alone")
    assert {key for _, key in values} >= {"train/loss", "val/loss", "val/acc"}
    # the members differ: other initial weights (and, with sampled data, other batches)
    assert _values(pop / "m00")[(1, "train/loss")] != values[(1, "train/loss")]
    assert (m1 / "report.html").exists() and (m1 / "checkpoints" / "step=0000000.ckpt").exists()
    # a member's trajectory is drawn on demand (its report says how), the run alone's after its fit
    assert (tmp_path / "alone" / "figures" / "trajectory.png").exists()
    assert not (m1 / "figures" / "trajectory.png").exists()
    assert f"<code>phasewatch report {m1}</code>" in (m1 / "report.html").read_text()
    if task == "modular_addition":
        assert main(["report", str(m1)]) == 0 and (m1 / "figures" / "trajectory.png").exists()
        assert 'alt="PCA paths of the checkpoints' in (m1 / "report.html").read_text()
    steps = sorted((tmp_path / "alone" / "checkpoints").glob("step=*.ckpt"))
    assert [s.name for s in steps] == sorted(s.name for s in (m1 / "checkpoints").glob("step=*.ckpt"))
    for alone in steps:  # the probes' schedule: weights only, alone and as a member
        held = set(torch.load(m1 / "checkpoints" / alone.name, weights_only=True))
        assert held == set(torch.load(alone, weights_only=True)) and "optimizer_states" not in held, alone.name


def test_a_crashed_population_resumes_every_member_exactly(tmp_path, monkeypatch):
    """The population crashes at step 9, after last.ckpt at step 5 (the members' own step
    checkpoints at 0, 7 and 14 do not rewrite it: the population's last.ckpt keeps its own
    schedule): resumed from its own last.ckpt, every member's folder is rolled back to step
    5 and then equals the uninterrupted population's, line for line."""
    from phasewatch.training import population

    args = [*TASKS["induction"], *ARGS, "--trainer.max_steps", "14", "--checkpoints.last_every", "5",
            "--checkpoints.schedule", '{"kind": "list", "steps": [0, 7, 14]}',
            "--population.seeds", "0-1"]
    assert main(["fit", *args, "--run_dir", str(tmp_path / "whole")]) == 0

    step = population.PopulationModule.training_step

    def crash(self, batch, batch_idx):
        if self.global_step == 9:
            raise RuntimeError("simulated crash")
        return step(self, batch, batch_idx)

    monkeypatch.setattr(population.PopulationModule, "training_step", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["fit", *args, "--run_dir", str(tmp_path / "crashed")])
    monkeypatch.setattr(population.PopulationModule, "training_step", step)
    crashed = tmp_path / "crashed"
    last = torch.load(crashed / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert last == 5 and max(r["step"] for r in read_jsonl(crashed / "m01" / "metrics.jsonl")) > last
    assert (crashed / "m01" / "checkpoints" / "step=0000007.ckpt").exists()
    assert main(["fit", "--run_dir", str(crashed), "--ckpt_path", "last"]) == 0
    for member in ("m00", "m01"):
        _same_run(crashed / member, tmp_path / "whole" / member)
        assert (crashed / member / "metrics.jsonl").read_text() == (tmp_path / "whole" / member / "metrics.jsonl").read_text()


@pytest.mark.parametrize("at", [9, 7])
def test_a_population_stopped_by_sigterm_saves_its_step_and_resumes_exactly(tmp_path, monkeypatch, capsys, at):
    """SIGTERM arriving after the step's callbacks ran (raised from the population module's own
    `on_train_batch_end`, after every callback's) stops the population at that step with its
    last.ckpt and every member's there (not at the last `last_every` step); resumed, every
    member's folder equals the uninterrupted population's, line for line. At step 9 no save was
    due; at step 7 the members' full step checkpoints (the explicit schedule) were already
    copied to their last.ckpt, and the population's own is written all the same."""
    import signal

    from phasewatch.training import population

    args = [*TASKS["induction"], *ARGS, "--trainer.max_steps", "14", "--checkpoints.last_every", "5",
            "--checkpoints.schedule", '{"kind": "list", "steps": [0, 7, 14]}', "--population.seeds", "0-1"]
    assert main(["fit", *args, "--run_dir", str(tmp_path / "whole")]) == 0
    sent, own = [], population.PopulationModule.on_train_batch_end

    def on_train_batch_end(self, outputs, batch, batch_idx):
        own(self, outputs, batch, batch_idx)
        if not sent and self.global_step >= at:  # not a validation step (every 4)
            sent.append(self.global_step)
            signal.raise_signal(signal.SIGTERM)  # Lightning's handler notes it; the process goes on

    monkeypatch.setattr(population.PopulationModule, "on_train_batch_end", on_train_batch_end)
    stopped = tmp_path / "stopped"
    assert main(["fit", *args, "--run_dir", str(stopped)]) == 143
    assert f"interrupted at step {sent[0]}; resume with: phasewatch fit --run_dir {stopped} --ckpt_path last\n" \
        in "".join(capsys.readouterr())
    monkeypatch.undo()
    for last in [stopped / "checkpoints", stopped / "m00" / "checkpoints", stopped / "m01" / "checkpoints"]:
        assert torch.load(last / "last.ckpt", weights_only=False)["global_step"] == sent[0], last
    assert main(["fit", "--run_dir", str(stopped), "--ckpt_path", "last"]) == 0
    for member in ("m00", "m01"):
        _same_run(stopped / member, tmp_path / "whole" / member)
        assert (stopped / member / "metrics.jsonl").read_text() == (tmp_path / "whole" / member / "metrics.jsonl").read_text()


def test_what_a_population_cannot_do_is_refused_before_anything_is_written(tmp_path, capsys):
    for flags, field in [(["--model.on_nonfinite", "skip"], "model.on_nonfinite"),
                         (["--trainer.gradient_clip_val", "1.0"], "trainer.gradient_clip_val"),
                         (["--model.arch.seed", "3"], "model.arch.seed"),
                         (["--population.seeds", "2-1"], "population.seeds")]:
        run = tmp_path / field
        seeds = [] if "--population.seeds" in flags else ["--population.seeds", "2"]
        assert main(["fit", *TASKS["induction"], *ARGS, "--trainer.max_steps", "4", "--run_dir", str(run),
                     *seeds, *flags]) == 2
        assert field in capsys.readouterr().err
        assert not (run / "m00").exists()


def test_every_member_has_its_own_wandb_run_in_the_populations_group(tmp_path, monkeypatch):
    """Offline W&B: one run per member, named after it, grouped under the population, with
    the member's own seed in its config and the member's own values in its history."""
    from . import wandb_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    pop = tmp_path / "pop"
    assert main(["fit", *TASKS["modular_addition"], *SCHEDULE, *TINY, "--trainer.max_steps", "8",
                 "--run_dir", str(pop), "--population.seeds", "3,5", "--probes.names", "[grokking]"]) == 0
    ids = set()
    for member, seed in (("m00", 3), ("m01", 5)):
        (offline,) = wandb_records.offline_runs(pop / member)
        info = wandb_records.run_info(offline)
        assert info["group"] == "pop" and info["name"] == f"pop-{member}" and info["config"]["seed_everything"] == seed
        ids.add(info["id"])
        history = wandb_records.by_step(wandb_records.history(offline))
        for record in read_jsonl(pop / member / "metrics.jsonl"):
            step = record.pop("step")
            for key, value in record.items():
                assert history[step][key] == pytest.approx(value, rel=1e-6), (member, step, key)
    assert len(ids) == 2


def test_the_population_report_overlays_the_members(tmp_path, chromium):
    """fit writes the population's report: in Chromium its two figures load (the members'
    curves and the transition steps' distribution), every member links to its own report,
    and the table holds the statistics compare.csv holds."""
    import csv
    import html
    import json
    import re

    from .test_report import blue_pixels, open_page, run_own_scripts

    pop = tmp_path / "pop"
    assert main(["fit", *TASKS["modular_addition"], *ARGS, "--trainer.max_steps", "24", "--run_dir", str(pop),
                 "--population.seeds", "0-2", "--probes.names", "[grokking]"]) == 0
    page = pop / "report.html"
    probe = tmp_path / "probe.html"
    probe.write_text(run_own_scripts(page.read_text().replace("</body>", """<pre id="seen"></pre><script>
window.addEventListener("load", () => { document.getElementById("seen").textContent = JSON.stringify({
  images: [...document.images].map(i => [i.alt, i.naturalWidth]),
  links: [...document.querySelectorAll("#members a")].map(a => a.getAttribute("href")),
  rows: [...document.querySelectorAll("#distribution tr")].slice(1).map(r => [...r.cells].map(c => c.textContent))});
});</script></body>""")))
    console, dom = open_page(chromium, probe, tmp_path)
    assert not [line for line in console if "rror" in line], console
    seen = json.loads(html.unescape(re.search(r'<pre id="seen">(.*?)</pre>', dom, re.S).group(1)))
    assert [alt for alt, _ in seen["images"]] == ["members", "distributions"]
    assert all(width > 400 for _, width in seen["images"])
    assert seen["links"] == ["m00/report.html", "m01/report.html", "m02/report.html"]
    assert all((pop / link).exists() for link in seen["links"])
    with open(pop / "figures" / "compare.csv") as f:
        median = next(r for r in csv.DictReader(f) if r["run"] == "median")
    for transition, n, median_cell, *_ in seen["rows"]:
        assert median_cell == f"{float(median[transition]):.0f}" and 1 <= int(n) <= 3
    assert seen["rows"]
    assert blue_pixels(pop / "figures" / "members.png") > 200  # member m00's curves drawn


def test_a_members_checkpoint_resumes_as_the_member_alone(tmp_path):
    """A member's step checkpoint is an ordinary run's: `phasewatch fit` resumes the member's
    folder alone from it (optimizer slice, loop and callback states) and writes, line for line,
    what the population wrote after that step (values to float rounding)."""
    pop = tmp_path / "pop"
    assert main(["fit", *TASKS["induction"], *ARGS, "--trainer.max_steps", "12", "--run_dir", str(pop),
                 "--population.seeds", "0-1", "--probes.names", "[]", "--checkpoints.schedule",
                 '{"kind": "list", "steps": [0, 6, 12]}']) == 0
    alone = tmp_path / "m01-alone"
    shutil.copytree(pop / "m01", alone)
    assert main(["fit", "--run_dir", str(alone), "--ckpt_path", str(alone / "checkpoints" / "step=0000006.ckpt"),
                 "--config", str(alone / "config.yaml")]) == 0
    lines = [r["step"] for r in read_jsonl(alone / "metrics.jsonl")]
    assert lines == [r["step"] for r in read_jsonl(pop / "m01" / "metrics.jsonl")]  # nothing lost or repeated
    _same_run(alone, pop / "m01")  # the same values, to float rounding (vectorised against alone)
    # the member's state dict as the run alone's checkpoint holds it: the same keys in order, a
    # weight the bridge names under several paths one object (`shared_views`), fewer than keys
    own, ran = (torch.load(run / "checkpoints" / "step=0000012.ckpt", weights_only=True)["state_dict"]
                for run in (pop / "m01", alone))
    assert list(own) == list(ran)
    assert len({id(v) for v in own.values()}) == len({id(v) for v in ran.values()}) < len(own)


def _replayed(tmp_path, seeds: str, member: str, steps: int) -> dict:
    """A grokking population (configs/quickstart_tiny.yaml) and `phasewatch fit --config
    <member>/config.yaml` alone train bit for bit alike: the same weights and optimizer state
    at the end, the same metrics (every value equal), events and arrays. The member's values."""
    pop = tmp_path / "pop"
    config = ["--config", "configs/quickstart_tiny.yaml", "--no_wandb", "--trainer.max_steps", str(steps)]
    assert main(["fit", *config, "--run_dir", str(pop), "--population.seeds", seeds]) == 0
    alone, own = tmp_path / "alone", pop / member
    assert main(["fit", "--config", str(own / "config.yaml"), "--run_dir", str(alone)]) == 0
    wa = torch.load(own / "checkpoints" / "last.ckpt", weights_only=True)
    wb = torch.load(alone / "checkpoints" / "last.ckpt", weights_only=True)
    assert wa["global_step"] == wb["global_step"] == steps
    for key, tensor in wb["state_dict"].items():
        assert torch.equal(wa["state_dict"][key], tensor), key
    for key, state in wb["optimizer_states"][0]["state"].items():
        assert all(torch.equal(wa["optimizer_states"][0]["state"][key][k], v) for k, v in state.items()), key
    values = _values(own)
    assert values == _values(alone)
    assert list(read_jsonl(own / "events.jsonl")) == list(read_jsonl(alone / "events.jsonl"))
    # the arrays of training (a trajectory is drawn after the fit: for a run alone with 3 or more
    # checkpoints, for a population's members lazily, cli/main.py)
    arrays = sorted(p.relative_to(own) for p in (own / "arrays").rglob("*") if p.is_file())
    assert arrays and arrays == sorted(p.relative_to(alone) for p in (alone / "arrays").rglob("*")
                                       if p.is_file() and "trajectory" not in p.parts)
    assert all((own / a).read_bytes() == (alone / a).read_bytes() for a in arrays)
    return values


def test_a_member_replays_from_its_own_folder_through_memorisation(tmp_path):
    """issue 41: a grokking member and `phasewatch fit --config m01/config.yaml` alone train bit
    for bit alike through the memorisation of the training set (train/acc 1 by step 50). A run
    alone through the plain step instead rounds the logits differently by one float32 ulp, and
    training amplifies that (by step 80 the weights differ by about 1e-4)."""
    values = _replayed(tmp_path, "0-1", "m01", 80)
    assert values[(9, "train/acc")] < 0.2 and values[(79, "train/acc")] == 1.0  # memorised


@pytest.mark.slow
def test_a_member_replays_from_its_own_folder_through_grokking(tmp_path):
    """As above, on the quickstart's grokking run with three members to step 450: through
    memorisation and the fall of the restricted loss (steps 275-450), with its events."""
    values = _replayed(tmp_path, "0-2", "m01", 450)
    assert values[(450, "grok/restricted_loss")] < 0.5 * values[(250, "grok/restricted_loss")]


def test_the_members_batches_drawn_in_one_call_are_each_members_own():
    """Induction draws a population's batches in one call (`Task.train_batches`): member k's
    is the batch its task alone draws with data seed k, at every step (a resumed run's too)."""
    from phasewatch.tasks import Induction

    tasks = [Induction(vocab_size=10, seq_len=13, min_len=2, max_len=5, batch_size=4, seed=s) for s in (0, 3, 7)]
    for step in (0, 1, 17):
        together = tasks[0].train_batches([t.seed for t in tasks], step, None)
        for k, task in enumerate(tasks):
            alone = task.train_batch(step, None)
            for field in ("tokens", "targets", "loss_mask"):
                assert torch.equal(getattr(together, field)[k], getattr(alone, field)), (step, k, field)
    assert not torch.equal(together.tokens[0], together.tokens[1])  # the members' own draws


def test_one_parse_gives_every_member_the_namespace_its_own_config_parses_to(tmp_path):
    """`build_members` parses the population's config once and copies it per member with its
    own seeds and folder: each copy equals the parse of that member's own config."""
    from pathlib import Path

    from phasewatch.training import lightning_cli, population

    seen = {}

    def grab(self, cfg, store, kwargs):
        seen["parser"], seen["config"] = self._parser(self.subcommand), self.config_dump_dict()
        raise SystemExit(0)

    lightning_cli.PhasewatchCLI._population_trainer, original = grab, lightning_cli.PhasewatchCLI._population_trainer
    try:
        with pytest.raises(SystemExit):
            main(["fit", *TASKS["induction"], *ARGS, "--trainer.max_steps", "4", "--run_dir", str(tmp_path / "p"),
                  "--population.seeds", "3"])
    finally:
        lightning_cli.PhasewatchCLI._population_trainer = original
    for vary in (True, False):
        configs = [population.member_config(seen["config"], k, vary, Path(tmp_path / f"m{k}")) for k in (4, 9)]
        copies = population.member_namespaces(seen["parser"], configs)
        for config, copy in zip(configs, copies):
            assert copy == seen["parser"].parse_object(config)
        assert copies[1].seed_everything == 9 and copies[1].data.task.init_args.seed == (9 if vary else 0)


def test_the_members_plans_predict_the_stacked_probes_they_run(tmp_path, monkeypatch):
    """A real population with the default probes (composition and heads: stacked forms): each
    pass of a stacked probe covers exactly the members that run it at that hook (their
    `ProbeRunner._will_run`, asked when the first member asks), and no member is measured twice
    at a hook. Member m01's watcher is made to hold an onset of train/loss pending over steps
    3-9 (every probe dense there: `dense_probes`), so that at those steps it runs the probes
    alone, and at the steps of the watchers' look grid every member acts but only m01 runs them.
    (Until session 20 a member whose turn at the hook had passed was asked its plan too: at step
    10 m00's own look had just made the step dense for it, and it was measured in vain.)"""
    from phasewatch.callbacks import probes as probes_module
    from phasewatch.callbacks.transitions import TransitionWatcher

    watchers: list = []
    setup, dense = TransitionWatcher.setup, TransitionWatcher.dense_metrics

    def setting_up(self, trainer, pl_module, stage):
        watchers.append(self)
        return setup(self, trainer, pl_module, stage)

    def dense_metrics(self, step):
        if len(watchers) > 1 and self is watchers[1] and 3 <= step <= 9 and step in self._dense_steps:
            return {"train/loss"}
        return dense(self, step)

    passes, runs = [], []
    values, run = probes_module.StackedProbes.values, probes_module.ProbeRunner._run

    def counted_values(self, member, name, options, step, at="step"):
        key = (name, repr(sorted(options.items())))
        before = set(self._values.get(key, {})) if self._step == step else set()
        out = values(self, member, name, options, step, at)
        measured = set(self._values.get(key, {})) - before
        if measured:
            passes.append(((name, step, at), measured))
        return out

    def counted_run(self, trainer, pl_module, probes, held_out=None, at="step"):
        names = {p.name for p in probes} & {"composition", "heads"}
        for name in names:
            runs.append(((name, trainer.global_step, at), trainer._index))
        return run(self, trainer, pl_module, probes, held_out, at)

    monkeypatch.setattr(TransitionWatcher, "setup", setting_up)
    monkeypatch.setattr(TransitionWatcher, "dense_metrics", dense_metrics)
    monkeypatch.setattr(probes_module.StackedProbes, "values", counted_values)
    monkeypatch.setattr(probes_module.ProbeRunner, "_run", counted_run)
    assert main(["fit", *TASKS["induction"], *ARGS, *PROBED, "--trainer.max_steps", "12",
                 "--run_dir", str(tmp_path / "pop"), "--population.seeds", "0-3"]) == 0
    ran: dict = {}
    for where, member in runs:
        ran.setdefault(where, set()).add(member)
    measured: dict = {}
    for where, members in passes:
        assert where not in measured, f"{where}: a second pass (a member asked that the plans left out)"
        measured[where] = members
    assert measured == ran
    assert {where for where, members in ran.items() if members == {1}} >= {(n, 3, "step") for n in ("composition", "heads")}
    # (composition and heads are cheap: every member at step 0 and at every validation's end)
    assert all(ran[(name, step, at)] == {0, 1, 2, 3} for name in ("composition", "heads")
               for step, at in ((0, "step"), (4, "validation"), (8, "validation"), (12, "validation")))


def test_a_population_trains_with_the_processs_objects_frozen_and_thaws_them_at_its_end(tmp_path, monkeypatch):
    """The objects the members' build leaves (their bridges, the process's modules) are out of the
    cyclic collector's full collections while the population trains (`gc.freeze`: a full
    collection over them costs ~0.4 CPU s of a 64-member proxy population's set-up and frees
    nothing of theirs), and back in its reach once the fit ends, also when it fails."""
    import gc

    from phasewatch.training import population

    seen = []
    start = population.MemberCallbacks.on_train_start
    monkeypatch.setattr(population.MemberCallbacks, "on_train_start", lambda self, trainer, pl_module: (
        seen.append((gc.isenabled(), gc.get_freeze_count())), start(self, trainer, pl_module))[-1])
    assert gc.get_freeze_count() == 0
    assert main(["fit", *TASKS["induction"], *ARGS, "--trainer.max_steps", "3", "--run_dir", str(tmp_path / "p"),
                 "--population.seeds", "2"]) == 0
    assert len(seen) == 1 and seen[0][0] and seen[0][1] > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0

    def fails(self, batch, batch_idx):
        raise RuntimeError("a step that fails")

    monkeypatch.setattr(population.PopulationModule, "on_train_batch_start", fails, raising=False)
    with pytest.raises(RuntimeError, match="a step that fails"):
        main(["fit", *TASKS["induction"], *ARGS, "--trainer.max_steps", "3", "--run_dir", str(tmp_path / "q"),
              "--population.seeds", "2"])
    assert seen[-1][1] > 0 and gc.isenabled() and gc.get_freeze_count() == 0
    # a failure after the build, before the fit's hooks (the population's module cannot be made)
    def unmade(*args, **kwargs):
        raise RuntimeError("no population module")

    monkeypatch.setattr(population, "PopulationModule", unmade)
    with pytest.raises(RuntimeError, match="no population module"):
        main(["fit", *TASKS["induction"], *ARGS, "--trainer.max_steps", "3", "--run_dir", str(tmp_path / "r"),
              "--population.seeds", "2"])
    assert gc.isenabled() and gc.get_freeze_count() == 0
