"""A run's life in one place: its record, checkpoints, served names and lease, behind server/runs/facade.py."""
