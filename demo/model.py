"""The offline demo model: a tiny random-init Llama with its own BPE tokenizer.

No model can be downloaded on the machines kvlease is built on, so the demo
builds one. Its replies are gibberish, but everything kvlease cares about —
tokens, KV blocks, prefix-cache hits, preemption — is real vLLM behaviour.
The build is deterministic (fixed seed, fixed corpus) and happens once per
`KVLEASE_HOME`; a finished model is never rebuilt.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from kvlease.engine.paths import kvlease_home

BUILD_ID = "demo-llama-v1"
SEED = 1234
VOCAB_SIZE = 1024  # a cap: the small corpus yields ~600 tokens
MAX_POSITIONS = 4096
_DONE = ".complete"

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# The tokenizer's training text. Any text works; this one talks shop.
CORPUS = """\
A shared inference engine serves many tenants at once. Each request brings a
prompt, and the engine keeps the attention keys and values of every token in a
paged cache of fixed-size blocks. When the cache is full, the scheduler must
choose: wait, preempt a running request and recompute it later, or move its
blocks to host memory. Premium tenants pay for short waits; free tenants accept
longer ones. A lease keeps a tenant's conversation warm for a while after it
speaks, so the next turn finds its prefix already computed. Finance wants to
know who held which blocks, for how long, and what that costs per hour.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor
jugs. How vexingly quick daft zebras jump! Numbers: 0 1 2 3 4 5 6 7 8 9 10 100.
Questions, answers, summaries, translations, code, poems and lists all arrive
in one queue, and the engine answers them token by token, step after step.
"""


def default_model_dir() -> Path:
    return kvlease_home() / "models" / BUILD_ID


def ensure_demo_model(target: Path | None = None) -> Path:
    """Return the demo model folder, building it first if it is not complete."""
    target = Path(target) if target else default_model_dir()
    if (target / _DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{BUILD_ID}-", dir=target.parent))
    try:
        build_demo_model(staging)
        (staging / _DONE).write_text(BUILD_ID + "\n")
        if target.exists():  # an incomplete earlier attempt, or a racing build that won
            if (target / _DONE).exists():
                return target
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_demo_model(out: Path) -> None:
    """Write tokenizer and weights (bfloat16 safetensors, ~5 MB) into `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).bfloat16()
    model.save_pretrained(out)


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )
