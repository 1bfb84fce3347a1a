import pytest

from engine.runtime import VllmVersionError, check_vllm_version, require_vllm


@pytest.mark.parametrize("found", ["0.32.0", "0.32.0+cpu"])
def test_pinned_vllm_release_is_accepted(found):
    check_vllm_version(found)


@pytest.mark.parametrize("found", ["0.31.2", "0.32.1", "0.33.0rc1", "unknown"])
def test_other_vllm_release_is_a_clear_error(found):
    with pytest.raises(VllmVersionError, match=f"needs vLLM 0.32.0 but found {found}"):
        check_vllm_version(found)


def test_missing_vllm_says_what_to_install():
    with pytest.raises(VllmVersionError, match=r"pip install 'kvlease\[cpu\]'"):
        check_vllm_version(None)


def test_the_installed_vllm_is_the_pinned_one():
    require_vllm()
