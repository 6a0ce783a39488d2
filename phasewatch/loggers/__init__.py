"""Loggers: the run folder's logger and the W&B logger."""
