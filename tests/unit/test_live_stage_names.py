"""The names a live stage line gives (callbacks/transitions.py `TransitionWatcher._as_begun`,
`begun_as`, `_stage_line`): a "begins" line names a later phase of a sequence (Nanda et al.'s
circuit formation, cleanup) only once an earlier phase of it was said, and a confirmation under
another name than the "begins" line gave says so. Hand-made looks, as in test_live_stages.py
(the detector's changes under way and confirmed transitions given, not fitted)."""

import numpy as np

import phasewatch.probes  # noqa: F401  (the probes' declarations: the grokking phases)
from tests.unit.test_live_stages import STEPS, change, look
from phasewatch.callbacks.transitions import TransitionWatcher

#: a grokking run: the training set fitted at steps 10-20, then the restricted loss falling and
#: the embeddings' Gini rising over steps 100-250 with the test loss falling at 120-260
GROK = {
    "train/acc": (STEPS, np.interp(STEPS, [10, 20], [0.0, 1.0])),
    "train/loss": (STEPS, np.interp(STEPS, [10, 20], [4.6, 0.01])),
    "val/loss": (STEPS, np.interp(STEPS, [120, 260], [4.6, 0.01])),
    "val/acc": (STEPS, np.full(len(STEPS), 0.01)),
    "grok/restricted_loss": (STEPS, np.interp(STEPS, [100, 250], [4.0, 0.05])),
    "grok/gini_embed": (STEPS, np.interp(STEPS, [100, 250], [0.1, 0.5])),
}
MEMORISE = [change("train/acc", 10, 14, 18, "up"), change("train/loss", 10, 14, 19)]
FORMING = [change("grok/restricted_loss", 100, 170, 250, under_way=True),
           change("grok/gini_embed", 100, 170, 250, "up", under_way=True)]


def test_a_later_phase_is_not_named_as_it_begins_before_an_earlier_phase_was_said():
    """The restricted loss falling with the embeddings' Gini rising, before anything of the
    training set moved (the quickstart, seed 0: the grokking probe's series at steps 6-30 of a
    model at initialisation, "stage 2 (circuit formation so far) begins at step 6", never
    confirmed): the members so far match circuit formation, but memorisation, the phase it
    follows, was never said. The line gives no name (8d755c4: "(circuit formation so far)")."""
    (said,) = look(TransitionWatcher(), 260, [], FORMING, GROK)
    assert said[0] == "begins" and said[2] is None
    assert said[3] == "phasewatch: step 260: stage 1 begins at step 100, led by grok/gini_embed"
    # the stage itself keeps its name for the grouping
    watcher = TransitionWatcher()
    look(watcher, 260, [], FORMING, GROK)
    assert [s.name for s in watcher.stages] == ["circuit formation"]
    # and the live report and stages.jsonl (`stages_said`) claim no name the line held back
    assert [(s.id, s.name) for s in watcher.stages_said()] == [(1, None)]


def test_after_memorisation_was_said_circuit_formation_is_named_as_it_begins():
    """The same changes once memorisation was confirmed: the name is said "so far" (not hidden)."""
    w = TransitionWatcher()
    assert [n[:3] for n in look(w, 40, MEMORISE, [], GROK)] == [("confirmed", 1, "memorisation")]
    (said,) = look(w, 260, MEMORISE, FORMING, GROK)
    assert said[:3] == ("begins", 2, "circuit formation")
    assert said[3] == "phasewatch: step 260: stage 2 (circuit formation so far) begins at step 100, led by grok/gini_embed"
    assert [(s.id, s.name) for s in w.stages_said()] == [(1, "memorisation"), (2, "circuit formation")]


def test_a_confirmation_under_another_name_than_begins_gave_says_so():
    """Stage 2 is said to begin as circuit formation so far; the test loss's fall at its time is
    found later, so the stage is confirmed as cleanup (quickstart_tiny, 16 seeds: 5 such stages;
    8d755c4 said nothing of the first name). The confirmation line says what the "begins" line
    said, in the same line; one confirmed under the name it began with says nothing more."""
    w = TransitionWatcher()
    look(w, 40, MEMORISE, [], GROK)
    assert [n[:3] for n in look(w, 260, MEMORISE, FORMING, GROK)] == [("begins", 2, "circuit formation")]
    done = [change("grok/restricted_loss", 100, 170, 250), change("grok/gini_embed", 100, 170, 250, "up"),
            change("val/loss", 120, 180, 260)]
    (said,) = look(w, 600, MEMORISE + done, [], GROK)
    assert said[:3] == ("confirmed", 2, "cleanup")
    assert said[3].startswith("phasewatch: step 600: confirmed stage 2 cleanup (said to begin as circuit formation so far): "
                              "steps 100-260")
    w = TransitionWatcher()
    look(w, 40, MEMORISE, [], GROK)
    look(w, 260, MEMORISE, FORMING, GROK)
    (said,) = look(w, 600, MEMORISE + done[:2], [], GROK)
    assert said[:3] == ("confirmed", 2, "circuit formation") and "said to begin" not in said[3]


#: a run of 900 steps without grokking signatures (no restricted loss), the test and training
#: losses falling late: a stage of two series with a headline change worth saying
LATE = {k: (STEPS[STEPS <= 900], np.interp(STEPS[STEPS <= 900], [500, 900], [a, b])) for k, a, b in
        [("val/loss", 1.0, 0.1), ("train/loss", 1.0, 0.2), ("grok/gini_embed", 0.2, 0.5)]}


def test_a_stage_whose_changes_are_fitted_to_end_after_the_run_is_not_said_to_begin():
    """At step 800 of a 900-step run, the test loss and the embeddings' Gini under way, fitted to
    end at steps 1,012 and 1,059: neither a look nor the last one can confirm them as fitted, so
    a "begins" line could only be withdrawn at the end (quickstart_tiny seed 10, two stages
    withdrawn at step 900; 8d755c4 said it, then withdrew it). Fitted to end at 850, within the
    run, the same stage begins; a run of unknown length says it as before."""
    late = [change("val/loss", 575, 762, 1012, under_way=True), change("grok/gini_embed", 465, 702, 1059, "up", under_way=True)]
    w = TransitionWatcher()
    w.plan(900)
    assert look(w, 800, [], late, LATE) == []
    assert look(w, 900, [], [], LATE, final=True) == []
    within = [change("val/loss", 575, 700, 850, under_way=True), change("grok/gini_embed", 560, 690, 840, "up", under_way=True)]
    w = TransitionWatcher()
    w.plan(900)
    assert [n[:2] for n in look(w, 800, [], within, LATE)] == [("begins", 1)]
    unknown = TransitionWatcher()
    assert [n[:2] for n in look(unknown, 800, [], late, LATE)] == [("begins", 1)]
    assert [n[0] for n in look(unknown, 900, [], [], LATE, final=True)] == ["withdrawn"]
