"""Deciding the tier: the settings, the probe, ``capabilities()``."""
