"""Measured and synthetic tables of training configs, for replaying a search offline (``autotune simulate``)."""
