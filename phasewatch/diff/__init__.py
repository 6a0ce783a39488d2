"""Model diff: two models -> their differences."""
