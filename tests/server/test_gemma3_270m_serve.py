"""The real Gemma 3 270M served by ``prefixcache serve`` from its GGUF: completions of prompts that carry the
tokenizer's BOS give llama.cpp's greedy tokens, as a Gemma user expects (without BOS Gemma answers "The capital
of France is" with " France. The The The...")."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import REAL_MODEL_MAX_TOKENS, REAL_MODEL_PROMPTS, assert_greedy_agrees
from tests.server.harness import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_server(gemma3_270m_gguf, tmp_path_factory):
    args = ["--block-size", "16", "--num-blocks", "600", "--max-model-len", "2048", "--disable-uvicorn-access-log"]
    server = ServerProcess(gemma3_270m_gguf, args, tmp_path_factory.mktemp("gemma-serve") / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def complete(server: ServerProcess, prompt: str | list[int]) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": REAL_MODEL_MAX_TOKENS,
        "temperature": 0,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def test_completions_of_ids_with_bos_give_llamacpps_tokens(gemma_server, llamacpp_gemma3_270m):
    compared = []
    for ref in llamacpp_gemma3_270m:
        body = complete(gemma_server, ref.prompt_ids)
        assert body["usage"]["prompt_tokens"] == len(ref.prompt_ids)
        logprobs = body["choices"][0]["logprobs"]
        token_ids = [token_id(token) for token in logprobs["tokens"]]
        top = [{token_id(t): lp for t, lp in entry.items()} for entry in logprobs["top_logprobs"]]
        compared.append(assert_greedy_agrees(token_ids, top, ref))
    assert sum(compared) >= len(compared) * REAL_MODEL_MAX_TOKENS // 2, f"near-ties came early: {compared}"


def test_a_text_prompt_gets_the_tokenizers_bos(gemma_server, llamacpp_gemma3_270m):
    text, ref = REAL_MODEL_PROMPTS[0], llamacpp_gemma3_270m[0]
    body = complete(gemma_server, text)
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_ids)
    assert body["choices"][0]["text"] == complete(gemma_server, ref.prompt_ids)["choices"][0]["text"]
