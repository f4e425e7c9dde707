"""``explain --base-url`` against a vLLM-shaped server: its /tokenize takes a completion's prompt or a chat's
messages, /detokenize gives text, and it has no prefixcache cache lookup (404)."""

import json

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from prefixcache.cli import main
from prefixcache.engine.chat_breakpoints import chat_token_ids
from tests.explain.test_cli import stamped_log
from tests.router.fakes import ThreadedServer

VOCAB_SIZE = 512  # the tiny checkpoint's


class FakeVLLM:
    """vLLM's tokenize protocol (entrypoints/serve/tokenize/protocol.py) on the tiny tokenizer; records requests."""

    def __init__(self, tokenizer) -> None:
        self.tokenize_requests: list[dict] = []
        app = FastAPI()

        @app.post("/tokenize")
        async def tokenize(body: dict) -> JSONResponse:
            self.tokenize_requests.append(body)
            if "messages" in body:
                if not body.get("add_generation_prompt", True):
                    return JSONResponse({"error": {"message": "expected the generation prompt"}}, 400)
                tokens = chat_token_ids(tokenizer, body["messages"])
            elif isinstance(body.get("prompt"), str):
                tokens = tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
            else:
                return JSONResponse({"error": {"message": "prompt must be a string"}}, 400)
            return JSONResponse({"count": len(tokens), "max_model_len": 1024, "tokens": tokens, "token_strs": None})

        @app.post("/detokenize")
        async def detokenize(body: dict) -> JSONResponse:
            if any(t >= VOCAB_SIZE for t in body["tokens"]):
                return JSONResponse({"error": {"message": "token id out of vocabulary"}}, 400)
            return JSONResponse({"prompt": tokenizer.decode(body["tokens"])})

        self.server = ThreadedServer(app)
        self.url = self.server.url


@pytest.fixture
def fake_vllm(tokenizer):
    server = FakeVLLM(tokenizer)
    yield server
    server.server.stop()


def test_explain_tokenizes_through_a_vllm_server_as_through_the_model(fake_vllm, tmp_path, tiny_llama_dir, capsys):
    log = tmp_path / "requests.jsonl"
    extra = [json.dumps({"prompt": "The quick brown fox"}), json.dumps({"prompt_token_ids": [5, 6, 7]}),
             json.dumps({"prompt_token_ids": [5, VOCAB_SIZE]})]  # fmt: skip
    stamped_log(log, num_requests=8, bad_lines=[(3, extra[0]), (5, extra[1]), (7, extra[2])])
    through_vllm, through_model = tmp_path / "vllm.json", tmp_path / "model.json"
    main(["explain", str(log), "--base-url", fake_vllm.url, "--json", str(through_vllm)])
    printed = capsys.readouterr().out
    main(["explain", str(log), "--model", str(tiny_llama_dir), "--json", str(through_model)])
    vllm, model = json.loads(through_vllm.read_text()), json.loads(through_model.read_text())

    assert [r["prompt_tokens"] for r in vllm["requests"]] == [r["prompt_tokens"] for r in model["requests"]]
    assert vllm["hit_rate"]["infinite_blocks"] == model["hit_rate"]["infinite_blocks"]
    assert vllm["hit_rate"]["server_now"] is None  # vLLM tells nothing of its cache
    assert vllm["divergence"]["this_context"] == model["divergence"]["this_context"]
    assert vllm["divergence"]["message_index"] == 0 and "⟦" in vllm["divergence"]["this_context"]
    assert [(e["line"], e["message"]) for e in vllm["errors"]] == [
        (7, "the server refused it: token id out of vocabulary")
    ]
    chats = [r for r in fake_vllm.tokenize_requests if "messages" in r]
    assert len(chats) == 8 and all(r["add_generation_prompt"] and r["add_special_tokens"] is False for r in chats)
    # the body's add_special_tokens as the completions endpoint defaults it, said explicitly
    assert {"prompt": "The quick brown fox", "add_special_tokens": True} in fake_vllm.tokenize_requests
    assert f"tokenized by {fake_vllm.url}" in printed and "the server's cache now" not in printed
