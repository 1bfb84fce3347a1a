"""Which data-parallel rank a chat session lives on.

Under vLLM's data parallelism (`--data-parallel-size N`) each rank is an engine of its
own, with its own KV cache and its own kvlease scheduler: a session's lease and cached
prefix exist only on the rank that served its last turn. So the middleware sends every
turn of a (tenant, session) to one rank, in vLLM's `X-data-parallel-rank` header;
requests without a session go wherever vLLM's balancer puts them.

The rank is chosen by rendezvous (highest random weight) hashing over a digest that
does not depend on the process (unlike Python's `hash`): every API process and every
replica picks the same rank for the same session, and changing N moves only the
sessions that must move (about 1/N of them), not nearly all as `hash % N` would.
O(N) digests per request; no state.
"""

from __future__ import annotations

import hashlib

RANK_HEADER = b"x-data-parallel-rank"  # vLLM reads it (entrypoints, _get_data_parallel_rank)


def session_rank(tenant_id: str, session_id: str, ranks: int) -> int:
    """The rank in [0, ranks) that (tenant, session) is pinned to."""
    if ranks <= 1:
        return 0
    key = f"{len(tenant_id)}:{tenant_id}{session_id}".encode()

    def weight(rank: int) -> bytes:
        return hashlib.blake2b(key, digest_size=8, salt=rank.to_bytes(8, "big")).digest()

    return max(range(ranks), key=weight)
