"""phasewatch: watch circuits form while small transformers train on algorithmic tasks."""

__version__ = "0.1.0"
