"""Empty results explain themselves: a population whose runs end before any transition says
where they ended (issue 44)."""

import yaml

from phasewatch.report.population import write_population_report
from phasewatch.rundir import RunFolder, append_jsonl, member_name


def test_a_population_without_transitions_says_where_its_runs_ended(tmp_path):
    pop = tmp_path / "pop"
    for k in range(2):
        member = RunFolder(pop / member_name(k))
        member.root.mkdir(parents=True)
        member.config.write_text(yaml.safe_dump({"seed_everything": k, "trainer": {"max_steps": 1000}}))
        for step in range(0, 301, 25):  # flat: nothing to detect
            append_jsonl(member.metrics, {"step": step, "val/loss": 2.0, "val/acc": 0.1})
    page = write_population_report(pop).read_text()
    assert ('<p id="empty">No member had a transition: the runs ended at step 300 (trainer.max_steps 1000); '
            "a change that comes later in training needs longer runs (--trainer.max_steps).</p>") in page
    assert "<td>" not in page.split('<table id="distribution">')[1].split("</table>")[0]  # no transition row


def test_a_population_with_transitions_has_no_such_note(tmp_path):
    pop = tmp_path / "pop"
    for k in range(2):
        member = RunFolder(pop / member_name(k))
        member.root.mkdir(parents=True)
        for step in range(0, 301, 10):  # a drop from 2 to 0.1 around step 150
            append_jsonl(member.metrics, {"step": step, "val/loss": 2.0 if step < 140 + 10 * k else 0.1})
    page = write_population_report(pop).read_text()
    assert 'id="empty"' not in page and "val/loss down" in page


def test_each_member_is_listed_with_its_seed_and_one_without_a_config_with_a_question_mark(tmp_path):
    """The members' list takes each seed from compare's row (read from the member's config); a
    member without config.yaml has none there and reads "seed ?" (review, session 20: "seed None")."""
    pop = tmp_path / "pop"
    for k in range(3):
        member = RunFolder(pop / member_name(k))
        member.root.mkdir(parents=True)
        if k < 2:
            member.config.write_text(yaml.safe_dump({"seed_everything": 7 + k, "trainer": {"max_steps": 300}}))
        for step in range(0, 301, 25):
            append_jsonl(member.metrics, {"step": step, "val/loss": 2.0, "val/acc": 0.1})
    page = write_population_report(pop).read_text()
    assert [page.count(f"(seed {s})") for s in (7, 8, "?", None)] == [1, 1, 1, 0]
