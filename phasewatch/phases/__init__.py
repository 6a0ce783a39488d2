"""Phases: series -> events (the transition detector, the departure test, lead/lag). Numpy only."""
