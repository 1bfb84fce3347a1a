"""The bottom layer: tenancy, identity, policy, leases, accounting, events and the channel,
plus `kvlease.engine.vllm_scheduler`, the scheduler adapter.

Importing this package imports nothing from vLLM; only `vllm_scheduler` (and the version
check in `runtime`) does. `policy` imports only the standard library.
"""
