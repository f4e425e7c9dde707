"""Session-wide fixtures shared by engine, server and benchmark tests."""

import pytest

from tests.helpers import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random-weight Llama checkpoint directory with tokenizer and chat template."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    """The tiny checkpoint loaded once in float32 on the CPU, shared by every engine a test builds."""
    from prefixcache.model import load_model

    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")
