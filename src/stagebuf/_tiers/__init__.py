"""Deciding the tier: the settings, the probe, ``capabilities()``, and doctor (with its command line)."""
