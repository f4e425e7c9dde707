"""What one client can do to the router and the others: huge bodies, overlong prompts, leaving, a backend dying.

Before: a 12 MB body was read, tokenized and hashed for 21 s before the backend refused it, and a small request
sent alongside waited as long; a client that left a whole (non-streaming) request left the backend computing;
a backend dying mid-stream gave the client a cleanly closed stream without an error.
"""

import socket
import statistics
import threading
import time

import httpx
import pytest

from prefixcache.http.flags import DEFAULT_MAX_REQUEST_BYTES
from prefixcache.model.loader import load_tokenizer
from tests.helpers import wait_until
from tests.router.fakes import MODEL, PROMPT, complete, metric, served_by

# A small request's median latency while huge bodies are refused, over its median latency before: the old
# router stalled it for the whole tokenization (over 1000 times); reading and dropping 8 MB costs a few times.
MAX_SLOWDOWN = 50


class RecordingTokenizer:
    """The tokenizer, recording how many characters each tokenization was handed."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, **kwargs)

    def apply_chat_template(self, messages, tokenize=True, **kwargs):
        if tokenize:
            self.lengths.append(len(self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)))
        return self.tokenizer.apply_chat_template(messages, tokenize=tokenize, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def small_latency(router) -> float:
    start = time.perf_counter()
    served_by(complete(router, prompt="The quick brown fox jumps over the lazy dog."))
    return time.perf_counter() - start


def test_a_body_over_the_cap_is_refused_before_parsing_and_a_small_request_alongside_is_not_slowed(
    backend, router, tokenizer
):
    a = backend("a")
    r = router([a], tokenizer=tokenizer)
    unloaded = statistics.median(small_latency(r) for _ in range(7))
    digits = b"0 1 2 3 4 5 6 7 8 9 " * 600_000  # 12 MB, about a token for every two characters
    huge = b'{"model": "fake-model", "max_tokens": 1, "prompt": "' + digits + b'"}'
    assert len(huge) > DEFAULT_MAX_REQUEST_BYTES
    statuses: list[int] = []
    stop = threading.Event()

    def send_huge_bodies() -> None:
        def chunks():  # chunked, so the router must read up to the cap before it can refuse
            for start in range(0, len(huge), 1 << 20):
                yield huge[start : start + (1 << 20)]

        while not stop.is_set():
            statuses.append(httpx.post(f"{r.url}/v1/completions", content=chunks(), timeout=120).status_code)

    sender = threading.Thread(target=send_huge_bodies)
    sender.start()
    try:
        wait_until(lambda: statuses, timeout=120, what="the first huge body's answer")
        loaded = statistics.median(small_latency(r) for _ in range(7))
    finally:
        stop.set()
        sender.join(120)
    print(f"small request: {unloaded * 1000:.1f} ms alone, {loaded * 1000:.1f} ms beside huge bodies")
    assert set(statuses) == {413}
    assert len(a.received) == 14  # the huge bodies never reached the backend
    assert loaded / unloaded < MAX_SLOWDOWN


def test_a_prompt_longer_than_the_context_is_refused_without_tokenizing_it(backend, router, tokenizer):
    a = backend("a")  # a context of 256 tokens
    recording = RecordingTokenizer(tokenizer)
    r = router([a], tokenizer=recording)
    long_text = "hello world " * 10_000

    def refused(path: str, body: dict) -> str:
        response = httpx.post(f"{r.url}{path}", json={"model": MODEL, **body}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        return error["message"]

    assert "context length of 256 tokens" in refused("/v1/completions", {"prompt": long_text})
    chat = {"messages": [{"role": "user", "content": long_text}]}
    assert "context length of 256 tokens" in refused("/v1/chat/completions", chat)
    assert max(recording.lengths, default=0) < len(long_text) // 10  # neither was tokenized
    assert refused("/v1/completions", {"prompt": list(range(2, 302))}) == (
        "prompt (300 tokens) exceeds the model's context length of 256 tokens"
    )
    # short enough to be tokenized, and then too long: the exact count, as the server says it
    digits = "0 1 2 3 4 5 6 7 8 9 " * 30
    count = len(tokenizer.encode(digits, add_special_tokens=False))
    assert count > 256
    assert refused("/v1/completions", {"prompt": digits}) == (
        f"prompt ({count} tokens) exceeds the model's context length of 256 tokens"
    )
    assert a.received == []
    assert served_by(complete(r, prompt="The quick brown fox")) == a.url


def stream_lines(router, **extra) -> list[str]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "stream": True, **extra}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def test_a_backend_dying_mid_stream_ends_the_stream_with_an_error_event(backend, router):
    a = backend("a")
    r = router([a])
    a.break_after = 1  # after the keep-alive comment: the stream is between events
    lines = stream_lines(r)
    assert lines[0] == ": keep-alive" and lines[-1] == "data: [DONE]" and len(lines) == 3
    error = httpx.Response(200, content=lines[1].removeprefix("data: ")).json()["error"]
    assert error["type"] == "server_error" and "the backend failed mid-response" in error["message"]
    assert metric(r, "broken_responses_total", a) == 1
    # in the middle of an event nothing can be appended that a client would parse: the connection is dropped
    a.break_after = 2
    with pytest.raises(httpx.RemoteProtocolError):
        stream_lines(r)
    a.break_after = None
    assert stream_lines(r)[-1] == "data: [DONE]"
    assert r.app.state.pool.backends[0].requests_in_flight == 0


def test_a_backend_dying_mid_body_drops_the_clients_connection(backend, router):
    a = backend("a")
    r = router([a])
    a.break_after = 1
    with pytest.raises(httpx.RemoteProtocolError):
        complete(r)
    assert metric(r, "broken_responses_total", a) == 1
    assert r.app.state.pool.backends[0].requests_in_flight == 0


def test_a_client_leaving_a_whole_request_cancels_it_at_the_backend(backend, router):
    a = backend("a")
    r = router([a])
    a.proceed.clear()
    host, port = r.url.removeprefix("http://").split(":")
    body = b'{"model": "fake-model", "prompt": [10, 11, 12, 13, 14], "max_tokens": 1}'
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port))) as client:
        client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: a.received, what="the request at the backend")
    wait_until(lambda: a.abandoned == 1, what="the backend to see the router leave")
    wait_until(lambda: r.app.state.pool.backends[0].requests_in_flight == 0, what="the router to release its load")
    a.proceed.set()
    assert served_by(complete(r)) == a.url


def test_the_router_gives_each_request_one_id_that_the_backend_sees_too(backend, router):
    a = backend("a")
    r = router([a])
    chosen = complete(r)
    given = httpx.post(
        f"{r.url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1},
        headers={"X-Request-Id": "client-id-1"},
        timeout=30,
    )
    assert [chosen.headers.get_list("x-request-id"), given.headers.get_list("x-request-id")] == [
        [a.request_ids[0]],
        ["client-id-1"],
    ]
    assert a.request_ids[1] == "client-id-1"
    bad = httpx.post(f"{r.url}/v1/completions", json={"prompt": PROMPT}, headers={"X-Request-Id": "a b"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_the_router_takes_the_servers_body_cap_flag():
    from prefixcache.cli import build_parser

    args = build_parser().parse_args(["router", "--backend", "http://127.0.0.1:8000", "--max-request-bytes", "1MiB"])
    assert args.max_request_bytes == 1 << 20
    assert build_parser().parse_args(["router", "--backend", "http://x"]).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
