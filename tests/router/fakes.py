"""Loopback stand-ins for the router's tests: an app server in a thread, a scripted backend, a KV event publisher,
and the requests and metric reads the tests send through a router.

The publisher encodes batches from plain msgpack values written from vLLM's wire format (not from the
router's decoder): frames [topic, 8-byte big-endian seq, payload], payload [ts, [events], dp_rank],
each event a map tagged under "type"; replay requests [identity, "", start_seq] on a ROUTER socket.
"""

from __future__ import annotations

import asyncio
import json
import random
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
    """A PUB socket and a replay ROUTER served by a thread; ``publish(..., lose=True)`` buffers without sending.

    ``replay_topic``: replies carry the topic before the sequence number, as vLLM 0.32 sends them.
    ``replay_prefix``: raw replies sent before the buffered ones (a publisher answering garbage).
    """

    def __init__(self, topic: str = "kv", replay_topic: bool = False) -> None:
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
        self.replay_topic = replay_topic
        self.replay_prefix: list[list[bytes]] = []
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

    def send_raw(self, frames: list[bytes]) -> None:
        """A message as given, frames and all (garbage a router must survive)."""
        self.pub.send_multipart(frames)

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
            topic = [self.topic.encode()] if self.replay_topic else []
            with self._lock:
                for frames in self.replay_prefix:
                    self.replay.send_multipart([identity, *frames])
                for seq, payload in self.buffer:
                    if seq >= start_seq:
                        self.replay.send_multipart([identity, b"", *topic, seq.to_bytes(8, "big"), payload])
                end = [b""] if self.replay_topic else []
                self.replay.send_multipart([identity, b"", *end, (-1).to_bytes(8, "big", signed=True), b""])


class FakeVllm:
    """A vLLM-like backend: no ``/v1/cache/config`` (404), KV events whose block hashes are random 64-bit ids
    that have nothing to do with any hash of the content, and usage reporting the cached tokens it holds.

    Its cache maps each block's prefix (every token up to the block's end) to its id and the media holding it;
    a lookup, like vLLM's, counts the leading hittable blocks held anywhere. ``capacity`` bounds the GPU
    blocks, evicting the least recently used (each eviction published). With ``auto_store`` a served prompt's
    blocks are stored after the request, as an engine caches what it computed. Events go out one batch per call.
    """

    def __init__(
        self, name: str, block_size: int = BLOCK_SIZE, capacity: int | None = None, auto_store: bool = False
    ) -> None:
        self.name = name
        self.block_size = block_size
        self.capacity = capacity
        self.auto_store = auto_store
        self.rng = random.Random(name)
        self.publisher = FakePublisher(topic="", replay_topic=True)
        self.blocks: dict[tuple[int, ...], tuple[int, set[str]]] = {}
        self.ids: dict[tuple[int, ...], int] = {}  # one id per block content for the process's life, as vLLM's
        self.last_used: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.received: list[dict[str, Any]] = []
        self.proceed = threading.Event()
        self.proceed.set()
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        async def generate(request: Request) -> Response:
            body = json.loads(await request.body())
            self.received.append(body)
            await asyncio.to_thread(self.proceed.wait, 30)
            prompt = body["prompt"]
            cached = self.held_tokens(prompt)
            if self.auto_store:
                self.store(prompt)
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            return JSONResponse({"id": "x", "choices": [], "usage": usage})

        app.post("/v1/completions")(generate)
        self.server = ThreadedServer(app)
        self.url = self.server.url

    def source(self):
        """Where the router connects, as ``--kv-event-source`` / ``--kv-event-replay-source`` would say."""
        from prefixcache.router.subscriber import EventSource

        return self.url, EventSource(self.publisher.endpoint, self.publisher.replay_endpoint)

    def wait_subscribed(self, router) -> None:
        """Until the router applies a live event: a SUB socket only hears what is sent after it joined, so a
        test whose last event went out before that would wait for nothing. The probe removes a block nobody
        holds, which changes nothing."""
        before = metric(router, "events_received_total", self)
        wait_until(
            lambda: (
                self.publisher.publish([removed([0])]) >= 0 and metric(router, "events_received_total", self) > before
            ),
            what=f"{self.name} subscribed",
        )

    def held_tokens(self, prompt: list[int]) -> int:
        held = 0
        for k in range((len(prompt) - 1) // self.block_size):
            if self._prefix(prompt, k) not in self.blocks:
                break
            held += 1
        return held * self.block_size

    def store(
        self, prompt: list[int], medium: str = "GPU", with_tokens: bool = True, lora_name=None, extra_keys=None
    ) -> None:
        """Cache the prompt's full blocks on ``medium``: one BlockStored per run of blocks new there."""
        events, run = [], []
        for k in range(len(prompt) // self.block_size):
            prefix = self._prefix(prompt, k)
            self.clock += 1
            self.last_used[prefix] = self.clock
            if prefix not in self.ids:
                self.ids[prefix] = self.rng.getrandbits(64)
            block_id, media = self.blocks.get(prefix, (self.ids[prefix], set()))
            if medium in media:
                if run:
                    events.append(self._stored(prompt, run, medium, with_tokens, lora_name, extra_keys))
                run = []
                continue
            media.add(medium)
            self.blocks[prefix] = (block_id, media)
            run.append(k)
        if run:
            events.append(self._stored(prompt, run, medium, with_tokens, lora_name, extra_keys))
        events += self._evict()
        if events:
            self.publisher.publish(events)

    def remove(self, prompt: list[int], from_block: int, medium: str = "GPU") -> None:
        ids = [self._drop(self._prefix(prompt, k), medium) for k in range(from_block, len(prompt) // self.block_size)]
        self.publisher.publish([removed([i for i in ids if i is not None], medium)])

    def clear(self) -> None:
        """A prefix cache reset: the GPU copies go, an offload tier's stay."""
        for prefix in list(self.blocks):
            self._drop(prefix, "GPU")
        self.publisher.publish([CLEARED])

    def restart(self) -> None:
        """A new process: nothing cached, new ids from now on, the sequence from 0 and an empty replay buffer."""
        self.blocks.clear()
        self.ids.clear()
        self.publisher.restart()

    def stop(self) -> None:
        self.server.stop()
        self.publisher.stop()

    def _prefix(self, prompt: list[int], k: int) -> tuple[int, ...]:
        return tuple(prompt[: (k + 1) * self.block_size])

    def _stored(self, prompt, run, medium, with_tokens, lora_name, extra_keys) -> dict[str, Any]:
        first = run[0]
        parent = self.blocks[self._prefix(prompt, first - 1)][0] if first else None
        tokens = prompt[first * self.block_size : (run[-1] + 1) * self.block_size]
        return {
            "type": "BlockStored",
            "block_hashes": [self.blocks[self._prefix(prompt, k)][0] for k in run],
            "parent_block_hash": parent if with_tokens else None,
            "token_ids": tokens if with_tokens else [],
            "block_size": self.block_size if with_tokens else 0,
            "lora_id": None,
            "medium": medium,
            "lora_name": lora_name,
            "extra_keys": extra_keys,
            "group_idx": 0,
        }

    def _drop(self, prefix: tuple[int, ...], medium: str) -> int | None:
        entry = self.blocks.get(prefix)
        if entry is None or medium not in entry[1]:
            return None
        entry[1].discard(medium)
        if not entry[1]:
            del self.blocks[prefix]
        return entry[0]

    def _evict(self) -> list[dict[str, Any]]:
        on_gpu = [p for p, (_, media) in self.blocks.items() if "GPU" in media]
        if self.capacity is None or len(on_gpu) <= self.capacity:
            return []
        victims = sorted(on_gpu, key=self.last_used.__getitem__)[: len(on_gpu) - self.capacity]
        return [removed([self._drop(p, "GPU") for p in victims])]
