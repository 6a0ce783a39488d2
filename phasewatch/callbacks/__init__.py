"""Lightning callbacks, each a thin adapter over probes/ or phases/: probes on a schedule,
live transitions, checkpoints, interventions, the live report, console lines clear of the bar."""
