"""mileage: RL post-training for causal language models that resumes exactly where it stopped."""

__version__ = "0.1.0"
