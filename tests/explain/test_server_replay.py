"""``explain --base-url`` against a real ``prefixcache serve`` of a hybrid model (a tiny Gemma 3): the replay
admits through the server's KV cache groups, so with the server's capacity it reports the server's own hits."""

import dataclasses
import json
import random
import re

import httpx
import pytest
from fastapi import FastAPI

from prefixcache.cli import main
from prefixcache.core import FULL_ATTENTION
from prefixcache.explain.analysis import ExplainConfig, explain
from prefixcache.explain.log import Prompt, read_log
from prefixcache.explain.sources import server_cache, server_client, through_server, through_tokenizer
from tests.explain.conftest import decode_ids
from tests.helpers import hybrid_workload, wait_until
from tests.router.fakes import ThreadedServer
from tests.server.harness import ServerProcess

BLOCK_SIZE = 16
NUM_BLOCKS = 36
# Each prompt in one chunk, as the replay admits it; a small pool, so that it evicts.
SERVE_ARGS = ["--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--dtype", "float32"]


def test_explain_replays_a_hybrid_servers_cache_hit_for_hit(tiny_gemma3_dir, tmp_path):
    prompts = hybrid_workload("hybrid-explain", 32, BLOCK_SIZE)
    server = ServerProcess(tiny_gemma3_dir, SERVE_ARGS, tmp_path / "serve.log")
    try:
        server.wait_ready()
        served = []
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            served.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        log, out = tmp_path / "log.jsonl", tmp_path / "report.json"
        log.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        capacity = str(NUM_BLOCKS * BLOCK_SIZE)
        main(["explain", str(log), "--base-url", server.url, "--capacity-tokens", capacity, "--json", str(out)])
    finally:
        server.stop()
    report = json.loads(out.read_text())
    windows = [group["sliding_window"] for group in report["config"]["kv_cache_groups"]]
    assert windows == [32, None, 32]  # the server's groups
    assert [r["capacity_hit"] for r in report["requests"]] == served
    assert report["hit_rate"]["capacity"] == sum(served) / sum(map(len, prompts)) > 0
    # one full-attention group (what explain assumed before servers reported their groups) replays otherwise
    one_group = ExplainConfig(BLOCK_SIZE, NUM_BLOCKS * BLOCK_SIZE, kv_cache_groups=(FULL_ATTENTION,))
    logged = [Prompt(line, p) for line, p in enumerate(prompts, start=1)]
    assert [r.capacity_hit for r in explain(logged, one_group, decode_ids).requests] != served


@pytest.mark.parametrize(
    ("kind", "state", "message"),
    [
        ("cross_attention", None, "cannot replay a KV cache group of kind 'cross_attention'"),
        ("mamba", None, "reports no budget of its state checkpoints"),  # a server from before it reported one
    ],
)
def test_a_group_explain_cannot_replay_stops_it_with_the_kind(kind, state, message):
    app = FastAPI()
    groups = [
        {"group_idx": 0, "kind": "full_attention", "block_size": 16, "sliding_window": None},
        {"group_idx": 1, "kind": kind, "block_size": 16, "sliding_window": None},
    ]
    app.get("/v1/cache/config")(lambda: {"kv_cache_groups": groups, "recurrent_state": state})
    server = ThreadedServer(app)
    client = server_client(server.url, None)
    try:
        with pytest.raises(SystemExit, match=message):
            server_cache(client)
    finally:
        client.close()
        server.stop()


def test_a_servers_render_places_breakpoints_where_the_model_s_template_does(tiny_llama_dir, tmp_path):
    """``--base-url`` reads a chat's ``cache_control`` through the server's chat render; the ranges (and the body's
    own ``retention``) are the ones the tokenizer path finds."""
    control, part_control = {"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral"}
    bodies = [
        {
            "messages": [
                {"role": "system", "content": "You are brief.", "cache_control": control},
                {"role": "user", "content": [{"type": "text", "text": "Hi there", "cache_control": part_control},
                                             {"type": "text", "text": " and more"}]},
            ],
            "retention": [{"token_start": 0, "token_end": 3, "priority": 20}],
        },
        {"prompt": [5, 6, 7, 8, 9], "prompt_cache_retention": "24h"},
    ]  # fmt: skip
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    logged, _ = read_log(log)
    local, errors, _, _, _ = through_tokenizer(logged, str(tiny_llama_dir))
    assert errors == [] and len(local[0].retention) == 3  # two breakpoints, then the body's range
    server = ServerProcess(tiny_llama_dir, ["--dtype", "float32"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        client = server_client(server.url, None)
        try:
            remote, errors, _, _, _ = through_server(logged, client)
        finally:
            client.close()
    finally:
        server.stop()
    assert errors == []
    assert [p.token_ids for p in remote] == [p.token_ids for p in local]
    assert [p.retention for p in remote] == [p.retention for p in local]


MESSAGES_SYSTEM = "You are a helpful assistant. Answer briefly and truthfully. " * 6
HOUR = {"type": "ephemeral", "ttl": "1h"}
MESSAGES_TOOLS = [
    {"name": "lookup", "description": "Find a word", "input_schema": {"type": "object"}, "cache_control": HOUR}
]


def _flood(seed: int) -> str:
    """About 285 tokens of the tiny tokenizer that no other prompt shares: 18 of the pool's 24 blocks."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(300))


def _messages_log() -> list[dict]:
    """/v1/messages bodies: questions behind a marked system prompt and tool, between floods of unique prompts that
    evict every plain block, and a question marked by a top-level cache_control (asked again after a flood)."""
    system = [{"type": "text", "text": MESSAGES_SYSTEM, "cache_control": {"type": "ephemeral"}}]

    def asked(question: str) -> dict:
        return {"model": "m", "max_tokens": 1, "system": system, "tools": MESSAGES_TOOLS,
                "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}]}  # fmt: skip

    def flood(seed: int) -> dict:
        return {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": _flood(seed)}]}

    text = "Prefix caching reuses the keys and values of shared prompt prefixes."
    marked = {"model": "m", "max_tokens": 1, "cache_control": {"type": "ephemeral"},
              "messages": [{"role": "user", "content": text}]}  # fmt: skip
    return [asked("Why cache?"), flood(1), flood(2), asked("What is a block?"), marked, flood(3), marked,
            flood(4), asked("Why 16 tokens?")]  # fmt: skip


def test_explain_reads_messages_api_logs_and_replays_the_servers_hits(tiny_llama_dir, tmp_path):
    """A log of /v1/messages bodies (system blocks, tools with input_schema, cache_control on a block, a tool and the
    request) read through the server's own conversion: the replay's hits, through the tokenizer and through the
    server, are the hits the server logged for each request; without the breakpoints they would not be (the floods
    evict every plain block)."""
    bodies = _messages_log()
    server = ServerProcess(tiny_llama_dir, [*SERVE_ARGS, "--served-model-name", "m"], tmp_path / "serve.log")
    log, local, remote = tmp_path / "log.jsonl", tmp_path / "local.json", tmp_path / "remote.json"
    log.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    capacity = str(NUM_BLOCKS * BLOCK_SIZE)
    try:
        server.wait_ready()
        for index, body in enumerate(bodies):
            headers = {"X-Request-Id": f"messages-{index}"}
            body = {**body, "temperature": 0}
            response = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=60)
            assert response.status_code == 200, response.text

        def logged() -> list[str]:
            lines = [line for line in server.log().splitlines() if "POST /v1/messages 200" in line]
            return lines if len(lines) == len(bodies) else []

        wait_until(logged, what="the request log lines")  # written once each response is sent
        by_id = {re.search(r"request_id=(\S+)", line)[1]: line for line in logged()}
        served = [int(re.search(r"cached_tokens=(\d+)", by_id[f"messages-{i}"])[1]) for i in range(len(bodies))]
        main(["explain", str(log), "--base-url", server.url, "--capacity-tokens", capacity, "--json", str(remote)])
    finally:
        server.stop()
    common = ["--block-size", str(BLOCK_SIZE), "--capacity-tokens", capacity, "--json", str(local)]
    main(["explain", str(log), "--model", str(tiny_llama_dir), *common])
    for report in (json.loads(local.read_text()), json.loads(remote.read_text())):
        assert report["errors"] == []
        assert [r["capacity_hit"] for r in report["requests"]] == served
    assert served[3] >= 96 and served[6] > 0 and served[8] >= 96  # the marked prefixes outlived the floods
    logged_bodies, _ = read_log(log)
    prompts, _, _, _, _ = through_tokenizer(logged_bodies, str(tiny_llama_dir))
    assert all(p.retention for i, p in enumerate(prompts) if i in (0, 3, 4, 6, 8))
    config = ExplainConfig(BLOCK_SIZE, NUM_BLOCKS * BLOCK_SIZE)
    plain = [dataclasses.replace(p, retention=()) for p in prompts]
    assert [r.capacity_hit for r in explain(plain, config, decode_ids).requests] != served
