"""The engine with offload tiers on the tiny float32 model: a prompt served partly from the device cache,
partly from a tier and partly computed gives the same greedy tokens as with no cache at all; the disk tier
serves after a restart, Redis across engines, and a tier that is down only costs hits."""

import functools
import random
import shutil
import time
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file, save_file

from prefixcache.core import Request
from prefixcache.core.retention import RetentionRange
from prefixcache.engine import LLM, SamplingParams
from prefixcache.model import load_model
from prefixcache.offload.config import REDIS_PASSWORD_ENV
from prefixcache.offload.record import encode_record, model_fingerprint, record_retention
from prefixcache.offload.worker import read_blocks
from tests.helpers import write_tiny_checkpoint
from tests.offload.conftest import SECRET, forger

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BLOCK = 4
rng = random.Random(0)
PROMPT = [rng.randrange(3, 500) for _ in range(40)]  # 10 blocks
FOLLOW_UP = PROMPT + [rng.randrange(3, 500) for _ in range(8)]
FILLERS = [[rng.randrange(3, 500) for _ in range(24)] for _ in range(2)]
# The one token whose embedding row a fine-tune changes; an odd row of an 8192 x 64 embedding, which a
# fingerprint sampling every 128th value (4,096 of them) never reads.
TUNED_TOKEN = 301
TUNED_PROMPT = [TUNED_TOKEN, *FOLLOW_UP[1:]]


def generate(llm: LLM, prompt: list[int]):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def reference(tiny_loaded, tiny_llama_dir) -> list[int]:
    llm = LLM(
        str(tiny_llama_dir),
        loaded=tiny_loaded,
        dtype="float32",
        enable_prefix_caching=False,
        num_blocks=64,
        block_size=BLOCK,
    )
    return generate(llm, FOLLOW_UP).outputs[0].token_ids


@pytest.fixture
def make_llm(make_llm):
    """The shared factory (tests/conftest.py: leak checks, closing) with this file's block size and 16 blocks."""
    return functools.partial(make_llm, block_size=BLOCK, num_blocks=16)


def settle(llm: LLM) -> None:
    """Wait for the background writer, so the test knows what the tiers hold."""
    llm.engine.core.offload.writer.flush()


def tier_tokens(llm: LLM) -> dict[str, int]:
    return {s.medium: s.hit_tokens for s in llm.stats().kv_offload}


def prompt_kv(llm: LLM) -> list[bytes]:
    """The K/V of PROMPT's 10 blocks as the device cache holds them now."""
    manager = llm.engine.core.manager
    hashes = manager.block_hashes(Request("probe", PROMPT))
    block_ids = [(manager.pool.get_cached_block(h).block_id,) for h in hashes]
    return read_blocks(llm.engine.core.runner.kv_caches, block_ids, [0] * len(llm.engine.core.runner.kv_caches))


def fill_then_evict_the_tail(llm: LLM) -> list[bytes]:
    """PROMPT fills 10 blocks of the 16; two fillers then evict its last 7 (the tail goes first), so the
    device keeps blocks 0-2 and the tiers must supply blocks 3-9. Returns PROMPT's K/V as computed."""
    generate(llm, PROMPT)
    computed = prompt_kv(llm)
    for filler in FILLERS:
        generate(llm, filler)
    settle(llm)
    return computed


@pytest.fixture(params=["cpu-write_back", "cpu-write_through", "cpu-chunked", "disk", "redis"])
def tier_kwargs(request, tmp_path) -> dict:
    if request.param.startswith("cpu"):
        mode = "write_through" if request.param == "cpu-write_through" else "write_back"
        kwargs = {"kv_offload_cpu": "1MiB", "kv_offload_mode": mode}
        if request.param == "cpu-chunked":
            kwargs["max_num_batched_tokens"] = 5
        return kwargs
    if request.param == "disk":
        return {"kv_offload_disk": f"{tmp_path}/kv:1MiB"}
    return {"kv_offload_redis": request.getfixturevalue("redis_server").url}


def test_device_tier_and_new_tokens_in_one_prompt_match_no_cache(make_llm, reference, tier_kwargs):
    llm = make_llm(**tier_kwargs)
    computed = fill_then_evict_the_tail(llm)
    device_hits = llm.stats().prefix_cache_hits
    tiers = llm.stats().kv_offload
    found = llm.lookup({"prompt_token_ids": FOLLOW_UP})
    assert found.cached_tokens_by_tier == {"device": 3 * BLOCK, tiers[0].medium: 7 * BLOCK}
    assert llm.stats().kv_offload == tiers  # the lookup read no block
    out = generate(llm, FOLLOW_UP)
    assert out.num_cached_tokens == found.cached_tokens
    assert out.outputs[0].token_ids == reference
    assert prompt_kv(llm) == computed  # loaded K/V is bit for bit what was computed
    assert out.num_cached_tokens == 40
    assert llm.stats().prefix_cache_hits - device_hits == 40  # one definition of a hit: tiers included
    assert sum(tier_tokens(llm).values()) == 7 * BLOCK  # the device served the first 3 blocks


def test_write_back_host_tier_holds_what_the_device_lost_and_gives_it_back(make_llm):
    llm = make_llm(kv_offload_cpu="1MiB")
    fill_then_evict_the_tail(llm)
    (host,) = llm.stats().kv_offload
    assert (host.num_blocks, host.blocks_stored) == (7, 7)  # exactly PROMPT's last 7 blocks: the evicted ones
    generate(llm, FOLLOW_UP)
    settle(llm)
    (host,) = llm.stats().kv_offload
    assert host.hit_tokens == 7 * BLOCK and host.blocks_loaded == 7
    # the 7 loaded blocks left the host tier for the device; filler blocks evicted meanwhile came in
    assert host.num_blocks == host.blocks_stored - 7 and host.evictions == 0


def test_disk_tier_serves_after_a_restart(make_llm, reference, tmp_path):
    disk = f"{tmp_path}/kv:1MiB"
    first = make_llm(kv_offload_disk=disk)
    generate(first, PROMPT)
    computed = prompt_kv(first)
    first.engine.core.offload.close()

    restarted = make_llm(kv_offload_disk=disk)
    out = generate(restarted, FOLLOW_UP)
    assert out.outputs[0].token_ids == reference
    assert prompt_kv(restarted) == computed
    assert out.num_cached_tokens == 40 and tier_tokens(restarted) == {"DISK": 40}


def test_a_second_engine_on_the_same_disk_directory_is_refused(make_llm, tmp_path):
    disk = f"{tmp_path}/kv:1MiB"
    first = make_llm(kv_offload_disk=disk)
    with pytest.raises(ValueError, match="in use by another engine"):
        make_llm(kv_offload_disk=disk)
    first.engine.core.offload.close()
    assert make_llm(kv_offload_disk=disk).stats().kv_offload[0].available


def test_disk_blocks_of_another_block_size_or_model_never_load(make_llm, tmp_path, tiny_llama_dir):
    disk = f"{tmp_path}/kv:1MiB"
    first = make_llm(kv_offload_disk=disk)
    generate(first, PROMPT)
    first.engine.core.offload.close()

    other_block_size = LLM(
        str(tiny_llama_dir),
        loaded=first.engine.core.loaded,
        dtype="float32",
        block_size=8,
        num_blocks=16,
        kv_offload_disk=disk,
    )
    try:
        assert other_block_size.stats().kv_offload[0].num_blocks == 0  # its own namespace is empty
        assert generate(other_block_size, FOLLOW_UP).num_cached_tokens == 0
    finally:
        other_block_size.engine.core.offload.close()

    other_dir = write_tiny_checkpoint(tmp_path / "other-model", seed=1)
    other_model = LLM(str(other_dir), dtype="float32", block_size=BLOCK, num_blocks=16, kv_offload_disk=disk)
    try:
        assert other_model.stats().kv_offload[0].num_blocks == 0
        assert generate(other_model, FOLLOW_UP).num_cached_tokens == 0
    finally:
        other_model.engine.core.offload.close()


def one_row_fine_tune(base: Path, out: Path, row: int) -> Path:
    """A copy of the checkpoint ``base`` whose embedding differs in ``row`` only (a repurposed token)."""
    shutil.copytree(base, out)
    weights = load_file(out / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    embedding[row] = torch.randn(embedding.shape[1], generator=torch.Generator().manual_seed(1)) * embedding.std()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def base_and_fine_tune(tmp_path_factory):
    """A tiny model with a large vocabulary, and its fine-tune that changed the embedding of TUNED_TOKEN."""
    root = tmp_path_factory.mktemp("fine-tune")
    base = write_tiny_checkpoint(root / "base", vocab_size=8192)
    tuned = one_row_fine_tune(base, root / "tuned", TUNED_TOKEN)
    return load_model(str(base), dtype="float32"), load_model(str(tuned), dtype="float32")


def test_model_fingerprint_covers_every_weight(tiny_loaded, tiny_llama_dir, tmp_path, base_and_fine_tune):
    same = load_model(str(tiny_llama_dir), dtype="float32", device="cpu")
    other = load_model(str(write_tiny_checkpoint(tmp_path / "other", seed=1)), dtype="float32", device="cpu")
    base, tuned = base_and_fine_tune
    fingerprint = model_fingerprint(tiny_loaded.config, tiny_loaded.weights_digest)
    assert model_fingerprint(same.config, same.weights_digest) == fingerprint
    assert model_fingerprint(other.config, other.weights_digest) != fingerprint
    assert base.config == tuned.config
    assert model_fingerprint(base.config, base.weights_digest) != model_fingerprint(tuned.config, tuned.weights_digest)


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_fine_tune_one_embedding_row_apart_never_loads_its_base_models_blocks(
    tier, make_llm, base_and_fine_tune, tmp_path, request
):
    base, tuned = base_and_fine_tune
    kwargs = (
        {"kv_offload_disk": f"{tmp_path}/kv:1MiB"}
        if tier == "disk"
        else {"kv_offload_redis": request.getfixturevalue("redis_server").url}
    )
    expected = generate(make_llm(loaded=tuned, enable_prefix_caching=False), TUNED_PROMPT).outputs[0].token_ids
    base_llm = make_llm(loaded=base, **kwargs)
    base_output = generate(base_llm, TUNED_PROMPT)
    settle(base_llm)
    assert base_output.outputs[0].token_ids != expected  # the base's K/V would give the fine-tune wrong tokens
    base_llm.engine.core.offload.close()

    tuned_llm = make_llm(loaded=tuned, **kwargs)
    assert tuned_llm.lookup({"prompt_token_ids": TUNED_PROMPT}).cached_tokens == 0
    out = generate(tuned_llm, TUNED_PROMPT)
    assert out.num_cached_tokens == 0 and tier_tokens(tuned_llm) == {tier.upper(): 0}
    assert out.outputs[0].token_ids == expected


def test_with_a_secret_forged_disk_records_never_load(make_llm, reference, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    disk = f"{tmp_path}/kv:1MiB"
    first = make_llm(kv_offload_disk=disk, kv_offload_secret_file=str(secret_file))
    generate(first, PROMPT)
    first.engine.core.offload.close()
    (store,) = first.engine.core.offload.stores
    hashes = first.engine.core.manager.block_hashes(Request("probe", PROMPT))
    zeros = bytes(store.layout.block_bytes)  # K/V that would change every output token
    for block_hash in hashes:
        assert store.path_of(block_hash).exists()
        store.path_of(block_hash).write_bytes(encode_record(forger(store.layout, None), block_hash, zeros))

    restarted = make_llm(kv_offload_disk=disk, kv_offload_secret_file=str(secret_file))
    out = generate(restarted, FOLLOW_UP)
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens == 0
    (disk_stats,) = restarted.stats().kv_offload
    assert disk_stats.bad_records == 1 and disk_stats.hit_tokens == 0  # the first block ends the lookup


def test_redis_shares_blocks_between_two_engines(make_llm, reference, redis_server):
    first = make_llm(kv_offload_redis=redis_server.url)
    second = make_llm(kv_offload_redis=redis_server.url)
    generate(first, PROMPT)
    settle(first)
    out = generate(second, FOLLOW_UP)
    assert out.outputs[0].token_ids == reference
    assert prompt_kv(second) == prompt_kv(first)
    assert out.num_cached_tokens == 40 and tier_tokens(second) == {"REDIS": 40}


def test_redis_over_tls_with_an_acl_user_shares_blocks(make_llm, reference, secured_redis, monkeypatch):
    monkeypatch.setenv(REDIS_PASSWORD_ENV, secured_redis.user_password)  # kept out of the command line
    url = secured_redis.url(secured_redis.user, tls=True, query=secured_redis.tls_files)
    first, second = make_llm(kv_offload_redis=url), make_llm(kv_offload_redis=url)
    generate(first, PROMPT)
    settle(first)
    out = generate(second, FOLLOW_UP)
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens == 40 and tier_tokens(second) == {"REDIS": 40}


def test_redis_down_costs_only_hits(make_llm, reference, redis_server):
    llm = make_llm(kv_offload_redis=redis_server.url)
    redis_server.stop()
    generate(llm, PROMPT)
    settle(llm)
    out = generate(llm, FOLLOW_UP)
    assert out.outputs[0].token_ids == reference
    (redis_stats,) = llm.stats().kv_offload
    assert not redis_stats.available and redis_stats.hit_tokens == 0


def test_offload_options_are_checked(make_llm):
    with pytest.raises(ValueError, match="kv_offload_cpu"):
        make_llm(kv_offload_cpu="lots")
    with pytest.raises(ValueError, match="redis:// URL"):
        make_llm(kv_offload_redis="http://localhost:6379")
    with pytest.raises(ValueError, match="kv_offload_mode"):
        make_llm(kv_offload_cpu="1MiB", kv_offload_mode="sometimes")
    with pytest.raises(ValueError, match="holds no block"):
        make_llm(kv_offload_cpu="100B")


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_24h_prompt_is_written_through_with_its_ttl(make_llm, tmp_path, request, tier):
    """``prompt_cache_retention: "24h"`` (priority 90 for 86400 s over the whole request) reaches the persistent
    tier: every prompt block's record names it, and Redis expires the key then."""
    if tier == "disk":
        llm = make_llm(kv_offload_disk=f"{tmp_path}/kv:1MiB", max_retained_fraction=1.0)
    else:
        llm = make_llm(kv_offload_redis=request.getfixturevalue("redis_server").url, max_retained_fraction=1.0)
    before = time.time()
    llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False, retention=[RetentionRange(0, None, 90, 86400)])
    settle(llm)
    after = time.time()
    [store] = llm.engine.core.offload.stores
    hashes = llm.engine.core.manager.block_hashes(Request("probe", PROMPT))
    if tier == "disk":
        records = [store.path_of(h).read_bytes() for h in hashes]
    else:
        raw = redis.Redis.from_url(request.getfixturevalue("redis_server").url)
        try:
            records = [raw.get(store.key_of(h)) for h in hashes]
            assert all(86390 * 1000 < raw.pttl(store.key_of(h)) <= 86400 * 1000 for h in hashes)
        finally:
            raw.close()
    kept = [record_retention(r) for r in records]
    assert len(kept) == 10 and all(k.priority == 90 for k in kept)
    assert all(before + 86400 <= k.expires_at <= after + 86400 for k in kept)
