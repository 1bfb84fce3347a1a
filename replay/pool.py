"""A KV pool in blocks from GiB of cache memory and a model's config.json.

What vLLM allocates per token of KV cache is keys and values for every layer
and KV head: `2 x layers x kv_heads x head_dim x bytes per element`. A GPU's
`--kv-gib` (what `gpu_memory_utilization` leaves for the cache, as vLLM logs at
start) over that per block is the pool a replay runs on.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlease.replay.traffic import ReplayInputError, read_text

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1}


def kv_bytes_per_token(config_path: Path) -> int:
    """From a Hugging Face config.json (or the model folder holding one)."""
    path = config_path / "config.json" if config_path.is_dir() else config_path
    try:
        config = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ReplayInputError(f"{path}: not JSON: {exc.msg}") from None
    config = config.get("text_config", config)  # multimodal configs nest the language model
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ReplayInputError(f"{path}: no attention shape in the config ({exc})") from None
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise ReplayInputError(f"{path}: unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def pool_blocks(kv_gib: float, config_path: Path, block_size: int) -> int:
    if not kv_gib > 0:
        raise ReplayInputError(f"--kv-gib must be > 0, got {kv_gib}")
    blocks = int(kv_gib * 2**30 // (kv_bytes_per_token(config_path) * block_size))
    if blocks < 2:
        raise ReplayInputError(f"--kv-gib {kv_gib}: {blocks} blocks, too few to run a request")
    return blocks
