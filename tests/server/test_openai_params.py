"""The OpenAI parameters users rely on do what they say: logprobs (checked against transformers), n, echo,
several prompts, stop_token_ids, penalties; and vLLM's /tokenize, /detokenize and /version."""

from collections import Counter
from importlib.metadata import version

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import scrape
from tests.server.harness import delta, random_prompt

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    """The same checkpoint in transformers, float32, and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the HF logits at every position: row i is the distribution of token i + 1."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].log_softmax(-1)


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream(url: str, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed request, without ``[DONE]`` (asserted to come last)."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [httpx.Response(200, content=line).json() for line in lines[:-1]]


def token_ids(tokens: list[str]) -> list[int]:
    """The ids of ``return_tokens_as_token_ids`` token names (``token_id:<id>``)."""
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_completion_logprobs_with_echo_match_transformers(server, hf):
    model, tokenizer = hf
    prompt = random_prompt("logprobs", 10)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True, "ignore_eos": True}
    choice = post(server.url, COMPLETIONS, {**body, "return_tokens_as_token_ids": True})["choices"][0]
    logprobs = choice["logprobs"]
    ids = token_ids(logprobs["tokens"])
    assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + 6
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # nothing before it
    reference = reference_logprobs(model, ids)
    for position in range(1, len(ids)):
        row = reference[position - 1]
        assert logprobs["token_logprobs"][position] == pytest.approx(row[ids[position]].item(), abs=1e-4)
        top = row.topk(3)
        got = {int(t.removeprefix("token_id:")): v for t, v in logprobs["top_logprobs"][position].items()}
        assert len(got) in (3, 4)  # the top 3, and the token itself when it is not among them
        for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert got[token] == pytest.approx(value, abs=1e-4)
    # The same request with token texts: the text starts with the prompt, and offsets index into it.
    texts = post(server.url, COMPLETIONS, body)["choices"][0]
    assert texts["text"].startswith(tokenizer.decode(prompt))
    assert texts["logprobs"]["token_logprobs"] == logprobs["token_logprobs"]
    offsets = texts["logprobs"]["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_chat_logprobs_match_transformers_and_streaming_agrees(server, hf):
    model, tokenizer = hf
    messages = [{"role": "user", "content": "The quick brown fox"}]
    body = {
        "messages": messages,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    whole = post(server.url, CHAT, {**body, "cache_salt": "whole"})
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in content)
    assert [e["token"] for e in content] == [e["top_logprobs"][0]["token"] for e in content]  # greedy: the best
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    generated = token_ids([e["token"] for e in content])
    reference = reference_logprobs(model, list(prompt_ids) + generated)
    for i, entry in enumerate(content):
        row = reference[len(prompt_ids) - 1 + i]
        assert entry["logprob"] == pytest.approx(row[generated[i]].item(), abs=1e-4)
        top = row.topk(2)
        assert token_ids([t["token"] for t in entry["top_logprobs"]]) == top.indices.tolist()
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)

    events = stream(server.url, CHAT, {**body, "cache_salt": "streamed"})
    streamed = [entry for e in events for entry in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)


def test_streamed_completion_logprobs_add_up_to_the_whole(server):
    body = {"prompt": random_prompt("stream-logprobs", 8), "max_tokens": 6, "temperature": 0, "logprobs": 1}
    whole = post(server.url, COMPLETIONS, {**body, "ignore_eos": True})["choices"][0]["logprobs"]
    events = stream(server.url, COMPLETIONS, {**body, "ignore_eos": True})
    parts = [e["choices"][0]["logprobs"] for e in events]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == whole["text_offset"]
    assert [v for p in parts for v in p["token_logprobs"]] == pytest.approx(whole["token_logprobs"], abs=1e-5)


def test_n_choices_share_the_prompt_blocks_and_are_indexed(server):
    prompt = random_prompt("n-choices", 41)  # ten full 4-token blocks can be shared
    body = {"prompt": prompt, "max_tokens": 5, "n": 4, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    before = scrape(server.url)
    out = post(server.url, COMPLETIONS, body)
    after = scrape(server.url)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert len({c["text"] for c in out["choices"]}) > 1  # copy i samples with seed + i
    assert out["usage"]["prompt_tokens"] == 41 and out["usage"]["completion_tokens"] == 20
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the prompt's first computation
    assert delta(before, after, "prefix_cache_hits_total") == 3 * 40  # the other copies read its blocks
    assert [c["text"] for c in post(server.url, COMPLETIONS, body)["choices"]] == [c["text"] for c in out["choices"]]

    events = stream(server.url, COMPLETIONS, {**body, "n": 2, "stream_options": {"include_usage": True}})
    choices = [c for e in events for c in e["choices"]]
    assert Counter(c["index"] for c in choices) == {0: 5, 1: 5}
    assert sorted(c["finish_reason"] for c in choices if c["finish_reason"]) == ["length", "length"]
    assert events[-1]["usage"]["completion_tokens"] == 10


def test_a_list_of_prompts_gets_n_choices_per_prompt(server, hf):
    _, tokenizer = hf
    prompts = ["The quick brown fox", "Prefix caching reuses"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "echo": True, "temperature": 0, "ignore_eos": True}
    out = post(server.url, COMPLETIONS, body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"].startswith(prompts[c["index"] // 2]) for c in out["choices"]] == [True] * 4
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    assert out["usage"]["prompt_tokens"] == sum(lengths) and out["usage"]["completion_tokens"] == 12
    by_ids = post(server.url, COMPLETIONS, {**body, "prompt": [random_prompt("a", 5), random_prompt("b", 7)]})
    assert by_ids["usage"]["prompt_tokens"] == 12 and len(by_ids["choices"]) == 4


def test_echo_prepends_the_prompt_whole_and_streamed(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, "echo": True, "ignore_eos": True}
    whole = post(server.url, COMPLETIONS, body)["choices"][0]["text"]
    events = stream(server.url, COMPLETIONS, body)
    assert events[0]["choices"][0]["text"].startswith("The quick brown fox")
    assert "".join(e["choices"][0]["text"] for e in events) == whole
    assert whole.startswith("The quick brown fox") and len(whole) > len("The quick brown fox")


def test_stop_token_ids_end_the_completion(server):
    body = {"prompt": random_prompt("stop-ids", 8), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = post(server.url, COMPLETIONS, {**body, "logprobs": 0, "return_tokens_as_token_ids": True})
    generated = token_ids(free["choices"][0]["logprobs"]["tokens"])
    stop_id = generated[3]
    out = post(server.url, COMPLETIONS, {**body, "stop_token_ids": [stop_id]})
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["stop_reason"] == stop_id
    assert out["usage"]["completion_tokens"] == generated.index(stop_id) + 1


def test_penalties_reach_the_sampler(server):
    body = {"prompt": random_prompt("penalties", 8), "max_tokens": 40, "temperature": 0, "ignore_eos": True}

    def generate(**penalties) -> list[int]:
        out = post(server.url, COMPLETIONS, {**body, **penalties, "logprobs": 0, "return_tokens_as_token_ids": True})
        return token_ids(out["choices"][0]["logprobs"]["tokens"])

    plain = generate()
    assert max(Counter(plain).values()) > 2, "greedy decoding of the tiny model should repeat itself"
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        penalized = generate(**penalty)
        assert max(Counter(penalized).values()) < max(Counter(plain).values()), penalty


def test_tokenize_and_detokenize_round_trip(server, hf):
    _, tokenizer = hf
    text = "Prefix caching: ünïcode ✓ survives."
    tokenized = post(server.url, "/tokenize", {"prompt": text})
    assert tokenized["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 256
    assert post(server.url, "/detokenize", {"tokens": tokenized["tokens"]}) == {"prompt": text}
    completion = post(server.url, COMPLETIONS, {"prompt": text, "max_tokens": 1})
    assert completion["usage"]["prompt_tokens"] == tokenized["count"]

    messages = [{"role": "user", "content": "hi"}]
    chat = post(server.url, "/tokenize", {"messages": messages})
    assert chat["tokens"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    for bad in ({"tokens": [512]}, {"tokens": [-1]}, {"tokens": "abc"}):
        response = httpx.post(f"{server.url}/detokenize", json=bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
    response = httpx.post(f"{server.url}/tokenize", json={"prompt": "a", "messages": messages})
    assert response.status_code == 400


def test_version(server):
    assert httpx.get(f"{server.url}/version").json() == {"version": version("prefixcache")}
