"""Benchmarks: kvlease against stock vLLM on this machine (`make bench`)."""
