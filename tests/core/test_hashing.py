"""Chained block hashing: golden vectors, tagging of extra keys, incremental hashing."""

import hashlib
import struct

import cbor2
import pytest

from prefixcache.core import (
    HASH_ALGOS,
    KVCacheManager,
    MultiModalFeature,
    Request,
    hash_block_tokens,
    root_hash,
)
from prefixcache.core.hashing import hash_blocks, pack_token_ids

BLOCK_1 = list(range(16))
BLOCK_2 = [100_000 + i for i in range(16)]
EXTRA_2 = (("lora", "adapter"), ("salt", "tenant"))

# Fixed inputs -> fixed digests: a change here breaks agreement between engines and routers on other hosts.
GOLDEN = {
    "sha256": (
        "3259e89487b828fc8dfb923321202a78f2c3675e1407816e28449036d693cc5c",
        "a228b052c2afbc13437fb8aa4bb033c264b52c20ff459362c5ce50647eb80e33",
        "39b8f46f08191f46f54a67581642ac1a9fa9e76b4820dac4e602ce3decf6a269",
    ),
    "sha256_cbor": (
        "3259e89487b828fc8dfb923321202a78f2c3675e1407816e28449036d693cc5c",
        "d7f5ad446cc9b9ebd4a9c24a8153cce51aa1d65a3288452647dbc9c91f56c5ae",
        "52288aa529ab819eb22b2252b776b8341f28d38a907be3236ce1055c4e9f2c2f",
    ),
    "xxhash": (
        "5ad69d39a0f8e9498977e60a68a49ce1",
        "287dfe1c42d3fa213308689a1c6ec6b2",
        "fb73cc6576e15b82490806f67960dab7",
    ),
    "xxhash_cbor": (
        "5ad69d39a0f8e9498977e60a68a49ce1",
        "9891f34bee221d5ec5156542bab79522",
        "47cd7f6807ed293fbcdd400555a5307e",
    ),
}


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_golden_vectors(algo):
    root = root_hash(algo, "prefixcache")
    h1 = hash_block_tokens(algo, root, BLOCK_1)
    h2 = hash_block_tokens(algo, h1, BLOCK_2, EXTRA_2)
    assert (root.hex(), h1.hex(), h2.hex()) == GOLDEN[algo]


def test_sha256_encoding_is_the_documented_one():
    """Reproducible from its description alone: parent || u32 count || u32 LE tokens || CBOR(extra)."""
    root = hashlib.sha256(b"prefixcache").digest()
    h1 = hashlib.sha256(root + struct.pack("<I", 16) + struct.pack("<16I", *BLOCK_1)).digest()
    payload = h1 + struct.pack("<I", 16) + struct.pack("<16I", *BLOCK_2) + cbor2.dumps(EXTRA_2, canonical=True)
    assert hash_block_tokens("sha256", h1, BLOCK_2, EXTRA_2) == hashlib.sha256(payload).digest()
    assert hash_block_tokens("sha256", root_hash("sha256", "prefixcache"), BLOCK_1) == h1


def test_sha256_cbor_encoding_is_canonical_cbor_of_parent_tokens_extra():
    root = hashlib.sha256(b"prefixcache").digest()
    expected = hashlib.sha256(cbor2.dumps([root, BLOCK_1, None], canonical=True)).digest()
    assert hash_block_tokens("sha256_cbor", root_hash("sha256_cbor", "prefixcache"), BLOCK_1) == expected


def test_seed_comes_from_argument_then_environment(monkeypatch):
    monkeypatch.delenv("PREFIXCACHE_HASH_SEED", raising=False)
    assert root_hash("sha256") == root_hash("sha256", "prefixcache")
    monkeypatch.setenv("PREFIXCACHE_HASH_SEED", "cluster-7")
    assert root_hash("sha256") == root_hash("sha256", "cluster-7") != root_hash("sha256", "prefixcache")


def test_chain_depends_on_every_earlier_block():
    root = root_hash("sha256")
    a = hash_block_tokens("sha256", hash_block_tokens("sha256", root, BLOCK_1), BLOCK_2)
    b = hash_block_tokens("sha256", hash_block_tokens("sha256", root, BLOCK_2), BLOCK_2)
    assert a != b


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_tags_keep_kinds_of_extra_keys_apart(algo):
    root = root_hash(algo)
    as_lora = hash_block_tokens(algo, root, BLOCK_1, (("lora", "x"),))
    as_salt = hash_block_tokens(algo, root, BLOCK_1, (("salt", "x"),))
    as_mm = hash_block_tokens(algo, root, BLOCK_1, (("mm", "x", 0),))
    plain = hash_block_tokens(algo, root, BLOCK_1)
    assert len({as_lora, as_salt, as_mm, plain}) == 4


def test_unknown_algorithm_and_bad_token_ids_are_clear_errors():
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        root_hash("md5")
    with pytest.raises(ValueError, match="token ids"):
        pack_token_ids([1, -2])
    with pytest.raises(ValueError, match="token ids"):
        pack_token_ids([2**32])
    with pytest.raises(ValueError, match="token ids"):
        Request("r", [1, "two"])


def test_xxhash_warns_about_tenants_once_per_process(caplog, monkeypatch):
    from prefixcache.core import hashing

    monkeypatch.setattr(hashing, "_warned_unsafe", False)  # as in a fresh process
    KVCacheManager(num_blocks=4, hash_algo="sha256")
    assert caplog.text == ""
    for algo in ("xxhash", "xxhash_cbor", "xxhash"):  # bench manager builds one manager per replay
        KVCacheManager(num_blocks=4, hash_algo=algo)
    assert caplog.text.count("not cryptographic") == 1
    assert "'xxhash' is not cryptographic (nor is any of xxhash, xxhash_cbor)" in caplog.text


def test_batched_hashing_matches_block_by_block():
    tokens = list(range(64))
    packed = pack_token_ids(tokens)
    root = root_hash("sha256")
    batched = hash_blocks("sha256", root, packed, 0, 4, 16)
    parent, one_by_one = root, []
    for k in range(4):
        parent = hash_block_tokens("sha256", parent, tokens[16 * k : 16 * (k + 1)])
        one_by_one.append(parent)
    assert batched == one_by_one


def test_only_full_blocks_are_hashed_and_appends_hash_only_new_blocks(monkeypatch):
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    req = Request("r", list(range(10)))
    first = list(mgr.block_hashes(req))
    assert len(first) == 2
    calls = []
    import prefixcache.core.request as request_module

    real = request_module.hash_blocks

    def spy(algo, parent, packed, start, num, *args):
        calls.append((start, num))
        return real(algo, parent, packed, start, num, *args)

    monkeypatch.setattr(request_module, "hash_blocks", spy)
    assert mgr.block_hashes(req) == first
    assert calls == []
    req.append_output_token_ids([1, 2])
    assert mgr.block_hashes(req)[:2] == first
    assert len(req.block_hashes) == 3
    assert calls == [(2, 1)]


def test_extra_keys_per_block():
    req = Request(
        "r",
        list(range(40)),
        cache_salt="s",
        lora_name="l",
        mm_features=[MultiModalFeature("img", offset=14, length=4)],
    )
    assert req.block_extra_keys(0, 16) == (("lora", "l"), ("salt", "s"), ("mm", "img", 14))
    assert req.block_extra_keys(1, 16) == (("lora", "l"), ("mm", "img", -2))
    assert req.block_extra_keys(2, 16) == (("lora", "l"),)
    assert Request("q", [1]).block_extra_keys(0, 16) is None
