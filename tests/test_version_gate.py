"""routereplay.version_gate: the one PEP 440 gate of the vLLM, megatron-core and
transformers packages (local labels and pre-releases judged by their release number)."""
import pytest

from routereplay.version_gate import require, supports


@pytest.mark.parametrize("version, spec, ok", [
    ("0.32.0+cpu", ">=0.32,<0.34", True),        # the CPU build's local label
    ("0.33.1", ">=0.32,<0.34", True),
    ("0.33.0rc1", ">=0.32,<0.34", True),
    ("0.34.0", ">=0.32,<0.34", False),
    ("0.34.0rc1", ">=0.32,<0.34", False),       # a pre-release of an excluded version
    ("0.31.9", ">=0.32,<0.34", False),
    ("0.19.2", ">=0.16,<0.20", True),
    ("0.20.0", ">=0.16,<0.20", False),
    ("5.19.0", ">=5,<6", True),
    ("4.57.1", ">=5,<6", False),
])
def test_supports(version, spec, ok):
    assert supports(version, spec) is ok


def test_require_names_version_found_and_supported():
    assert require(("megatron-core",), ">=0.16,<0.20", what="x", version="0.16.1") == "0.16.1"
    with pytest.raises(ImportError, match=r"megatron-core 0\.20\.0 is not supported by "
                                          r"trainer_hooks\.megatron: supported >=0\.16,<0\.20 "
                                          r"\(pip install"):
        require(("megatron-core",), ">=0.16,<0.20", what="trainer_hooks.megatron",
                hint="pip install 'routereplay[megatron]'", version="0.20.0")
    with pytest.raises(ImportError, match="cannot parse version 'dev-build'"):
        require(("vllm",), ">=0.32", what="x", version="dev-build")
    with pytest.raises(ImportError, match=r"x needs no-such-dist-a or no-such-dist-b "
                                          r"\(>=1\): pip install it"):
        require(("no-such-dist-a", "no-such-dist-b"), ">=1", what="x", hint="pip install it")
