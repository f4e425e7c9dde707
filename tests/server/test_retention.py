"""Retention directives on the OpenAI endpoints: where ``cache_control`` breakpoints land (shown by the render
endpoints, the ranges the request runs with), ``retention`` and ``prompt_cache_retention`` as ranges, bad
directives refused by name, and the retained tokens in the usage."""

import json
import math

import httpx
import pytest

from prefixcache.core.retention import RetentionRange
from prefixcache.http.retention import BREAKPOINT_PRIORITY, PERSISTENT_PRIORITY, CacheControl, breakpoint_ranges
from tests.server.harness import API_KEY
from tests.server.test_client_fields import CHAT, COMPLETIONS, post, refused

SYSTEM = "You are a helpful assistant. Answer briefly and truthfully."
EPHEMERAL_1H = {"type": "ephemeral", "ttl": "1h"}
EPHEMERAL = {"type": "ephemeral"}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Find a word", "parameters": {}}}
RETAINED_FIELDS = {"retained_written_tokens", "retained_written_5m_tokens", "retained_written_1h_tokens",
                   "retained_read_tokens"}  # fmt: skip
BLOCK = 4  # SERVER_ARGS' block size


def tokens(url: str, text: str) -> list[int]:
    return post(url, "/tokenize", {"prompt": text})["tokens"]


def rendered_chat(url: str, body: dict) -> dict:
    return post(url, f"{CHAT}/render", {"max_tokens": 2, **body})


def test_breakpoints_land_after_system_part_message_and_tool(server):
    """The tiny template: ``<|tools|>`` JSON lines ``<|end|>``, then ``<|role|>content<|end|>`` per message."""
    body = {
        "tools": [{**TOOL, "cache_control": EPHEMERAL_1H}],
        "messages": [
            {"role": "system", "content": SYSTEM, "cache_control": EPHEMERAL_1H},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "The quick brown fox.", "cache_control": EPHEMERAL},
                    {"type": "text", "text": " Jumps over"},
                ],
            },
        ],
    }
    answer = rendered_chat(server.url, body)
    tools = "<|tools|>\n" + json.dumps(TOOL) + "\n"
    system = tools + f"<|end|><|system|>{SYSTEM}<|end|>"
    part = system + "<|user|>The quick brown fox."
    ends = [len(tokens(server.url, prefix)) for prefix in (tools, system, part)]
    assert answer["token_ids"][: ends[2]] == tokens(server.url, part)
    hour, five = BREAKPOINT_PRIORITY["1h"], BREAKPOINT_PRIORITY["5m"]
    # Disjoint ranges, each at the strongest breakpoint covering it.
    assert answer["retention"] == [
        {"token_start": 0, "token_end": ends[0], "priority": hour, "duration_ms": 3_600_000},
        {"token_start": ends[0], "token_end": ends[1], "priority": hour, "duration_ms": 3_600_000},
        {"token_start": ends[1], "token_end": ends[2], "priority": five, "duration_ms": 300_000},
    ]


def test_retention_ranges_and_prompt_cache_retention_reach_the_request(server):
    ranges = [{"token_start": 0, "token_end": 8, "priority": 90, "duration_ms": 60_000}]
    [answer] = post(
        server.url,
        f"{COMPLETIONS}/render",
        {"prompt": list(range(2, 22)), "retention": ranges, "prompt_cache_retention": "24h"},
    )
    persistent = {"token_start": 0, "token_end": None, "priority": PERSISTENT_PRIORITY, "duration_ms": 86_400_000}
    assert answer["retention"] == [*ranges, persistent]
    chat = rendered_chat(server.url, {"messages": [{"role": "user", "content": "hi"}], "retention": ranges})
    assert chat["retention"] == ranges
    # in_memory is what every request gets: no range
    [plain] = post(server.url, f"{COMPLETIONS}/render", {"prompt": [5, 6], "prompt_cache_retention": "in_memory"})
    assert plain["retention"] == []


def _breakpoints(count: int) -> list[dict]:
    return [{"role": "user", "content": f"turn {i}", "cache_control": EPHEMERAL} for i in range(count)]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, {"messages": _breakpoints(5)}, "cache_control"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
            "ttl",
        ),
        (CHAT, {"messages": [{"role": "user", "content": "hi", "cache_control": {"type": "persistent"}}]}, "type"),
        (COMPLETIONS, {"prompt": [5, 6, 7], "retention": [{"token_start": 0, "priority": 101}]}, "priority"),
        (COMPLETIONS, {"prompt": [5, 6, 7], "retention": [{"token_start": 0, "priority": -1}]}, "priority"),
        (
            COMPLETIONS,
            {"prompt": [5, 6, 7], "retention": [{"token_start": 0, "token_end": 9, "priority": 50}]},
            "retention",
        ),
        (COMPLETIONS, {"prompt": [5, 6, 7], "retention": [{"token_start": 3, "priority": 50}]}, "retention"),
        (
            COMPLETIONS,
            {"prompt": [5, 6, 7], "retention": [{"token_start": 2, "token_end": 1, "priority": 50}]},
            "token_end",
        ),
        (
            COMPLETIONS,
            {"prompt": [5, 6, 7], "retention": [{"token_start": 0, "priority": 50, "duration_ms": 0}]},
            "duration_ms",
        ),
        (COMPLETIONS, {"prompt": [5, 6, 7], "prompt_cache_retention": "1w"}, "prompt_cache_retention"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi", "cache_control": EPHEMERAL}], "truncate_prompt_tokens": 2},
            "truncate_prompt_tokens",
        ),
    ],
    ids=[
        "5th-breakpoint",
        "ttl",
        "type",
        "priority-high",
        "priority-low",
        "end-past-prompt",
        "start-past-prompt",
        "end-before-start",
        "duration",
        "prompt-cache-retention",
        "truncated",
    ],
)
def test_bad_directives_are_a_400_naming_the_field(server, path, body, field):
    for endpoint in (path, f"{path}/render"):
        response = httpx.post(f"{server.url}{endpoint}", json={"max_tokens": 2, **body}, timeout=60)
        assert response.status_code == 400, response.text
        assert field in response.json()["error"]["message"]


def test_past_the_prompt_names_retention_as_the_param(server):
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "retention": [{"token_start": 0, "token_end": 9, "priority": 50}]}
    assert "past the prompt" in refused(server.url, COMPLETIONS, body, "retention")


def test_tools_on_completions_are_still_refused(server):
    assert "tool calling" in refused(server.url, COMPLETIONS, {"prompt": "hi", "tools": [TOOL]}, "tools")


def test_usage_reports_retained_tokens_only_where_directives_were_given(server):
    system = {"role": "system", "content": SYSTEM + " (usage)", "cache_control": EPHEMERAL_1H}
    body = {"messages": [system, {"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    details = post(server.url, CHAT, body)["usage"]["prompt_tokens_details"]
    assert set(details) == {"cached_tokens", *RETAINED_FIELDS}
    assert details["retained_written_tokens"] > 0
    retained = details["retained_written_tokens"] + details["retained_read_tokens"]
    again = post(server.url, CHAT, body)["usage"]["prompt_tokens_details"]
    assert (again["retained_read_tokens"], again["retained_written_tokens"]) == (retained, 0)
    plain = post(server.url, CHAT, {**body, "messages": [{"role": "user", "content": "hi"}]})
    assert set(plain["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    streamed = httpx.post(
        f"{server.url}{CHAT}",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    )
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["retained_read_tokens"] == retained


def _written_split(details: dict) -> tuple[int, int, int]:
    return tuple(details[f"retained_written{kind}_tokens"] for kind in ("", "_5m", "_1h"))


def _streamed_usage(url: str, body: dict) -> dict:
    streamed = httpx.post(
        f"{url}{CHAT}", json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=60
    )
    assert streamed.status_code == 200, streamed.text
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    return chunks[-1]["usage"]


def test_written_tokens_are_split_by_the_ttl_their_blocks_are_kept_for(server):
    """A 1h tool before a 5m system message (the tiny template renders the tools first): the whole blocks before
    the tool's end are written for an hour, those between it and the system message's end for 5 minutes (a
    block across the tool's end lies wholly inside neither range: not retained). Whole and streamed alike; the
    second call reads it all and writes nothing; without a directive the fields are absent."""
    system = {"role": "system", "content": SYSTEM + " (split)", "cache_control": EPHEMERAL}
    body = {
        "tools": [{**TOOL, "cache_control": EPHEMERAL_1H}],
        "messages": [system, {"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "cache_salt": "ttl-split",  # nothing cached before
    }
    hour, five = rendered_chat(server.url, body)["retention"]
    assert (hour["duration_ms"], five["duration_ms"]) == (3_600_000, 300_000)
    written_1h = hour["token_end"] // BLOCK * BLOCK
    written_5m = (five["token_end"] // BLOCK - math.ceil(five["token_start"] / BLOCK)) * BLOCK
    assert written_1h > 0 and written_5m > 0
    first = post(server.url, CHAT, body)["usage"]["prompt_tokens_details"]
    assert _written_split(first) == (written_1h + written_5m, written_5m, written_1h)
    assert first["retained_read_tokens"] == 0
    again = post(server.url, CHAT, body)["usage"]["prompt_tokens_details"]
    assert _written_split(again) == (0, 0, 0) and again["retained_read_tokens"] == written_1h + written_5m
    streamed = _streamed_usage(server.url, {**body, "cache_salt": "ttl-split-streamed"})["prompt_tokens_details"]
    assert _written_split(streamed) == (written_1h + written_5m, written_5m, written_1h)
    plain = {**body, "tools": [TOOL], "messages": [{"role": "user", "content": "hi"}]}
    assert set(post(server.url, CHAT, plain)["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    assert set(_streamed_usage(server.url, plain)["prompt_tokens_details"]) == {"cached_tokens"}


def test_a_clamped_directive_runs_and_the_usage_says_which_bound(secured_server):
    """The secured server allows TTLs up to 30 minutes: an hour-long breakpoint is clamped, a 5-minute one not."""
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def usage(ttl: str) -> dict:
        system = {
            "role": "system",
            "content": f"{SYSTEM} ({ttl} clamp)",
            "cache_control": {"type": "ephemeral", "ttl": ttl},
        }
        body = {"messages": [system, {"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(f"{secured_server.url}{CHAT}", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    assert usage("1h")["retention_clamped"] == "max_retention_ttl_s"
    assert "retention_clamped" not in usage("5m")


def test_breakpoints_become_disjoint_ranges_at_the_strongest_covering_directive():
    """A later, longer-lived breakpoint covers everything before it too; a repeated or empty one adds nothing."""
    five, hour = CacheControl(type="ephemeral"), CacheControl(type="ephemeral", ttl="1h")
    assert breakpoint_ranges([8, 20, 20, 0], [five, hour, five, hour]) == [
        RetentionRange(0, 8, BREAKPOINT_PRIORITY["1h"], 3600.0),
        RetentionRange(8, 20, BREAKPOINT_PRIORITY["1h"], 3600.0),
    ]
    assert breakpoint_ranges([20, 8], [five, hour]) == [
        RetentionRange(0, 8, BREAKPOINT_PRIORITY["1h"], 3600.0),
        RetentionRange(8, 20, BREAKPOINT_PRIORITY["5m"], 300.0),
    ]


def test_the_openai_sdk_sends_the_directives_and_reads_the_counts(client, model_name):
    system = {"role": "system", "content": "0123456789 abcdefghijklmnopqrstuvwxyz (sdk)", "cache_control": EPHEMERAL}
    ask = {"model": model_name, "max_tokens": 2, "messages": [system, {"role": "user", "content": "hi"}]}
    first = client.chat.completions.create(**ask, prompt_cache_retention="24h").usage.prompt_tokens_details
    second = client.chat.completions.create(**ask, prompt_cache_retention="24h").usage.prompt_tokens_details
    assert first.retained_written_tokens > 0
    retained = first.retained_written_tokens + first.retained_read_tokens
    assert (second.retained_read_tokens, second.retained_written_tokens) == (retained, 0)
    assert second.cached_tokens >= retained
    # 24h keeps the whole request longer than 5 minutes: what was written is on the 1h side of the split
    assert (first.retained_written_1h_tokens, first.retained_written_5m_tokens) == (first.retained_written_tokens, 0)
    assert (second.retained_written_1h_tokens, second.retained_written_5m_tokens) == (0, 0)
    # streamed, its 5m breakpoint alone (another salt: nothing cached): what it writes is on the 5m side
    fresh = {**ask, "stream": True, "stream_options": {"include_usage": True}, "extra_body": {"cache_salt": "sdk"}}
    streamed = list(client.chat.completions.create(**fresh))[-1].usage.prompt_tokens_details
    assert streamed.retained_written_5m_tokens == streamed.retained_written_tokens > 0
    assert streamed.retained_written_1h_tokens == 0
