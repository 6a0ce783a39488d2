"""Known answers of `plugins.check_trusted`: which parsed configs it refuses, at which field,
with which problem and fix (the forms jsonargparse could import from)."""

import pytest

from phasewatch.errors import ConfigError
from phasewatch.plugins import _MAX_REFERENCED, check_trusted

FOREIGN = "json.decoder.JSONDecoder"  # importable, neither phasewatch's nor a plug-in's


def refusal(config, **kwargs) -> ConfigError | None:
    try:
        check_trusted(config, "run/config.yaml", **kwargs)
    except ConfigError as err:
        return err
    return None


@pytest.mark.parametrize("config", [
    {"model": {"class_path": "phasewatch.training.module.TrainModule"}, "trainer": {"max_steps": 10}},
    {"probes": {"names": ["heads"], "options": {"ablation": {"components": ["L0.attn", "L1H0"]}}}},  # data, not code
    {"note": "see https://example.org/x.y", "ratio": 0.5, "flags": [True, None, 3]},
    ["phasewatch.tasks.modular_addition.ModularAddition", {"a": "phasewatch:main"}],
])
def test_configs_naming_only_phasewatch_code_or_data_pass(config):
    assert refusal(config) is None


@pytest.mark.parametrize("config, field", [
    ({"data": {"task": FOREIGN}}, "data.task"),
    ({"data": {"task": {"class_path": FOREIGN, "init_args": {"p": 11}}}}, "data.task.class_path"),
    ({"trainer": {"callbacks": [{"class_path": FOREIGN}]}}, "trainer.callbacks.class_path"),
    ({"data": {"task": f"'{FOREIGN}'"}}, "data.task"),  # quoted in the string
    ({"data": f'{{"task": {{"class_path": "{FOREIGN}"}}}}'}, "data.task.class_path"),  # inline YAML: its keys too
    ({"data": {"task": f"class_path: {FOREIGN}\ninit_args: {{p: 11}}\n"}}, "data.task.class_path"),  # block scalar
    ({"data": {"task": "json.decoder:JSONDecoder"}}, "data.task"),  # the colon form
    ({FOREIGN.replace(".", "_"): FOREIGN}, FOREIGN.replace(".", "_")),
    (FOREIGN, "config"),  # at the top
])
def test_a_foreign_module_is_refused_at_its_field_with_the_allow_fix(config, field):
    err = refusal(config)
    assert err is not None and err.field == field
    assert err.problem.startswith("run/config.yaml names ") and "importing it would run its code" in err.problem
    assert err.fix == "If you trust it, pass --allow json"
    assert refusal(config, allowed=("json",)) is None
    assert refusal(config, fix="Pass --config instead.").fix == "Pass --config instead."


def test_a_file_a_string_names_is_checked_as_config_from_the_working_directory_or_a_base(tmp_path, monkeypatch):
    (tmp_path / "spec.yaml").write_text(f"task: {{class_path: {FOREIGN}}}\n")
    (tmp_path / "plain.txt").write_text("not: [yaml\n")
    (tmp_path / "weights.bin").write_bytes(b"\0\1" + FOREIGN.encode())  # binary: not read as config
    inside = "data.task.class_path"  # the field, then the keys inside the file
    assert refusal({"data": str(tmp_path / "spec.yaml")}).field == inside
    assert refusal({"data": "spec.yaml"}) is None  # relative, and no base holds it
    assert refusal({"data": "spec.yaml"}, bases=(tmp_path,)).field == inside
    monkeypatch.chdir(tmp_path)
    assert refusal({"data": "spec.yaml"}).field == inside
    assert refusal({"a": "plain.txt", "b": "weights.bin"}) is None


def test_what_cannot_be_checked_is_refused_rather_than_passed(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("a: 1\n" + "#" * (_MAX_REFERENCED + 10))
    err = refusal({"data": {"task": str(big)}})
    assert err.field == "data.task" and "a file too large to check" in err.problem
    assert err.fix == "Write the values out as a mapping"
    deep: object = "x"
    for _ in range(17):
        deep = {"k": deep}
    err = refusal(deep)
    assert "nests configuration too deeply" in err.problem and err.field == ".".join(["k"] * 17)
    assert refusal({"k": {"k": {"k": "x"}}}) is None
