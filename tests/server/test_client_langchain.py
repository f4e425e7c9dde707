"""``langchain-openai`` against a real server with its defaults: the chat model (``ChatOpenAI``) and the
completion model (``OpenAI``), whole and streamed; greedy answers agree with the server's own."""

import httpx
import langchain_openai
import pytest


@pytest.fixture
def settings(server, model_name) -> dict:
    return {
        "base_url": f"{server.url}/v1",
        "api_key": "unused",
        "model": model_name,
        "temperature": 0,
        "max_retries": 0,
    }


def test_chat_model_invokes_and_streams(server, settings):
    chat = langchain_openai.ChatOpenAI(**settings, max_tokens=5)
    answer = chat.invoke("Hello there")
    direct = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5, "temperature": 0},
    ).json()
    assert answer.content == direct["choices"][0]["message"]["content"]
    assert answer.usage_metadata["output_tokens"] == direct["usage"]["completion_tokens"]
    chunks = list(chat.stream("Hello there"))
    assert "".join(chunk.content for chunk in chunks) == answer.content
    # with stream_usage (off by default for a base_url other than OpenAI's) it asks for include_usage
    counted = list(langchain_openai.ChatOpenAI(**settings, max_tokens=5, stream_usage=True).stream("Hello there"))
    assert (
        sum(chunk.usage_metadata["output_tokens"] for chunk in counted if chunk.usage_metadata)
        == (answer.usage_metadata["output_tokens"])
    )


def test_completion_model_invokes_and_streams(server, settings):
    llm = langchain_openai.OpenAI(**settings, max_tokens=5)
    text = llm.invoke("The quick brown fox")
    direct = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0}
    ).json()
    assert text == direct["choices"][0]["text"]
    assert "".join(llm.stream("The quick brown fox")) == text
