"""Checkpoints: on-disk layout, the atomic store, and the resume plan."""
