"""The run's side effects: its directory (lock, ownership, no overwrite), checkpoints, logging and
the health monitor. Nothing here knows an algorithm."""
