"""Phases: series -> events: the scale each series is watched on, the transition detector, the
departure test, lead/lag, the Event type and the stages of a run. Numpy only."""
