"""The official ``openai`` SDK against a real server, as a user writes it: completions, chat, streaming with
include_usage and vLLM's continuous usage, log-probabilities, n, prompt scoring, and the SDK's error types.
(``test_api.py`` covers the basics of each endpoint with the same client.)"""

import openai
import pytest

from tests.server.harness import random_prompt

HI = [{"role": "user", "content": "Say hi"}]


def test_completion_logprobs_n_and_streamed_usage(client, model_name):
    prompt = random_prompt("sdk-completion", 10)
    out = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=4, n=2, temperature=0.8, seed=3, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 4
        assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs)
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == 10

    chunks = list(
        client.completions.create(
            model=model_name, prompt=prompt, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    *deltas, final = chunks
    assert [c.usage.completion_tokens for c in deltas] == [1, 2, 3, 4]
    assert final.choices == [] and final.usage.total_tokens == 14


def test_chat_logprobs_and_stream(client, model_name):
    out = client.chat.completions.create(
        model=model_name, messages=HI, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert [t.token for t in content] == [t.top_logprobs[0].token for t in content]  # greedy picks the best
    stream = client.chat.completions.create(
        model=model_name, messages=HI, max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 3


def test_prompt_scoring_through_the_sdk(client, model_name):
    prompt = random_prompt("sdk-score", 8)
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 8 and logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert out.usage.completion_tokens == 0


def test_the_sdk_raises_its_own_error_types_with_our_messages(client, model_name):
    with pytest.raises(openai.BadRequestError, match="use n"):
        client.completions.create(model=model_name, prompt="hi", max_tokens=1, extra_body={"best_of": 2})
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_name, messages=HI, max_tokens=1, extra_body={"min_p": 2})
    assert bad.value.body["param"] == "min_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
