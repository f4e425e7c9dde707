"""The real default model through the whole engine: a chat question gets a sensible answer."""

import pytest

from prefixcache.engine import LLM, SamplingParams


@pytest.mark.slow
def test_smollm2_answers_a_simple_question():
    llm = LLM(dtype="float32", kv_cache_memory="256MiB")
    system = {"role": "system", "content": "You are a helpful assistant."}
    question = [system, {"role": "user", "content": "What is the capital of France?"}]
    first = llm.chat(question, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    assert "Paris" in first.outputs[0].text
    assert first.outputs[0].finish_reason in ("stop", "length")
    again = llm.chat(question, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the system prompt and question come from the prefix cache
    assert again.outputs[0].text == first.outputs[0].text
    assert llm.engine.core.manager.num_free_blocks == llm.engine.core.manager.num_blocks
