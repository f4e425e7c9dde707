"""The OpenAI API as clients use it: the official ``openai`` client against a real server process."""

import httpx
from transformers import AutoTokenizer

from tests.helpers import scrape
from tests.server.harness import delta, random_prompt


def cached_tokens(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_models_and_health(server, model_name):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [model_name]
    assert models["data"][0]["max_model_len"] == 256
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion(client, model_name):
    def complete():
        return client.completions.create(
            model=model_name,
            prompt="A completion no other test sends",
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    out = complete()
    assert out.object == "text_completion"
    assert out.model == model_name
    assert out.choices[0].finish_reason == "length"
    assert isinstance(out.choices[0].text, str)
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5
    assert cached_tokens(out.usage) == 0
    again = complete()
    assert cached_tokens(again.usage) == (out.usage.prompt_tokens - 1) // 4 * 4  # its whole 4-token blocks
    assert again.choices[0].text == out.choices[0].text


def test_streamed_deltas_add_up_to_the_whole_text(client, model_name):
    """Different salts, so both requests compute everything and greedy decoding must agree exactly."""
    request = dict(model=model_name, prompt=random_prompt("stream", 12), max_tokens=12, temperature=0)
    whole = client.completions.create(**request, extra_body={"ignore_eos": True, "cache_salt": "whole"})
    chunks = list(
        client.completions.create(
            **request,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "cache_salt": "streamed"},
        )
    )
    tokens = [c for c in chunks if c.choices]
    assert len(tokens) == 12
    assert "".join(c.choices[0].text for c in tokens) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in tokens] == [None] * 11 + ["length"]
    usage = chunks[-1]
    assert usage.choices == []
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (12, 12)
    assert cached_tokens(usage.usage) == 0


def test_chat_applies_the_template_and_streams(client, model_name, tiny_llama_dir):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    request = dict(model=model_name, messages=messages, max_completion_tokens=6, temperature=0)
    whole = client.chat.completions.create(**request, extra_body={"ignore_eos": True, "cache_salt": "whole"})
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(tokenizer.encode(templated, add_special_tokens=False))
    assert whole.usage.completion_tokens == 6

    chunks = list(
        client.chat.completions.create(
            **request,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "cache_salt": "streamed"},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_without_max_tokens_may_use_the_whole_context(client, model_name):
    out = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Go on"}], temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    if out.choices[0].finish_reason == "length":
        assert out.usage.total_tokens == 256


def test_cached_tokens_grow_on_a_repeated_prefix(client, model_name):
    prefix = random_prompt("shared-prefix", 40)  # ten 4-token blocks

    def complete(suffix: str, **kwargs):
        return client.completions.create(
            model=model_name, prompt=prefix + random_prompt(suffix, 6), max_tokens=2, **kwargs
        )

    assert cached_tokens(complete("first").usage) == 0
    assert cached_tokens(complete("second").usage) == 40
    chunks = list(complete("third", stream=True, stream_options={"include_usage": True}))
    assert cached_tokens(chunks[-1].usage) == 40


def test_cache_salt_separates_tenants(client, model_name):
    prompt = random_prompt("salted", 41)  # at most (41 - 1) // 4 = 10 blocks can be served from the cache

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        out = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, extra_body=extra)
        return cached_tokens(out.usage)

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 40
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-b") == 40


def test_metrics_count_requests_tokens_and_cache_hits(server, client, model_name):
    prompt = random_prompt("metrics", 21)
    before = scrape(server.url)
    outputs = [
        client.completions.create(model=model_name, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True})
        for _ in range(2)
    ]
    after = scrape(server.url)
    assert [cached_tokens(o.usage) for o in outputs] == [0, 20]
    assert delta(before, after, "prefix_cache_queries_total") == 42
    assert delta(before, after, "prefix_cache_hits_total") == 20
    assert delta(before, after, "prompt_tokens_total") == 42
    assert delta(before, after, "generation_tokens_total") == 6
    assert delta(before, after, "request_success_total") == 2
    assert delta(before, after, "time_to_first_token_seconds_count") == 2
    assert delta(before, after, "inter_token_latency_seconds_count") == 4
    assert delta(before, after, "e2e_request_latency_seconds_count") == 2
    assert 0 < after["prefixcache:prefix_cache_hit_rate"] <= 1
    assert after["prefixcache:kv_cache_usage_perc"] == 0
    assert after["prefixcache:num_requests_running"] == after["prefixcache:num_requests_waiting"] == 0
    assert delta(before, after, "num_preemptions_total") == 0  # 512 blocks hold both requests at once
