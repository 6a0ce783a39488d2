"""bench/live_latency.py's matching of live events to the offline transitions of a finished
series (a measurement: which event counts for which transition), on induction_2l's `val/acc`
(steps every 50): a slow rise confirmed over 465-1,024, then the induction bump, 1,282-1,610
offline."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from live_latency import matches, score, unfound  # noqa: E402

STEPS = np.arange(50, 3001, 50)
BUMP = {"metric": "val/acc", "direction": "up", "onset": 1282, "midpoint": 1441, "end": 1610}
RISE = {"metric": "val/acc", "direction": "up", "onset": 465, "midpoint": 742, "end": 1024, "stage": "confirmed",
        "detected_at": 1150}


def test_a_confirmed_change_matches_the_transition_its_midpoint_is_in_not_its_neighbour():
    assert not matches(RISE, BUMP, STEPS)  # the spans widened 1.5x both ways overlap: it used to count
    assert matches({**RISE, "onset": 1255, "midpoint": 1451, "end": 1552}, BUMP, STEPS)
    assert not matches({**RISE, "onset": 1255, "midpoint": 1451, "end": 1552, "direction": "down"}, BUMP, STEPS)


def test_an_onset_matches_from_one_width_before_the_transition_to_its_end():
    width = 1282**2 / 1610  # one 10-90% width before the onset, in log-step: ~1,021
    onset = {"metric": "val/acc", "direction": "up", "stage": "onset"}
    assert matches({**onset, "onset": 1300}, BUMP, STEPS) and matches({**onset, "onset": 1610}, BUMP, STEPS)
    assert matches({**onset, "onset": int(width) + 1}, BUMP, STEPS)
    assert not matches({**onset, "onset": 521}, BUMP, STEPS)  # the slow rise's, pending from before the bump
    assert not matches({**onset, "onset": 1650}, BUMP, STEPS)


def test_the_score_takes_the_first_matching_onset_and_confirmation_and_counts_the_rest_as_unfound():
    events = [{"metric": "val/acc", "direction": "up", "onset": 521, "stage": "onset", "detected_at": 1200},
              RISE,
              {"metric": "val/acc", "direction": "up", "onset": 1300, "stage": "onset", "detected_at": 1300},
              {**RISE, "onset": 1255, "midpoint": 1451, "end": 1552, "detected_at": 1750}]
    (row,) = score([BUMP], events, {"val/acc": STEPS})
    assert (row["onset_at"], row["confirmed_at"]) == (1300, 1750)
    assert row["onset/mid"] == 1300 / 1441 and row["confirmed/end"] == 1750 / 1610
    assert unfound([BUMP], events, {"val/acc": STEPS}) == 1  # the slow rise, which the finished series does not hold
