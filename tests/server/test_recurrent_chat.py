"""A server on a model with recurrent layers (a tiny Qwen3.5) sends each chat message's end as a checkpoint hint,
from ``/v1/chat/completions`` and from ``/v1/messages``: a later conversation sharing the first messages hits at
the block boundary before their end, where no other checkpoint rule left one."""

from __future__ import annotations

import httpx
import pytest

from prefixcache.engine.chat_breakpoints import chat_token_ids
from tests.helpers import CORPUS, build_tokenizer
from tests.model.conftest import write_checkpoint
from tests.server.harness import ServerProcess

BLOCK_SIZE = 16
ARGS = ["--block-size", str(BLOCK_SIZE), "--kv-cache-memory", "1200KiB", "--max-model-len", "512"]
SYSTEM = {"role": "system", "content": " ".join(CORPUS)}
QUESTION = {"role": "user", "content": CORPUS[1] + CORPUS[0]}
ANSWER = {"role": "assistant", "content": "Yes. " + CORPUS[3] + CORPUS[1]}


@pytest.fixture(scope="module")
def qwen35_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5-serve")
    server = ServerProcess(write_checkpoint(root / "model", "qwen3_5"), ARGS, root / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def chat(server: ServerProcess, messages: list[dict[str, str]]) -> int:
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def boundary_before_end(messages: list[dict[str, str]]) -> int:
    """The block boundary at or before the end of ``messages``, as the tiny template renders them."""
    return len(chat_token_ids(build_tokenizer(), messages, add_generation_prompt=False)) // BLOCK_SIZE * BLOCK_SIZE


def test_chat_and_messages_requests_leave_checkpoints_at_message_ends(qwen35_server):
    assert chat(qwen35_server, [SYSTEM, QUESTION, ANSWER, {"role": "user", "content": CORPUS[2]}]) == 0
    other_answer = {"role": "assistant", "content": "No. " + CORPUS[2]}
    assert chat(qwen35_server, [SYSTEM, QUESTION, other_answer, {"role": "user", "content": CORPUS[0]}]) == (
        boundary_before_end([SYSTEM, QUESTION])
    )
    # /v1/messages (system apart, as Anthropic's API takes it) sends its message ends too: the next conversation
    # sharing its first three messages hits past the checkpoint the chat completions left.
    model = httpx.get(f"{qwen35_server.url}/v1/models").json()["data"][0]["id"]
    body = {
        "model": model,
        "system": SYSTEM["content"],
        "messages": [QUESTION, ANSWER, {"role": "user", "content": CORPUS[3]}],
        "max_tokens": 2,
    }
    httpx.post(f"{qwen35_server.url}/v1/messages", json=body, timeout=120).raise_for_status()
    expected = boundary_before_end([SYSTEM, QUESTION, ANSWER])
    assert expected > boundary_before_end([SYSTEM, QUESTION])
    assert chat(qwen35_server, [SYSTEM, QUESTION, ANSWER, {"role": "user", "content": "Why?"}]) == expected
