"""What real clients send beyond OpenAI's basics: vLLM's and SGLang's fields (honoured, or accepted where the
value asks for what the server always does), the metadata paths peers probe, and refusals that say what to
use instead."""

import httpx
import pytest

from prefixcache.http.protocol import CompletionRequest
from tests.server.harness import random_prompt

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def refused(url: str, path: str, body: dict, param: str) -> str:
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    return response.json()["error"]["message"]


def stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [httpx.Response(200, content=line).json() for line in lines[:-1]]


def greedy(prompt: list[int], **fields) -> dict:
    return {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **fields}


def test_a_field_sent_as_null_takes_its_default(server):
    """OpenAI's fields are nullable; some clients send every one, null when unset."""
    nulls = {"n": None, "stream": None, "logprobs": None, "temperature": None, "stop": None, "user": None}
    completion = post(server.url, COMPLETIONS, {"prompt": "hi", **nulls, "max_tokens": None, "echo": None})
    assert len(completion["choices"]) == 1 and completion["usage"]["completion_tokens"] <= 16
    chat = post(server.url, CHAT, {"messages": [{"role": "user", "content": None}], **nulls, "max_tokens": 2})
    assert chat["choices"][0]["logprobs"] is None
    assert "prompt" in refused(server.url, COMPLETIONS, {"prompt": None}, "prompt")  # required stays required


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_continuous_usage_stats_put_the_choice_usage_in_every_chunk(server, path):
    body = greedy(random_prompt("continuous", 9)) if path == COMPLETIONS else {"messages": HI, "max_tokens": 6}
    body |= {"ignore_eos": True, "n": 2, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = stream(server.url, path, body)
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    prompt_tokens = final["usage"]["prompt_tokens"]
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        assert [c["usage"]["completion_tokens"] for c in mine] == [1, 2, 3, 4, 5, 6]
        assert {c["usage"]["prompt_tokens"] for c in mine} == {prompt_tokens}
        assert all(c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"] for c in mine)
    plain = stream(server.url, path, {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in c for c in plain[:-1])
    message = refused(server.url, path, {**body, "stream_options": {"continuous_usage_stats": True}}, "stream_options")
    assert "include_usage" in message


def test_echo_with_zero_max_tokens_scores_the_prompt_and_generates_nothing(server):
    prompt = random_prompt("score", 10)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    out = post(server.url, COMPLETIONS, body)
    [choice] = out["choices"]
    assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == prompt
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["token_logprobs"]) == 10
    assert choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == 10
    # The same scores as an echo that generates, cut to the prompt: what lm-eval's loglikelihood reads.
    generating = post(server.url, COMPLETIONS, {**body, "max_tokens": 1})["choices"][0]["logprobs"]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(generating["token_logprobs"][:10], abs=1e-5)
    [event] = stream(server.url, COMPLETIONS, body)
    assert event["choices"][0]["logprobs"]["tokens"] == choice["logprobs"]["tokens"]
    text = post(server.url, COMPLETIONS, {"prompt": "The quick brown fox", "max_tokens": 0, "echo": True})
    assert text["choices"][0]["text"] == "The quick brown fox"
    assert "echo" in refused(server.url, COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, None)


def test_min_tokens_holds_off_the_stop_tokens(server):
    prompt = random_prompt("min-tokens", 8)
    free = post(server.url, COMPLETIONS, greedy(prompt, logprobs=0, return_tokens_as_token_ids=True))
    first = int(free["choices"][0]["logprobs"]["tokens"][0].removeprefix("token_id:"))
    stopped = post(server.url, COMPLETIONS, greedy(prompt, stop_token_ids=[first], ignore_eos=False))
    assert stopped["usage"]["completion_tokens"] == 1
    held = post(server.url, COMPLETIONS, greedy(prompt, stop_token_ids=[first], ignore_eos=False, min_tokens=3))
    assert held["usage"]["completion_tokens"] >= 3
    assert refused(server.url, COMPLETIONS, greedy(prompt, min_tokens=7), "min_tokens")


def test_min_p_of_one_samples_only_the_likeliest_token(server):
    prompt = random_prompt("min-p", 8)
    argmax = post(server.url, COMPLETIONS, greedy(prompt))["choices"][0]["text"]
    sampled = post(server.url, COMPLETIONS, greedy(prompt, temperature=1.0, min_p=1.0, seed=3))
    assert sampled["choices"][0]["text"] == argmax
    assert refused(server.url, COMPLETIONS, greedy(prompt, min_p=1.5), "min_p")


def test_truncate_prompt_tokens_keeps_the_end_of_a_long_prompt(server):
    prompt = random_prompt("truncate", 300)  # beyond the 256-token context
    out = post(
        server.url,
        COMPLETIONS,
        greedy(prompt, truncate_prompt_tokens=100, echo=True, logprobs=0, return_tokens_as_token_ids=True),
    )
    assert out["usage"]["prompt_tokens"] == 100
    echoed = [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"][:100]]
    assert echoed == prompt[-100:]
    whole = post(server.url, COMPLETIONS, greedy(prompt, truncate_prompt_tokens=-1))
    assert whole["usage"]["prompt_tokens"] == 256 - 6
    chat = post(
        server.url,
        CHAT,
        {"messages": [{"role": "user", "content": "x" * 400}], "truncate_prompt_tokens": -1, "max_tokens": 2},
    )
    assert chat["usage"]["prompt_tokens"] == 254
    assert refused(server.url, COMPLETIONS, greedy(prompt, truncate_prompt_tokens=0), "truncate_prompt_tokens")


def test_special_token_options_reach_the_engine():
    body = CompletionRequest(prompt="hi", skip_special_tokens=False, spaces_between_special_tokens=False)
    params = body.sampling_params(4)
    assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (False, False)
    assert CompletionRequest(prompt="hi").sampling_params(4).skip_special_tokens is True
    assert CompletionRequest(prompt="hi", no_stop_trim=True).sampling_params(4).include_stop_str_in_output is True


def test_sglang_fields_at_the_values_we_honour_are_accepted_and_the_others_refused_by_name(server):
    prompt = random_prompt("sglang", 8)
    sglang = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False}
    assert post(server.url, COMPLETIONS, greedy(prompt, **sglang))["usage"]["completion_tokens"] == 6
    assert post(server.url, CHAT, {"messages": HI, "max_tokens": 2, **sglang})["choices"]
    message = refused(server.url, COMPLETIONS, greedy(prompt, return_hidden_states=True), "return_hidden_states")
    assert "not implemented" in message and "false" in message
    free = post(server.url, COMPLETIONS, greedy(prompt))["choices"][0]["text"]
    stop = free[2:4]
    kept = post(server.url, COMPLETIONS, greedy(prompt, stop=[stop], no_stop_trim=True))["choices"][0]["text"]
    assert kept.endswith(stop) and kept == free[: free.index(stop) + len(stop)]


def test_prompt_cache_key_is_accepted_and_changes_nothing_that_is_cached(server):
    prompt = random_prompt("cache-key", 21)

    def cached(**fields) -> int:
        body = {"prompt": prompt, "max_tokens": 1, **fields}
        return post(server.url, COMPLETIONS, body)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(prompt_cache_key="tenant-a") == 0
    assert cached(prompt_cache_key="tenant-b") == 20  # another key reads the same blocks: it is no salt
    assert cached() == 20
    refused(server.url, COMPLETIONS, {"prompt": "hi", "prompt_cache_key": "k" * 1025}, "prompt_cache_key")


@pytest.mark.parametrize(
    ("field", "value", "hint"),
    [
        ("best_of", 2, "use n"),
        ("tools", [], "tool calling"),
        ("logit_bias", {"5": 1}, "stop_token_ids"),
        ("temprature", 0.5, "README"),
    ],
)
def test_refusals_say_what_to_use_instead(server, field, value, hint):
    message = refused(server.url, COMPLETIONS, {"prompt": "hi", field: value}, field)
    assert field in message and hint in message


def test_tokenizer_info_describes_the_tokenizer_as_tokenize_uses_it(server, tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert (info["eos_token"], info["pad_token"]) == ("<|eos|>", "<|eos|>")
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 256
    # lm-eval's remote tokenizer finds the EOS id by tokenizing its text
    assert post(server.url, "/tokenize", {"prompt": info["eos_token"]})["tokens"] == [tokenizer.eos_token_id]


def test_completions_render_gives_the_token_ids_the_request_runs_on(server, model_name):
    text = "The quick brown fox"
    tokens = post(server.url, "/tokenize", {"prompt": text})["tokens"]
    [rendered] = post(server.url, "/v1/completions/render", {"prompt": text, "max_tokens": 3, "cache_salt": "s"})
    assert rendered["token_ids"] == tokens
    assert (rendered["model"], rendered["cache_salt"], rendered["sampling_params"]["max_tokens"]) == (
        model_name,
        "s",
        3,
    )
    several = post(server.url, "/v1/completions/render", {"prompt": [[5, 6, 7], [8, 9]], "truncate_prompt_tokens": 2})
    assert [r["token_ids"] for r in several] == [[6, 7], [8, 9]]
    assert several[0]["request_id"].endswith("-0") and several[1]["request_id"].endswith("-1")
    chat = post(server.url, "/v1/chat/completions/render", {"messages": HI})
    assert chat["token_ids"] == post(server.url, "/tokenize", {"messages": HI})["tokens"]
    assert refused(server.url, "/v1/completions/render", {"prompt": [5, 512]}, None)
    response = httpx.post(f"{server.url}/v1/completions/render", json={"prompt": "hi", "model": "nope"})
    assert response.status_code == 404


@pytest.mark.parametrize("prefix", ["", "get_"])
def test_sglang_metadata_paths_answer_what_sglang_router_reads(server, model_name, tiny_llama_dir, prefix):
    server_info = httpx.get(f"{server.url}/{prefix}server_info").json()
    assert (server_info["served_model_name"], server_info["dp_size"], server_info["tp_size"]) == (model_name, 1, 1)
    assert server_info["model_path"] == str(tiny_llama_dir) and server_info["context_length"] == 256
    assert server_info["max_total_tokens"] == 512 * 4 and server_info["page_size"] == 4
    model_info = httpx.get(f"{server.url}/{prefix}model_info").json()
    assert model_info["is_generation"] is True and model_info["architectures"] == ["LlamaForCausalLM"]
    assert model_info["tokenizer_path"] == str(tiny_llama_dir)


# What the peer routers send on (captured between sglang-router 0.3.2 / vllm-router 0.1.17 and this server).
SGLANG_ROUTER_FIELDS = {
    "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False,
}  # fmt: skip
SGLANG_ROUTER_CHAT_FIELDS = {
    **SGLANG_ROUTER_FIELDS, "logprobs": False, "continue_final_message": False, "separate_reasoning": True,
    "stream_reasoning": True,
}  # fmt: skip
VLLM_ROUTER_CHAT_FIELDS = {**SGLANG_ROUTER_CHAT_FIELDS, "include_reasoning": True}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 3, "echo": False, **SGLANG_ROUTER_FIELDS}),
        (CHAT, {"messages": HI, "max_completion_tokens": 3, **SGLANG_ROUTER_CHAT_FIELDS}),
        (CHAT, {"messages": HI, "max_tokens": 3, **VLLM_ROUTER_CHAT_FIELDS}),
        ("/v1/chat/completions/render", {"messages": HI, "max_tokens": 3, **VLLM_ROUTER_CHAT_FIELDS}),
        ("/v1/completions/render", {"prompt": "hi", "max_tokens": 3, "echo": False, **SGLANG_ROUTER_FIELDS}),
    ],
    ids=["sglang-completion", "sglang-chat", "vllm-router-chat", "vllm-router-chat-render", "completion-render"],
)
def test_what_the_peer_routers_send_is_accepted(server, path, body):
    for stream_it in (False, True):
        if stream_it and path.endswith("render"):
            continue
        if stream_it:
            assert stream(server.url, path, body)[-1]["choices"][0]["finish_reason"] is not None
        else:
            assert post(server.url, path, body)


def test_continuing_the_final_message_is_refused_by_name(server):
    message = refused(server.url, CHAT, {"messages": HI, "continue_final_message": True}, "continue_final_message")
    assert "new assistant message" in message
