"""``bench clients`` reads what each tool asked of the server from the server's request log."""

import argparse

import pytest

from prefixcache.bench.clients import _server_calls, _tools

LOG = """\
INFO:     Uvicorn running on http://127.0.0.1:5000 (Press CTRL+C to quit)
2026-12-01 12:00:00,000 INFO prefixcache.server.requests: request_id=a GET /server_info 200 e2e=0.003s
2026-12-01 12:00:00,001 INFO prefixcache.server.requests: request_id=b POST /v1/chat/completions 400 error="x"
2026-12-01 12:00:00,002 INFO prefixcache.server.requests: request_id=c POST /v1/chat/completions 200 prompt_tokens=5
2026-12-01 12:00:00,003 INFO prefixcache.server.requests: request_id=d POST /v1/chat/completions 200 prompt_tokens=5
"""


def test_server_calls_count_each_path_and_status():
    assert _server_calls(LOG) == {
        "GET /server_info 200": 1,
        "POST /v1/chat/completions 200": 2,
        "POST /v1/chat/completions 400": 1,
    }


def test_tools_are_a_subset_of_the_known_ones():
    assert _tools("vllm-router,guidellm") == ["vllm-router", "guidellm"]
    with pytest.raises(argparse.ArgumentTypeError, match="guidellm"):
        _tools("guidellm,locust")
