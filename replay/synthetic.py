"""A vLLM scheduler driven without a model: real Scheduler code, synthetic outputs.

The offline engine of `kvlease replay`, one of the modules that import vLLM (the
README's architecture lists them; tests/test_layers.py keeps the list true). Also used by
tests to drive both scheduler classes (sync and async) in milliseconds and to check invariants
at every step, and by bench/overhead.py to time `schedule()` against stock.
Each sampled token is token id 7.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, Literal

import torch
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvlease.engine.tenancy import TierTable

BLOCK = 32
_ids = itertools.count()
Policy = Literal["fcfs", "priority"]  # vLLM's --scheduling-policy


def make_scheduler(
    cls: Any,
    model: str,
    num_blocks: int,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    kvlease: dict | None = None,
    async_scheduling: bool = False,
    max_model_len: int | None = None,
    policy: Policy = "fcfs",
) -> Any:
    if max_model_len is None:  # the longest request the lease caps allow (the model: 4,096)
        tiers = TierTable.load((kvlease or {}).get("tiers"))
        max_model_len = min(tiers.max_request_tokens(num_blocks - 1, BLOCK), 4096)
    args = EngineArgs(
        model=model,
        block_size=BLOCK,
        max_model_len=max_model_len,
        enforce_eager=True,
        enable_prefix_caching=True,
        num_gpu_blocks_override=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        additional_config={"kvlease": kvlease or {}},
        scheduling_policy=policy,
    )
    vllm_config = args.create_engine_config()
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    vllm_config.scheduler_config.async_scheduling = async_scheduling  # the CPU turns it off
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    init_none_hash(sha256)
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=False,
    )


def make_request(
    tenant: str | None,
    tier: str | None,
    prompt_len: int,
    max_tokens: int,
    session: str | None = None,
    arrival: float | None = None,
    prompt: list[int] | None = None,
    request_id: str | None = None,
    salt: str | None = None,
    priority: int = 0,
) -> Request:
    """An engine request as the middleware would send it: tenant fields in `extra_args`
    and a cache salt per tenant (`salt`, default the tenant id)."""
    extra = {}
    if tenant is not None:
        extra = {"tenant_id": tenant, "tier": tier}
        if session:
            extra["session_id"] = session
    n = next(_ids)
    return Request(
        request_id=request_id or f"r{n}",
        prompt_token_ids=prompt or [(n * 31 + i) % 600 + 10 for i in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra),
        pooling_params=None,
        arrival_time=arrival,
        priority=priority,
        cache_salt=salt or tenant,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def step(scheduler: Any, out: Any = None, stride: int = 1) -> Any:
    """One engine step: schedule (unless `out`, an output already scheduled, is given),
    then feed `stride` tokens to each request that finished its prefill. Returns vLLM's
    scheduler output and the outputs per client (`update_from_output`'s).

    A stride above one stands for that many decode steps in one call: each request's
    tokens are computed together at its next scheduling, as speculative decoding's
    accepted tokens are. The caller keeps it exact (`kvlease.replay.simulate`)."""
    out = scheduler.schedule() if out is None else out
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        request = scheduler.requests[rid]
        done_prefill = request.num_computed_tokens >= request.num_tokens
        left = request.max_tokens - request.num_output_tokens
        sampled.append([7] * min(stride, left) if done_prefill else [])
    runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    return out, scheduler.update_from_output(out, runner_output)


def counting_stock_scheduler() -> type:
    """vLLM's Scheduler, counting each request's preemptions and the computed tokens they
    threw away (what kvlease's RequestDone reports); it changes no decision."""

    class CountingScheduler(Scheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.preempted: Counter[str] = Counter()
            self.thrown: Counter[str] = Counter()

        def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            self.preempted[request.request_id] += 1
            self.thrown[request.request_id] += request.num_computed_tokens
            return super()._preempt_request(request, *args, **kwargs)

    return CountingScheduler
