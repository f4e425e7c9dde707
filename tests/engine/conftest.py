"""Engine fixtures: engines built per test on the tiny model loaded once (``tiny_loaded``)."""

import pytest

from prefixcache.engine import LLM


@pytest.fixture
def make_llm(tiny_loaded, tiny_llama_dir):
    """Build an LLM on the shared tiny model; every engine is checked for leaks when the test ends."""
    built: list[LLM] = []

    def make(**kwargs) -> LLM:
        kwargs.setdefault("num_blocks", 256)
        kwargs.setdefault("block_size", 4)
        llm = LLM(str(tiny_llama_dir), loaded=tiny_loaded, dtype="float32", **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        assert_no_leaks(llm)


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.core.manager.num_free_blocks == engine.core.manager.num_blocks, "blocks leaked"
    engine.core.manager.check_invariants()
