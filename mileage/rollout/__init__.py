"""Rollout: prompt data, generation engines and rewards."""
