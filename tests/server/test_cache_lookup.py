"""``POST /v1/cache/lookup`` and the missed-token counters, against a real server (4-token blocks)."""

import json

import httpx
import pytest

from prefixcache.cli import main
from tests.helpers import scrape
from tests.server.harness import API_KEY, OTHER_API_KEY, delta, random_prompt

MISSED = "prefixcache:prefix_cache_missed_tokens_total"


def lookup(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/cache/lookup", json=body, timeout=30)


def complete(server, **body) -> dict:
    body = {"max_tokens": 1, "temperature": 0, "ignore_eos": True, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def missed_by_reason(server) -> dict[str, float]:
    prefix = MISSED + '{reason="'
    return {name[len(prefix) : -2]: value for name, value in scrape(server.url).items() if name.startswith(prefix)}


def test_lookup_predicts_the_hit_of_the_next_request(server):
    prompt = random_prompt("lookup-predicts", 18)
    before = lookup(server, prompt=prompt).json()
    assert before["prompt_tokens"] == 18
    assert (before["cached_tokens"], before["cached_prefix_end"]) == (0, 0)
    assert before["first_miss_reason"] == "new"
    assert before["missed_tokens"] == {
        "new": 16,
        "evicted": 0,
        "expired": 0,
        "evicted_below_retained": 0,
        "partial_block": 2,
        "skipped": 0,
        "no_checkpoint": 0,
    }
    complete(server, prompt=prompt)
    # any completion field is accepted, and the sampling ones are not used
    after = lookup(server, prompt=[prompt], max_tokens=99, temperature=0.5, n=2, stream=True, echo=True).json()
    assert (after["cached_tokens"], after["first_miss_reason"]) == (16, "partial_block")
    assert after["cached_tokens_by_tier"] == {"device": 16}  # no offload tiers
    usage = complete(server, prompt=prompt)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == after["cached_tokens"]
    assert lookup(server, prompt=prompt, cache_salt="another-tenant").json()["cached_tokens"] == 0


def test_chat_bodies_go_through_the_template_and_token_ids_come_back(server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    found = lookup(server, messages=messages, return_token_ids=True).json()
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1, "temperature": 0},
        timeout=60,
    ).json()
    assert found["prompt_tokens"] == chat["usage"]["prompt_tokens"] == len(found["prompt_token_ids"])
    text = "".join(found["prompt_token_texts"])
    assert "You are terse." in text and "Name a colour." in text
    again = lookup(server, messages=messages).json()
    assert again["cached_tokens"] == (found["prompt_tokens"] - 1) // 4 * 4
    assert "prompt_token_ids" not in again


def test_lookups_count_nothing_and_requests_count_missed_tokens_by_reason(server):
    prompt = random_prompt("lookup-metrics", 10)
    metrics, missed = scrape(server.url), missed_by_reason(server)
    for _ in range(3):
        lookup(server, prompt=prompt)
    assert delta(metrics, scrape(server.url), "prefix_cache_queries") == 0
    assert missed_by_reason(server) == missed
    complete(server, prompt=prompt)
    after = missed_by_reason(server)
    assert {reason: after[reason] - missed.get(reason, 0) for reason in after} == {
        "new": 8,
        "evicted": 0,
        "expired": 0,
        "evicted_below_retained": 0,
        "partial_block": 2,
        "skipped": 0,
        "no_checkpoint": 0,
    }


def test_bad_lookup_bodies_are_clear_400s(server):
    """Refused as the completions and chat endpoints refuse them, plus what only a lookup cannot take."""
    cases = [
        ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "either prompt"),
        ({"max_tokens": 3}, "either prompt"),
        ({"prompt": ""}, "prompt must not be empty"),
        ({"prompt": ["one", "two"]}, "a lookup takes one prompt"),
        ({"prompt": [1, 2], "cache_salt": ""}, "cache_salt: cache_salt must be"),
        ({"prompt": [1, 2], "best_of": 2}, "best_of: unsupported parameter"),
        ({"prompt": [1, 2], "top_logprobs": 2}, "top_logprobs: unsupported parameter"),  # a chat field
        ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options is only allowed"),
        ({"prompt": [1, 2], "return_token_ids": "maybe"}, "return_token_ids"),
        ({"prompt": [10**9]}, "prompt token ids must be in"),
        ({"prompt": [1] * 257}, "context length of 256"),
        ({"messages": []}, "messages: messages must not be empty"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages.0.tool_calls"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs is only allowed"),
    ]
    for body, message in cases:
        response = lookup(server, **body)
        assert response.status_code == 400, body
        assert message in response.json()["error"]["message"], response.json()
    for content in (b"[1, 2]", b"{not json"):
        response = httpx.post(f"{server.url}/v1/cache/lookup", content=content, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["message"]
    unknown = lookup(server, prompt="hi", model="no-such-model")
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_lookup_sees_only_its_own_tenants_blocks(secured_server):
    """The tenant's salt comes from the API key, as for generation: a lookup cannot probe another tenant."""
    url, prompt = secured_server.url, random_prompt("lookup-tenant", 13)

    def cached(key: str, **body) -> int:
        response = httpx.post(
            f"{url}/v1/cache/lookup",
            json={"prompt": prompt, **body},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        response.raise_for_status()
        return response.json()["cached_tokens"]

    response = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "model": "tiny"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    response.raise_for_status()
    assert cached(API_KEY) == 12
    assert cached(API_KEY, cache_salt="own") == 0  # a salt splits the tenant further
    assert cached(OTHER_API_KEY) == 0
    assert httpx.post(f"{url}/v1/cache/lookup", json={"prompt": prompt}, timeout=30).status_code == 401


def test_explain_reads_a_log_through_the_server(server, tmp_path, capsys):
    """--base-url: the server tokenizes (its chat template) and reports what its cache holds now."""
    system = "Request {rid}. You are a helpful assistant. Answer briefly and truthfully."
    bodies = [
        {"messages": [{"role": "system", "content": system.format(rid=rid)}, {"role": "user", "content": "Hi"}]}
        for rid in ("a17", "b42", "c99", "d05")
    ]
    httpx.post(
        f"{server.url}/v1/chat/completions", json={**bodies[0], "max_tokens": 1, "temperature": 0}, timeout=60
    ).raise_for_status()
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join([json.dumps(bodies[0]), json.dumps({"prompt": ""}), *map(json.dumps, bodies[1:])]) + "\n")
    out_json = tmp_path / "report.json"
    main(["explain", str(log), "--base-url", server.url, "--json", str(out_json)])
    printed = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["config"]["block_size"] == 4  # the server's
    first, second = report["requests"][0]["live_cached"], report["requests"][1]["live_cached"]
    assert first > second  # the server has run the first prompt, not the second
    assert report["errors"] == [{"line": 2, "message": report["errors"][0]["message"]}]
    assert "empty" in report["errors"][0]["message"]
    divergence = report["divergence"]
    assert divergence["kind"] == "varying" and divergence["shared_text"].endswith("Request")
    assert "the server's cache now" in printed


def test_explain_refuses_a_block_size_other_than_the_servers(server, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"prompt": [5, 6, 7, 8, 9]}) + "\n")
    with pytest.raises(SystemExit) as exited:
        main(["explain", str(log), "--base-url", server.url, "--block-size", "16"])
    assert exited.value.code == 2
    assert "differs from the server's block size 4" in capsys.readouterr().err
