"""Loopback stand-ins for the router's tests: an app server in a thread, a scripted backend, a KV event publisher,
and the requests and metric reads the tests send through a router.

The publisher encodes batches from plain msgpack values written from vLLM's wire format (not from the
router's decoder): frames [topic, 8-byte big-endian seq, payload], payload [ts, [events], dp_rank],
each event a map tagged under "type"; replay requests [identity, "", start_seq] on a ROUTER socket.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import msgspec
import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.core import Request as CoreRequest
from prefixcache.core import root_hash
from prefixcache.router.proxy import BACKEND_HEADER
from tests.helpers import wait_until

BLOCK_SIZE = 4
HASH_ALGO = "sha256"
HASH_SEED = "router-tests"
MODEL = "fake-model"
PROMPT = list(range(10, 30))  # 20 tokens: 4 hittable blocks of 4 (the last token is always computed)
# The router's health-check and replay timeouts in tests. On loopback they answer in milliseconds, but a loaded
# machine can pause a thread for seconds, and one failed check takes a backend out: a short timeout would take
# out a healthy backend. No test waits for them to expire (a stopped fake refuses connections at once), so
# they only bound a hang.
HANG_S = 30.0

# A stream with an odd layout on purpose (comment line, split events, usage last): it must pass unchanged.
STREAM_CHUNKS = [
    b": keep-alive\n\n",
    b'data: {"choices":[{"index":0,"text":"he"}]}\n\ndata: {"choi',
    b'ces":[{"index":0,"text":"llo"}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":'
    b'{"cached_tokens":8}}}\n\ndata: [DONE]\n\n',
]


def complete(router, prompt=PROMPT, api_key: str | None = None, **extra) -> httpx.Response:
    """A completion through the router, as a client holding ``api_key`` (None: no Authorization header)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    return httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=30)


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers[BACKEND_HEADER]


def index_blocks(router, backend) -> int:
    return router.app.state.index.num_blocks(backend.url)


def metric(router, name: str, backend=None) -> float:
    """The sample ``prefixcache:router_<name>``, for one backend or summed over all."""
    text = httpx.get(f"{router.url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == f"prefixcache:router_{name}"
        and (backend is None or sample.labels.get("backend") == backend.url)
    )


class ThreadedServer:
    """A uvicorn server on a free loopback port, in a thread; ``stop()`` shuts it down and joins."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), what="server start")
        if not self.server.started:
            raise RuntimeError("the server failed to start (see the log above)")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def cache_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "model": MODEL,
        "max_model_len": 256,
        "block_size": BLOCK_SIZE,
        "hash_algo": HASH_ALGO,
        "hash_seed": HASH_SEED,
        "enable_prefix_caching": True,
        "tenant_salt": None,
        "kv_events": None,
    }
    return {**config, **overrides}


class BackendDied(Exception):
    """Raised inside a fake's response body: uvicorn drops the connection, as when a backend process dies."""


class FakeBackend:
    """Answers like a prefixcache server, records what it got, and can be told to fail.

    Clearing ``proceed`` holds generation requests (after they are recorded) until it is set again; a held
    request whose client (the router) leaves is counted in ``abandoned`` and dropped. ``break_after`` = N drops
    the connection after N chunks of a response (a whole JSON body goes out as two chunks then), as a backend
    that dies mid-response. With ``api_key`` its cache config wants ``Authorization: Bearer <api_key>`` (401
    otherwise), as a server started with ``--api-key`` does; generation records each request's Authorization
    and X-Request-Id headers.
    """

    def __init__(self, name: str, config: dict[str, Any], api_key: str | None = None) -> None:
        self.name = name
        self.config = config
        self.api_key = api_key
        self.received: list[dict[str, Any]] = []
        self.authorizations: list[str | None] = []
        self.request_ids: list[str | None] = []
        self.config_requests = 0
        self.fail_with: int | None = None
        self.break_after: int | None = None
        self.abandoned = 0
        self.healthy = True
        self.proceed = threading.Event()
        self.proceed.set()
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/cache/config")
        async def cache_config_route(request: Request) -> Response:
            self.config_requests += 1
            if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "Incorrect or missing API key"}}, status_code=401)
            return JSONResponse(self.config)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": self.name}]}

        async def generate(request: Request) -> Response:
            body = json.loads(await request.body())
            self.received.append(body)
            self.authorizations.append(request.headers.get("authorization"))
            self.request_ids.append(request.headers.get("x-request-id"))
            if not await self._held(request):
                self.abandoned += 1
                return Response(status_code=499)
            if self.fail_with is not None:
                return JSONResponse({"error": {"message": "engine died"}}, status_code=self.fail_with)
            if body.get("stream"):
                return StreamingResponse(self._chunks(STREAM_CHUNKS), media_type="text/event-stream")
            usage = {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}
            answer = {"id": "x", "served_by": self.name, "choices": [], "usage": usage}
            if self.break_after is None:
                return JSONResponse(answer)
            whole = json.dumps(answer).encode()
            return StreamingResponse(self._chunks([whole[:10], whole[10:]]), media_type="application/json")

        app.post("/v1/completions")(generate)
        app.post("/v1/chat/completions")(generate)
        self.server = ThreadedServer(app)
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()

    async def _held(self, request: Request) -> bool:
        """Wait while ``proceed`` is clear (30 s at most, so a forgotten hold cannot hang a test); False when the
        client left meanwhile."""
        deadline = time.monotonic() + 30
        while not self.proceed.is_set() and time.monotonic() < deadline:
            if await request.is_disconnected():
                return False
            await asyncio.sleep(0.01)
        return True

    async def _chunks(self, chunks: list[bytes]):
        for sent, chunk in enumerate(chunks):
            if sent == self.break_after:
                raise BackendDied(f"{self.name} died after {sent} chunks")
            yield chunk


def event_hashes(token_ids: list[int], cache_salt: str | None = None) -> list[int]:
    """The block hashes a prefixcache engine publishes for a prompt (uint64: last 8 digest bytes, big-endian)."""
    request = CoreRequest("events", token_ids, cache_salt=cache_salt)
    digests = request.hash_blocks(
        HASH_ALGO, root_hash(HASH_ALGO, HASH_SEED), 0, len(token_ids) // BLOCK_SIZE, BLOCK_SIZE
    )
    return [int.from_bytes(d, "big") & (2**64 - 1) for d in digests]


def stored(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


CLEARED = {"type": "AllBlocksCleared"}


class FakePublisher:
    """A PUB socket and a replay ROUTER served by a thread; ``publish(..., lose=True)`` buffers without sending."""

    def __init__(self, topic: str = "kv") -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.linger = 0
        self.pub.bind("tcp://127.0.0.1:*")
        self.replay = self.context.socket(zmq.ROUTER)
        self.replay.linger = 0
        self.replay.bind("tcp://127.0.0.1:*")
        self.topic = topic
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self.next_seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    def kv_events(self) -> dict[str, Any]:
        """The ``kv_events`` entry of a backend's cache config, as a wildcard bind like the engine's."""
        port = self.endpoint.rsplit(":", 1)[1]
        replay_port = self.replay_endpoint.rsplit(":", 1)[1]
        return {
            "endpoint": f"tcp://*:{port}",
            "endpoint_bound": True,
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": self.topic,
        }

    def publish(self, events: list[dict[str, Any]], lose: bool = False, seq: int | None = None) -> int:
        seq = self.next_seq if seq is None else seq
        self.next_seq = seq + 1
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        with self._lock:
            self.buffer.append((seq, payload))
            if not lose:
                self.pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """As a restarted engine: sequence from 0 again, an empty replay buffer."""
        with self._lock:
            self.buffer.clear()
        self.next_seq = 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.pub.close()
        self.replay.close()
        self.context.term()

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self.replay.poll(50):
                continue
            identity, _, start = self.replay.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            with self._lock:
                for seq, payload in self.buffer:
                    if seq >= start_seq:
                        self.replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
                self.replay.send_multipart([identity, b"", (-1).to_bytes(8, "big", signed=True), b""])
