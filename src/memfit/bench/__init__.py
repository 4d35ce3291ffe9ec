"""Bench: configurations of a training step measured in fresh processes (memory, time,
FLOPs), memfit's plans beside the baselines users reach for. ``child`` runs one
configuration; ``methods`` sets each up; ``runner`` runs a whole comparison."""
