"""`mileage ckpt ls|verify`: inspect checkpoints without training."""

from __future__ import annotations


def register(sub) -> None:
    pass
