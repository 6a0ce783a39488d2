"""`phasewatch compare` on runs that differ only in seeds: the distribution rows hold the
statistics of the transition steps and of the stages' boundaries, per group of the other
parameters, and how many seeds share a stage sequence."""

import csv
import json

import numpy as np

from phasewatch.report.cross_run import compare, compare_command, distributions, is_seed


def test_seed_keys_are_the_seeds_and_nothing_else():
    assert is_seed("seed_everything") and is_seed("data.task.seed") and is_seed("model.arch.seed")
    assert not is_seed("model.lr") and not is_seed("data.task.seeds_per_step")


def test_statistics_per_group_of_runs_that_differ_only_in_seeds():
    rows = [{"run": f"r{i}", "seed_everything": i, "model.lr": lr, "val/acc up": step}
            for i, (lr, step) in enumerate([(1e-3, 100), (1e-3, 200), (1e-3, 400), (1e-3, 300),
                                            (1e-2, 50), (1e-2, None), (1e-2, 70), (3e-2, 9)])]
    out = distributions(rows, ["seed_everything", "model.lr"], ["val/acc up"])
    by = {(r["model.lr"], r["run"]): r for r in out}
    assert {r["state"] for r in out} == {"4 seeds", "3 seeds"}  # lr 3e-2 has one run: no distribution
    assert by[(1e-3, "median")]["val/acc up"] == 250 and by[(1e-3, "q25")]["val/acc up"] == 175
    assert by[(1e-3, "q75")]["val/acc up"] == 325 and by[(1e-3, "min")]["val/acc up"] == 100
    assert by[(1e-3, "max")]["val/acc up"] == 400
    assert by[(1e-2, "median")]["val/acc up"] == 60  # the run without the transition is left out...
    assert by[(1e-2, "n")]["val/acc up"] == 2 and by[(1e-3, "n")]["val/acc up"] == 4  # ... and counted out
    assert "seed_everything" not in by[(1e-2, "median")]
    assert distributions(rows, ["model.lr"], ["val/acc up"]) == []  # no seed varies: no distribution


def _run(folder, seed, midpoint):
    """A run folder whose val/acc rises as a logistic in log-step centred on `midpoint`."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"seed_everything: {seed}\nmodel:\n  lr: 0.001\n")
    steps = np.unique(np.geomspace(1, 3000, 80).astype(int))
    acc = 0.05 + 0.9 / (1 + np.exp(-(np.log(steps) - np.log(midpoint)) / 0.12))
    with open(folder / "metrics.jsonl", "w") as f:
        for s, a in zip(steps, acc):
            f.write(f'{{"step": {int(s)}, "val/acc": {float(a)}}}\n')


def test_compare_of_a_population_writes_its_distribution(tmp_path, capsys):
    midpoints = [300, 500, 800, 1200]
    for k, m in enumerate(midpoints):
        _run(tmp_path / "pop" / f"m{k:02d}", k, m)
    assert compare_command([str(tmp_path / "pop"), "--keys", "val/acc", "--out", str(tmp_path / "cmp")]) == 0
    with open(tmp_path / "cmp.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    found = sorted(float(rows[f"m{k:02d}"]["val/acc up"]) for k in range(4))
    assert all(abs(np.log(f / m)) < 0.15 for f, m in zip(found, midpoints))  # each run's midpoint is found
    assert float(rows["median"]["val/acc up"]) == np.median(found) and rows["median"]["state"] == "4 seeds"
    assert float(rows["min"]["val/acc up"]) == found[0] and float(rows["max"]["val/acc up"]) == found[-1]
    assert (tmp_path / "cmp.png").stat().st_size > 5_000


def _staged_run(folder, seed, memorise, cleanup):
    """A grokking-like run folder (it logs the restricted loss): the train accuracy rises at
    `memorise` (memorisation), and, unless `cleanup` is None, the test accuracy rises as the
    weight norm falls at `cleanup` (cleanup); logistic changes in log-step time."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"seed_everything: {seed}\nmodel:\n  lr: 0.001\n")
    steps = np.unique(np.geomspace(1, 3000, 100).astype(int))

    def rise(centre):
        return 1 / (1 + np.exp(-(np.log(steps) - np.log(centre)) / 0.1)) if centre else np.zeros(len(steps))

    values = {"train/acc": 0.05 + 0.9 * rise(memorise), "val/acc": 0.05 + 0.9 * rise(cleanup),
              "grok/weight_norm": 3 - 2 * rise(cleanup), "grok/restricted_loss": 4.0 - 0.001 * np.log(steps)}
    with open(folder / "metrics.jsonl", "w") as f:
        for k, s in enumerate(steps):
            f.write(json.dumps({"step": int(s), **{key: float(v[k]) for key, v in values.items()}}) + "\n")


def test_compare_gives_each_stages_boundaries_over_seeds_and_how_many_share_the_sequence(tmp_path, capsys):
    """Four seeds: three memorise then clean up (at known steps), one only memorises. The table
    has each run's named stages, each stage's midpoint distribution over the seeds that have it,
    and 3 of 4 seeds with the sequence memorisation > cleanup."""
    planted = [(30, 600), (40, 900), (50, 1200), (35, None)]
    for k, (memorise, cleanup) in enumerate(planted):
        _staged_run(tmp_path / "pop" / f"m{k:02d}", k, memorise, cleanup)
    columns, rows = compare([str(tmp_path / "pop")])
    by = {r["run"]: r for r in rows}
    assert [by[f"m{k:02d}"]["stages"] for k in range(4)] == ["memorisation > cleanup"] * 3 + ["memorisation"]
    for k, (memorise, cleanup) in enumerate(planted):
        run = by[f"m{k:02d}"]
        assert run["stage memorisation onset"] < memorise < run["stage memorisation end"]
        assert abs(np.log10(run["stage memorisation midpoint"] / memorise)) < 0.1
        if cleanup:
            assert abs(np.log10(run["stage cleanup midpoint"] / cleanup)) < 0.1
    assert by["n"]["stage memorisation midpoint"] == 4 and by["n"]["stage cleanup midpoint"] == 3
    cleanups = [by[f"m{k:02d}"]["stage cleanup midpoint"] for k in range(3)]
    assert by["median"]["stage cleanup midpoint"] == np.median(cleanups)
    assert by["min"]["stage cleanup onset"] == min(by[f"m{k:02d}"]["stage cleanup onset"] for k in range(3))
    assert by["n"]["stages"] == "3 of 4: memorisation > cleanup"
    assert {"stages", "stage memorisation midpoint", "stage cleanup end"} <= set(columns)
