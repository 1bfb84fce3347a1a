"""kvlease's tenant-aware engine: tiers, identity, policy and the vLLM scheduler.

Importing this package imports nothing from vLLM; only `engine.vllm_scheduler`
knows vLLM internals.
"""
