"""Models: loading HF causal LMs, the built-in tiny model, and conversion of offline weights."""
