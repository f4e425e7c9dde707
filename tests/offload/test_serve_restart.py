"""``prefixcache serve --kv-offload-disk``: the first requests after a restart hit what was computed before."""

import httpx

from tests.server.harness import ServerProcess, random_prompt


def complete(url: str, prompt: list[int]) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    response = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0.0},
        timeout=60,
    )
    response.raise_for_status()
    return response.json()


def test_disk_tier_serves_the_first_request_after_a_restart(tiny_llama_dir, tmp_path):
    args = ["--block-size", "4", "--num-blocks", "64", "--kv-offload-disk", f"{tmp_path / 'kv'}:1MiB"]
    args += ["--disable-uvicorn-access-log"]
    prompt = random_prompt("restart", 41)  # ten full blocks can be served from a cache
    answers = []
    for run in ("before", "after"):
        server = ServerProcess(tiny_llama_dir, args, tmp_path / f"{run}.log")
        try:
            server.wait_ready()
            answers.append(complete(server.url, prompt))
        finally:
            server.stop()
    before, after = answers
    assert before["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
