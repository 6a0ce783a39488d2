"""The watcher's stage news (callbacks/transitions.py `stage_news`, `_stage_line`): what a
"begins" line claims, and a confirmed stage kept as it was said, on hand-made looks (the
detector's changes under way and confirmed transitions given, not fitted)."""

import numpy as np

import phasewatch.probes  # noqa: F401  (the probes' declarations: the grokking phases)
from phasewatch.callbacks.transitions import TransitionWatcher, _stage_line

STEPS = np.arange(10, 1001, 10)
#: a grokking run's series (the grokking signatures apply to runs logging the restricted loss)
SERIES = {k: (STEPS, np.linspace(1.0, 0.0, len(STEPS))) for k in
          ("train/acc", "train/loss", "val/acc", "grok/weight_norm", "grok/gini_embed", "grok/restricted_loss")}


def change(metric, onset, midpoint, end, direction="down", under_way=False, confidence=0.99):
    kind = {"kind": "in_progress"} if under_way else {"kind": "transition", "stage": "confirmed"}
    return {"metric": metric, "direction": direction, "onset": onset, "midpoint": midpoint, "end": end,
            "magnitude": 1.0, "confidence": confidence, **kind}


class Trainer:
    member = None


def look(watcher, step, confirmed, under_way, series=SERIES, final=False):
    """One look: the transitions confirmed so far and the changes under way, as the detector gave them."""
    watcher.reported = list(confirmed)
    watcher._fits_under_way = {}
    for e in under_way:
        watcher._fits_under_way.setdefault(e["metric"], []).append(e)
    return [(what, stage.id, stage.name, _stage_line(Trainer(), step, what, stage, None, watcher.begun_as(what, stage)),
             sorted(m["series"] for m in stage.members))
            for what, stage in watcher.stage_news(series, step, final)]


def test_begins_claims_the_lead_and_a_name_only_once_met_and_a_confirmed_stage_stays_as_said():
    w = TransitionWatcher()
    memorise = [change("train/acc", 20, 35, 60, "up"), change("train/loss", 25, 40, 70)]
    # memorisation under way: its signature is met by the members so far, so it is named
    (said,) = look(w, 60, [], [change("train/acc", 20, 35, 60, "up", under_way=True)])
    assert said[:3] == ("begins", 1, "memorisation")
    assert "led by train/acc" in said[3] and "memorisation so far" in said[3]
    (said,) = look(w, 100, memorise, [])
    assert said[:3] == ("confirmed", 1, "memorisation") and said[4] == ["train/acc", "train/loss"]
    # the weights shrink: cleanup's signature needs the test loss or accuracy too, so no name yet;
    # the line names the lead only, not the other series under way
    shrink = change("grok/weight_norm", 200, 300, 450, under_way=True)
    (said,) = look(w, 400, memorise, [shrink, change("grok/gini_embed", 210, 310, 440, "up", under_way=True)])
    assert said[0] == "begins" and said[2] is None and "(" not in said[3].split("stage")[1]
    assert "led by grok/weight_norm" in said[3] and "gini" not in said[3]
    assert look(w, 600, memorise, [shrink, change("val/acc", 250, 320, 420, "up", under_way=True)]) == []
    cleanup = [change("grok/weight_norm", 200, 300, 450), change("val/acc", 250, 320, 420, "up")]
    # a second fall of the train loss, confirmed late, at memorisation's time joins it silently
    # (its name and id as said); another, at a time of its own, is a stage of its own but no
    # second memorisation, and not said: one series' change alone is no evidence of a stage
    late, again = change("train/loss", 30, 45, 80), change("train/loss", 700, 780, 850)
    news = look(w, 1000, memorise + cleanup + [late, again], [])
    assert sorted((n[0], n[1], n[2]) for n in news) == [("confirmed", 2, "cleanup")]
    assert [(s.id, s.name, sorted(m["series"] for m in s.members)) for s in w.stages] == [
        (1, "memorisation", ["train/acc", "train/loss", "train/loss"]), (2, "cleanup", ["grok/weight_norm", "val/acc"]),
        (3, None, ["train/loss"])]


def test_a_stage_said_to_begin_keeps_its_id_when_a_look_loses_it():
    """A stage said to begin whose changes under way one look does not see (the fits come and go)
    is confirmed under the id it was said with, not as a new stage with the first one withdrawn
    (after memorisation, confirmed: cleanup, a later phase, is named as it begins)."""
    w = TransitionWatcher()
    memorise = [change("train/acc", 8, 12, 16, "up"), change("train/loss", 8, 13, 17)]
    assert [n[:3] for n in look(w, 40, memorise, [])] == [("confirmed", 1, "memorisation")]
    under_way = [change("val/acc", 50, 70, 90, "up", under_way=True), change("grok/weight_norm", 50, 72, 95, under_way=True)]
    assert [n[:3] for n in look(w, 100, memorise, under_way)] == [("begins", 2, "cleanup")]
    later = [change("val/loss", 300, 400, 500, "up", under_way=True), change("train/loss", 310, 410, 490, "up", under_way=True)]
    assert [n[:3] for n in look(w, 120, memorise, later)] == [("begins", 3, None)]  # stage 2's fits not seen
    done = [change("val/acc", 52, 70, 92, "up"), change("grok/weight_norm", 50, 73, 96)]
    assert [n[:3] for n in look(w, 200, memorise + done, later)] == [("confirmed", 2, "cleanup")]


def test_a_change_under_way_below_an_onsets_bar_makes_no_stage_begin():
    """A fit under way that would not be said as an onset (detector confidence under `SURE_ENOUGH`,
    raised for a run of many looks) makes no stage begin: such fits come and go, and each stage
    said to begin from one is a stage withdrawn."""
    def pair(confidence):
        return [change("val/acc", 50, 70, 90, "up", under_way=True, confidence=confidence),
                change("grok/weight_norm", 50, 72, 95, under_way=True, confidence=confidence)]
    rising = {**SERIES, "val/acc": (STEPS, np.interp(STEPS, [50, 90], [0.1, 0.9]))}  # a change worth saying
    weak = pair(0.9)
    assert look(TransitionWatcher(), 100, [], weak, rising) == []
    sure = pair(0.96)
    assert [n[0] for n in look(TransitionWatcher(), 100, [], sure, rising)] == ["begins"]
    many = TransitionWatcher()
    many.plan(3000, 400, 120)  # 400 looks where validations make 120: the bar is a confidence of 0.985
    assert look(many, 100, [], sure, rising) == []


def test_more_of_a_confirmed_stages_change_joins_it_unsaid_and_makes_no_stage():
    """A later piece of a change of a stage said confirmed (the detector cut a fall in two, or
    fits more of it as it goes on) joins that stage, which grows and is not said again; a change
    under way that continues one makes no stage begin. Neither is at one time with the stage's
    members by the chi-squared test alone."""
    w = TransitionWatcher()
    first = [change("grok/restricted_loss", 100, 200, 300), change("val/acc", 120, 210, 310, "up")]
    assert [n[:2] for n in look(w, 400, first, [])] == [("confirmed", 1)]
    piece = change("grok/restricted_loss", 310, 450, 620)  # begins where the first fall ended
    more = change("val/acc", 300, 500, 800, "up", under_way=True)  # the rise fitted on, still under way
    assert look(w, 700, first + [piece, change("grok/weight_norm", 330, 460, 600)], [more]) == []
    stage = next(s for s in w.stages if s.id == 1)
    assert sorted(m["series"] for m in stage.members) == ["grok/restricted_loss", "grok/restricted_loss", "val/acc"]
    assert (stage.onset, stage.end) == (100, 620)
    # the weight norm's fall, alone, is a stage unsaid; nothing is withdrawn at the end
    assert look(w, 1000, first + [piece, change("grok/weight_norm", 330, 460, 600)], [], final=True) == []


def test_a_small_wiggle_is_not_said_a_large_change_of_the_same_series_is():
    """Two series under way together (the test loss and the key frequencies' logit fraction, in a
    run where no signature applies) make a stage said only where the headline series among them
    moves by a size worth saying (`worth_saying`: 5% of its largest value on a linear scale)."""
    def run(loss):
        series = {"val/loss": (STEPS, loss), "grok/key_logit_fraction": (STEPS, np.linspace(0.0, 1.0, len(STEPS)))}
        under_way = [change("val/loss", 200, 300, 450, under_way=True),
                     change("grok/key_logit_fraction", 210, 310, 440, "up", under_way=True)]
        return [n[0] for n in look(TransitionWatcher(), 400, [], under_way, series)]

    wiggle, fall = (np.interp(STEPS, [200, 450], [4.11, after]) for after in (4.08, 1.0))
    assert run(wiggle) == []
    assert run(fall) == ["begins"]


def test_a_stage_said_to_begin_whose_changes_a_confirmed_stage_took_up_is_not_withdrawn():
    """A stage said to begin (the test and train losses falling) whose id a later look carried to
    other changes under way (the train loss with the embeddings' Gini), while the test loss's fall
    was confirmed in another stage: taken up as it was said, so nothing is withdrawn; and that
    stage, holding what stage 1 was said with once stage 1 is gone, is confirmed as stage 1
    (`_heir`; before session 20, as a stage of a new id, 2)."""
    w = TransitionWatcher()
    said = look(w, 100, [], [change("val/loss", 50, 80, 120, under_way=True), change("train/loss", 55, 82, 125, under_way=True)])
    assert [n[:2] for n in said] == [("begins", 1)]
    assert look(w, 150, [], [change("train/loss", 55, 90, 160, under_way=True),
                             change("grok/gini_embed", 60, 95, 170, "up", under_way=True)]) == []
    assert [s.id for s in w.stages] == [1]
    done = [change("val/loss", 50, 85, 130), change("grok/weight_norm", 52, 86, 128)]
    assert [n[:2] for n in look(w, 1000, done, [], final=True)] == [("confirmed", 1)]


def test_a_fit_not_yet_confirmed_joins_a_confirmed_stage_only_once_it_is_confirmed():
    """A piece of a confirmed stage's change that the detector has fitted to its end but the
    watcher has not confirmed (still under way to the watcher) makes no stage and does not join
    yet: the stage keeps its span until the piece is confirmed (no stale fits among its members)."""
    w = TransitionWatcher()
    first = [change("grok/restricted_loss", 100, 200, 300), change("val/acc", 120, 210, 310, "up")]
    assert [n[:2] for n in look(w, 400, first, [])] == [("confirmed", 1)]
    piece = change("grok/restricted_loss", 310, 450, 620)  # a fit ended, in the fits under way
    assert look(w, 700, first, [piece]) == []
    (stage,) = w.stages
    assert sorted(m["series"] for m in stage.members) == ["grok/restricted_loss", "val/acc"]
    assert (stage.onset, stage.end) == (100, 310)
    assert look(w, 800, first + [piece], []) == []
    (stage,) = w.stages
    assert sorted(m["series"] for m in stage.members) == ["grok/restricted_loss", "grok/restricted_loss", "val/acc"]
    assert (stage.onset, stage.end) == (100, 620)


def test_a_stage_at_one_time_with_one_already_said_is_said_once_confirmed_not_as_it_begins():
    """Changes of other series at the time of a stage already said (their midpoints one time with
    its members', spans overlapping: `one_activity`) make a stage whose beginning is no news: it is
    said once, confirmed. A stage at a time of its own is still said as it begins. (A run where no
    signature applies: no restricted loss.)"""
    series = {k: (STEPS, np.linspace(a, b, len(STEPS))) for k, a, b in
              [("val/loss", 4.0, 0.1), ("train/loss", 3.0, 0.01), ("grok/key_logit_fraction", 0.0, 1.0), ("grok/gini_embed", 0.1, 0.6)]}
    w = TransitionWatcher()
    first = [change("val/loss", 200, 300, 450), change("grok/key_logit_fraction", 210, 310, 440, "up")]
    assert [n[:3] for n in look(w, 500, first, [], series)] == [("confirmed", 1, None)]
    beside = [change("train/loss", 220, 320, 430, under_way=True), change("grok/gini_embed", 230, 310, 420, "up", under_way=True)]
    assert look(w, 520, first, beside, series) == []
    done = [change("train/loss", 220, 320, 430), change("grok/gini_embed", 230, 310, 420, "up")]
    assert [n[:2] for n in look(w, 600, first + done, [], series)] == [("confirmed", 2)]
    later = [change("val/loss", 600, 700, 800, under_way=True), change("grok/gini_embed", 610, 710, 820, "up", under_way=True)]
    assert [n[:2] for n in look(w, 850, first + done, later, series)] == [("begins", 3)]


def test_an_early_small_rise_confirmed_live_is_not_memorisation_the_training_set_fitted_is():
    """Logged densely early, quickstart_tiny's first small rise of the training accuracy (0.04 ->
    0.14 over steps 8-11, the training loss with it) is a transition of the series seen so far and
    is confirmed within a few steps; it took the name memorisation, and the real memorisation
    (22-41, to 1.0) was confirmed unnamed (sessions 17-18). The level memorisation must reach
    (the training accuracy >= 0.5 at the stage's end) keeps the name for the real one."""
    from tests.unit.test_stages import _early_rise_run

    early, memorised, series = (x if isinstance(x, dict) else [{**e, "stage": "confirmed"} for e in x]
                                for x in _early_rise_run())
    w = TransitionWatcher()

    def upto(step):
        return {k: (s[s <= step], v[s <= step]) for k, (s, v) in series.items()}
    said = look(w, 16, early, [], upto(16))
    assert [(what, name) for what, _, name, _, _ in said] == [("confirmed", None)]
    said = look(w, 60, early + memorised, [], upto(60))
    assert [(what, name) for what, _, name, _, _ in said] == [("confirmed", "memorisation")]
    assert [(s.onset, s.name) for s in w.stages] == [(8, None), (22, "memorisation")]


#: a run where no grokking signature applies (no restricted loss): the stages go unnamed
PLAIN = {k: (STEPS, np.linspace(a, b, len(STEPS))) for k, a, b in
         [("val/loss", 4.0, 0.1), ("train/loss", 3.0, 2.95), ("grok/key_logit_fraction", 0.0, 1.0),
          ("grok/gini_embed", 0.1, 0.6)]}


def ended(metric, onset, midpoint, end, direction="down"):
    """A change the detector has fitted to its end that the watcher has not confirmed (among the
    fits under way, as `update` keeps them)."""
    return {k: v for k, v in change(metric, onset, midpoint, end, direction).items() if k != "stage"}


def test_a_stage_whose_changes_ended_long_ago_is_not_said_to_begin_only_once_confirmed():
    """A stage made of fits that ended before the watcher could confirm them (the run past
    `settle` x their end, `points_after` values after it) has not begun at this look: no
    "begins" line (digit_addition, session 19: "stage 3 begins at step 275" said at step 2,100);
    it is said once, confirmed. The same fits before they are due for confirmation: a stage
    beginning."""
    fits = [ended("val/loss", 300, 400, 500), ended("grok/gini_embed", 310, 410, 520, "up")]
    done = [change("val/loss", 300, 400, 500), change("grok/gini_embed", 310, 410, 520, "up")]
    w = TransitionWatcher()
    assert look(w, 1000, [], fits, PLAIN) == []
    assert [n[:2] for n in look(w, 1050, done, [], PLAIN)] == [("confirmed", 1)]
    w = TransitionWatcher()
    assert [n[:2] for n in look(w, 540, [], fits, PLAIN)] == [("begins", 1)]  # 540 < 1.1 x 520: not yet due
    assert [n[:2] for n in look(w, 600, done, [], PLAIN)] == [("confirmed", 1)]


def test_a_stage_holding_what_a_stage_said_to_begin_held_is_confirmed_under_its_id():
    """Stage 1 is said to begin (the test loss and the embeddings' Gini under way); a look loses
    its fits while another stage, not evident (the train loss and the key-logit fraction, a
    small headline change), forms beside it as stage 2; then the four are confirmed as one
    stage. It holds what stage 1 was said with, so it is confirmed as stage 1 (digit_addition,
    session 19: "stage 1 begins", then "stage 2 begins" and "confirmed stage 2" for the same
    early stage), and stage 2 was never said."""
    w = TransitionWatcher()
    said = [change("val/loss", 40, 70, 130, under_way=True), change("grok/gini_embed", 42, 72, 132, "up", under_way=True)]
    assert [n[:2] for n in look(w, 100, [], said, PLAIN)] == [("begins", 1)]
    beside = [change("train/loss", 45, 73, 135), change("grok/key_logit_fraction", 44, 71, 133, "up")]
    assert look(w, 150, beside, [], PLAIN) == []
    assert [s.id for s in w.stages] == [2]
    done = beside + [change("val/loss", 40, 70, 130), change("grok/gini_embed", 42, 72, 132, "up")]
    assert [n[:2] for n in look(w, 200, done, [], PLAIN)] == [("confirmed", 1)]
    assert [n[:2] for n in look(w, 1000, done, [], PLAIN, final=True)] == []


def _said_then_fallen():
    """A watcher that said stage 1 begins (the test loss falling, the embeddings' Gini rising)
    and then confirmed the test loss's fall, a member of stage 1 as last seen; and that fall."""
    w = TransitionWatcher()
    said = [change("val/loss", 100, 200, 300, under_way=True), change("grok/gini_embed", 110, 120, 130, "up", under_way=True)]
    assert [n[:2] for n in look(w, 140, [], said, PLAIN)] == [("begins", 1)]
    fall = [change("val/loss", 100, 200, 300)]
    assert look(w, 330, fall, [change("grok/gini_embed", 110, 125, 140, "up", under_way=True)], PLAIN) == []
    return w, fall


def test_a_said_stages_confirmed_change_grouped_apart_makes_no_stage_begin():
    """Stage 1 is said to begin (the test loss falling, the embeddings' Gini rising); the test
    loss's fall is confirmed, a member of stage 1 as last seen. A later look groups that fall
    apart with a new change under way (the key-logit fraction) while stage 1 keeps the others:
    the new group's beginning is the test loss's, said with stage 1 ("stage 2 begins at step
    100, led by val/loss" on 4b32490; the quickstart, seed 0: "stage 10 begins at step 530",
    said at step 2,925), so it is said once, confirmed (`_regrouped`)."""
    w, fall = _said_then_fallen()
    later = [change("grok/gini_embed", 110, 120, 130, "up", under_way=True), change("train/loss", 110, 120, 130, under_way=True),
             change("grok/key_logit_fraction", 250, 280, 340, "up", under_way=True)]
    assert look(w, 335, fall, later, PLAIN) == []
    assert [(s.id, sorted(m["series"] for m in s.members)) for s in w.stages] == [
        (1, ["grok/gini_embed", "train/loss"]), (2, ["grok/key_logit_fraction", "val/loss"])]
    done = fall + [change("grok/key_logit_fraction", 250, 280, 340, "up")]
    assert [n[:2] for n in look(w, 500, done, later[:2], PLAIN)] == [("confirmed", 2)]


def test_a_regrouped_change_led_by_a_change_never_said_is_a_stage_beginning():
    """As above, but the look groups the said stage's confirmed fall with a change under way that
    began earlier (the training accuracy rising from step 95) and the key-logit fraction: the
    stage's beginning is the accuracy's, never said, so it is said to begin (review, session 20:
    the regrouping rule kept silent whatever led the stage)."""
    w, fall = _said_then_fallen()
    later = [change("grok/gini_embed", 110, 120, 130, "up", under_way=True), change("train/loss", 110, 120, 130, under_way=True),
             change("train/acc", 95, 230, 340, "up", under_way=True),
             change("grok/key_logit_fraction", 250, 280, 340, "up", under_way=True)]
    (news,) = look(w, 335, fall, later, PLAIN)
    assert news[0] == "begins" and news[3].endswith("begins at step 95, led by train/acc")
