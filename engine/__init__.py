"""The bottom layer: tenancy, identity, policy, leases, accounting, events and the channel,
plus `engine.vllm_scheduler`, the scheduler adapter.

Importing this package imports nothing from vLLM; only `engine.vllm_scheduler` (and the
version check in `engine.runtime`) does. `engine.policy` imports only the standard library.
"""
