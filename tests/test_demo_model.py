import hashlib

import pytest

from kvlease.demo.model import build_demo_model, ensure_demo_model


def _digests(folder):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("home") / "demo")


def test_demo_model_build_is_byte_for_byte_deterministic(built, tmp_path):
    build_demo_model(tmp_path)
    again = _digests(tmp_path)
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(again)
    assert {name: d for name, d in _digests(built).items() if name != ".complete"} == again


def test_a_complete_model_is_never_rebuilt(built):
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(built) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_incomplete_folder_is_rebuilt(tmp_path):
    target = tmp_path / "demo"
    target.mkdir()
    (target / "model.safetensors").write_text("truncated")
    ensure_demo_model(target)
    assert (target / ".complete").exists()
    assert (target / "model.safetensors").stat().st_size > 1_000_000


def test_demo_model_is_small_and_has_a_chat_template(built):
    from transformers import AutoConfig, AutoTokenizer

    size = sum(p.stat().st_size for p in built.iterdir())
    assert size < 8_000_000
    config = AutoConfig.from_pretrained(built)
    assert config.hidden_size // config.num_attention_heads == 64  # CPU attention needs this
    tok = AutoTokenizer.from_pretrained(built)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|bos|><|user|>hi<|end|><|assistant|>"
