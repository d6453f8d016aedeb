"""Rollout engines behind one interface: in-process, SGLang servers, vLLM servers."""
