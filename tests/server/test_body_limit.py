"""A huge body is refused with 413 before anything reads or parses it, and another client's stream runs on.

Before: a 16 MB prompt was parsed and tokenized in the server's path, another client's stream stalled for
23 s, and the request ended in a 400 anyway. The proof that nothing parses it is an event, not a duration:
the 413 arrives while the client has not sent the body (or its end), so no server could have read it whole.
(A ratio of stream gaps, measured before, broke on a loaded machine: tokens then arrive in bursts, the median
gap is near zero and any pause looks like a stall.)
"""

import json
import socket
import threading
import time
from urllib.parse import urlsplit

from prefixcache.http.flags import DEFAULT_MAX_REQUEST_BYTES
from tests.server.harness import StreamResult, stream_completion

HUGE = 16 * 1024 * 1024
CHUNK = 1 << 20
HANG_S = 60.0  # bounds a hang only: the answer is awaited as an event


def answer_before_the_body_ends(url: str, head: str, chunks: list[bytes]) -> tuple[int, dict]:
    """Send ``head`` and ``chunks`` of a body that never ends, then read the answer on the same connection.

    The connection stays open and the body unfinished while the answer is awaited: an answer that comes is
    one the server gave without the whole body.
    """
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=HANG_S) as client:
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\n{head}\r\n".encode())
        for chunk in chunks:
            client.sendall(chunk)
        received = b""
        while b"\r\n\r\n" not in received:
            received += client.recv(65536)
        header, _, body = received.partition(b"\r\n\r\n")
        lines = header.decode().split("\r\n")
        length = int(next(line.split(":", 1)[1] for line in lines if line.lower().startswith("content-length:")))
        while len(body) < length:
            body += client.recv(65536)
    return int(lines[0].split()[1]), json.loads(body)


def refuse_during_a_stream(url: str, send) -> tuple[int, dict]:
    """Run ``send()`` while a 240-token stream is flowing; the stream must run to its end untouched."""
    stream = StreamResult()
    thread = threading.Thread(target=stream_completion, args=(url, f"body-limit-{time.time()}", 240, stream))
    thread.start()
    try:
        assert stream.first_token.wait(HANG_S), "no first token"
        answer = send()
        refused_with_events = len(stream.events)
    finally:
        thread.join(HANG_S)
    assert stream.done and stream.error is None and len(stream.events) == 240
    assert refused_with_events < 240, "the stream ended before the refusal: the test measures nothing"
    return answer


def assert_413(answer: tuple[int, dict]) -> None:
    status, body = answer
    assert status == 413, body
    error = body["error"]
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]


def test_a_16_mb_content_length_gets_413_before_a_byte_of_the_body_is_sent(server):
    head = f"Content-Type: application/json\r\nContent-Length: {HUGE}\r\n"
    assert_413(refuse_during_a_stream(server.url, lambda: answer_before_the_body_ends(server.url, head, [])))


def test_a_chunked_body_is_refused_once_it_passes_the_limit_before_the_rest_is_sent(server):
    data = b"a" * CHUNK
    chunk = f"{CHUNK:x}\r\n".encode() + data + b"\r\n"
    past_the_limit = [chunk] * (DEFAULT_MAX_REQUEST_BYTES // CHUNK + 1)  # 9 of the 16 MiB, and no end chunk
    head = "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    assert_413(
        refuse_during_a_stream(server.url, lambda: answer_before_the_body_ends(server.url, head, past_the_limit))
    )
