"""The trace benchmark: parsing, synthetic tokens, the replay and its two references, the command."""

import argparse
import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest

from prefixcache.bench.trace import (
    BELADY,
    NEVER,
    BeladyPolicy,
    CostModel,
    FutureUses,
    ReplayConfig,
    TraceRequest,
    drive,
    infinite_hit_rate,
    load_trace,
    main,
    parse_trace_line,
    register,
    replay,
    synthetic_tokens,
)
from prefixcache.core import EVICTION_POLICIES, KVCacheManager, Request
from prefixcache.core.block_pool import Block
from prefixcache.offload.connector import OFFLOAD_MODES, WRITE_BACK, WRITE_THROUGH

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
B = 512


def record(hash_ids, input_length=None, output_length=0, timestamp=0.0) -> TraceRequest:
    """A record whose full blocks are ``hash_ids[:-1]`` plus one token in a last partial block by default."""
    if input_length is None:
        input_length = (len(hash_ids) - 1) * B + 1
    return TraceRequest(timestamp, input_length, output_length, tuple(hash_ids))


def conversations(num_requests: int, seed: int) -> list[TraceRequest]:
    """Chat sessions on a shared system block (id 0) that grow by 1-3 blocks a turn and sometimes fork."""
    rng = random.Random(seed)
    ids = itertools.count(1)
    sessions: list[list[int]] = []
    out = []
    timestamp = 0.0
    for _ in range(num_requests):
        roll = rng.random()
        if not sessions or roll < 0.3:
            session = [0]
            sessions.append(session)
        elif roll < 0.4:
            parent = rng.choice(sessions)
            session = parent[: rng.randint(1, len(parent))]
            sessions.append(session)
        else:
            session = rng.choice(sessions)
        session.extend(next(ids) for _ in range(rng.randint(1, 3)))
        partial = rng.randint(1, B)
        out.append(TraceRequest(timestamp, len(session) * B + partial, rng.randint(0, 40), (*session, next(ids))))
        timestamp += rng.uniform(0, 300)
    return out


def write_jsonl(path: Path, trace) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.timestamp_ms,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in trace
        )
    )
    return path


# --- parsing ---------------------------------------------------------------------------------------


def test_parse_a_mooncake_line():
    line = '{"timestamp": 27, "input_length": 1025, "output_length": 9, "hash_ids": [0, 5, 6]}'
    assert parse_trace_line(line) == TraceRequest(27.0, 1025, 9, (0, 5, 6))


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"timestamp": 0, "input_length": 1025, "output_length": 9, "hash_ids": [0, 5]}', "2 hash_ids for 1025"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 9, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}', "output_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}', "hash_ids must be in"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [8388608]}', "hash_ids must be in"),
    ],
)
def test_malformed_lines_are_clear_errors(line, message):
    with pytest.raises(ValueError, match=message):
        parse_trace_line(line)


def test_load_trace_takes_the_first_lines_in_arrival_order(tmp_path):
    trace = [record([1, 2], timestamp=20), record([3], timestamp=10), record([1, 4], timestamp=10), record([9])]
    path = write_jsonl(tmp_path / "t.jsonl", trace)
    assert load_trace(path) == [trace[3], trace[1], trace[2], trace[0]]  # stable for equal timestamps
    assert load_trace(path, max_requests=2) == [trace[1], trace[0]]


def test_load_trace_rejects_ids_that_are_not_prefix_chained(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [record([1, 2, 3]), record([4, 2, 5])])
    with pytest.raises(ValueError, match="hash id 2 follows both 1 and 4"):
        load_trace(path)


# --- synthetic tokens -------------------------------------------------------------------------------


def test_synthetic_tokens_follow_the_hash_ids():
    a = synthetic_tokens([0, 7, 8], 2 * B + 100)
    assert len(a) == 2 * B + 100
    assert a == synthetic_tokens([0, 7, 8], 2 * B + 100)  # deterministic
    assert all(0 <= t < 2**32 for t in a)
    b = synthetic_tokens([0, 7, 9], 3 * B)
    assert a[: 2 * B] == b[: 2 * B]  # shared ids, shared tokens
    assert a[2 * B :] != b[2 * B : 2 * B + 100]  # different ids, different tokens
    assert synthetic_tokens([3], B) != synthetic_tokens([4], B)
    assert len(set(synthetic_tokens([5], B))) == B


def test_manager_hashes_agree_with_hash_id_sharing():
    mgr = KVCacheManager(num_blocks=8, block_size=B)
    a = mgr.block_hashes(Request("a", synthetic_tokens([0, 7, 8, 3], 4 * B)))
    b = mgr.block_hashes(Request("b", synthetic_tokens([0, 7, 9, 3], 4 * B)))
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    assert a[3] != b[3]  # same id under a different parent is a different prefix


# --- references on hand-checked cases ---------------------------------------------------------------


ABCAB = [record([k, 100 + i]) for i, k in enumerate([1, 2, 3, 1, 2])]  # one full block each, distinct tails


def test_hand_checked_infinite_belady_and_lru():
    """Two cacheable slots (3 blocks, one always taken by the partial tail), one request at a time.

    At C, LRU evicts A (then A evicts B, B evicts C: no hit); Belady evicts B, whose next use is farther
    than A's, and hits A. With unlimited room both A and B hit.
    """
    config = ReplayConfig(in_flight=1)
    queries = 5 * (B + 1)
    assert infinite_hit_rate(ABCAB, B) == 2 * B / queries
    assert replay(ABCAB, 3, BELADY, config) == B / queries
    assert replay(ABCAB, 3, "lru", config) == 0.0
    assert replay(ABCAB, 3, "arc", config) == 0.0


def test_infinite_reference_caps_the_hit_like_the_manager():
    trace = [record([1, 2], input_length=B), record([1, 2], input_length=B), record([1, 2, 3], input_length=2 * B)]
    # Request 2 may not hit its only block (its last token must be computed); request 3 hits block 1.
    assert infinite_hit_rate(trace, B) == B / (4 * B)
    assert replay(trace, 8, "lru") == B / (4 * B)


def test_belady_evicts_farthest_next_use_and_deepest_first_on_ties():
    trace = [record([1, 2, 3, 50]), record([1, 51])]  # after request 0, only block 1 is looked up again
    oracle = BeladyPolicy(FutureUses(trace, B), B)
    hashes = [b"h1", b"h2", b"h3"]
    oracle.start_request(0, trace[0], hashes)
    oracle.start_request(1, trace[1], hashes[:1])
    blocks = [Block(block_id=i, block_hash=h) for i, h in enumerate(hashes)]
    for block in blocks:
        oracle.push(block)
    assert [oracle.pop().block_id for _ in range(3)] == [2, 1, 0]


def test_belady_rekeys_a_free_block_whose_next_use_passed_without_a_hit():
    trace = [record([1, 60]), record([5, 61]), record([1, 62]), record([5, 63]), record([1, 64])]
    oracle = BeladyPolicy(FutureUses(trace, B), B)
    oracle.start_request(0, trace[0], [b"one"])
    oracle.start_request(1, trace[1], [b"five"])
    oracle.start_request(2, trace[2], [b"one"])
    one, five = Block(block_id=0, block_hash=b"one"), Block(block_id=1, block_hash=b"five")
    oracle.push(one)  # next use: request 2
    oracle.push(five)  # next use: request 3
    # Request 2 passes without hitting block "one" (say it hit a duplicate): its next use becomes request 4.
    oracle.start_request(3, trace[3], [b"five"])
    assert oracle.pop() is one
    assert oracle.pop() is five


def test_future_uses_count_only_blocks_a_lookup_may_return():
    trace = [record([1, 2], input_length=B + 32), record([1, 2], input_length=B + 16), record([1], input_length=B)]
    future = FutureUses(trace, 16)  # 32 blocks of 16 per trace block
    assert future.next_use(2, 0, 0) == 0
    assert future.next_use(2, 1, 0) == NEVER  # request 0's last token is in block 1 of id 2
    assert future.next_use(2, 0, 1) == NEVER  # request 1's last token is in block 0 of id 2
    assert future.next_use(1, 31, 1) == 1
    assert future.next_use(1, 0, 2) == 2
    assert future.next_use(1, 31, 2) == NEVER  # request 2 must compute its last token


# --- replay on synthetic conversations --------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [ReplayConfig(in_flight=4), ReplayConfig(cost=CostModel(0.05, 20.0)), ReplayConfig(block_size=128, in_flight=2)],
    ids=["in-flight", "cost-model", "block-128"],
)
def test_infinite_bounds_belady_bounds_every_policy(config):
    trace = conversations(150, seed=1)
    infinite = infinite_hit_rate(trace, config.block_size)
    assert infinite > 0.5
    for capacity_tokens in (40 * B, 100 * B):
        capacity = capacity_tokens // config.block_size
        belady = replay(trace, capacity, BELADY, config)
        policies = {name: replay(trace, capacity, name, config) for name in EVICTION_POLICIES}
        assert infinite >= belady >= max(policies.values()), (capacity, belady, policies)
        assert min(policies.values()) > 0


def test_an_unlimited_cache_reaches_the_infinite_reference():
    trace = conversations(80, seed=2)
    for block_size in (B, 64):
        capacity = sum(-(-(r.input_length + r.output_length) // block_size) for r in trace)
        infinite = infinite_hit_rate(trace, block_size)
        config = ReplayConfig(block_size=block_size)
        assert replay(trace, capacity, "lru", config) == pytest.approx(infinite, abs=1e-12)
        assert replay(trace, capacity, BELADY, config) == pytest.approx(infinite, abs=1e-12)


def test_belady_keeps_the_pool_consistent():
    trace = conversations(60, seed=3)
    config = ReplayConfig(block_size=256, in_flight=3)
    oracle = BeladyPolicy(FutureUses(trace, 256), 256)
    mgr = KVCacheManager(num_blocks=60, block_size=256, eviction_policy=oracle)

    def check(index, request, hashes):
        mgr.check_invariants()
        oracle.start_request(index, request, hashes)

    drive(mgr, trace, config, check)
    mgr.check_invariants()
    assert mgr.num_free_blocks == mgr.num_blocks
    assert mgr.stats.requests == len(trace)


def test_requests_wait_for_room_and_a_request_larger_than_the_cache_is_an_error():
    big = [record([1, 2, 3, 4, 70], output_length=10, timestamp=0), record([5, 6, 7, 8, 71], timestamp=1)]
    assert replay(big, 6, "lru") == 0.0  # the second waits for the first to finish
    with pytest.raises(ValueError, match="needs 5 blocks, more than the capacity of 4"):
        replay(big, 4, "lru")


def test_cost_model_and_config_validation():
    assert CostModel(0.5, 10.0).duration_ms(100, 3) == 80.0
    with pytest.raises(ValueError, match="divide 512"):
        ReplayConfig(block_size=48)
    with pytest.raises(ValueError, match="in_flight"):
        ReplayConfig(in_flight=0)


# --- the command --------------------------------------------------------------------------------------


KEYS = {
    "policy",
    "capacity_tokens",
    "hit_rate",
    "belady_hit_rate",
    "infinite_hit_rate",
    "lru_hit_rate",
    "offload_tokens",
    "offload_mode",
    "retention_rule",
}


def test_command_writes_one_json_object_for_one_run(tmp_path, capsys):
    path = write_jsonl(tmp_path / "t.jsonl", conversations(60, seed=4))
    out = tmp_path / "r.json"
    main(["--trace", str(path), "--capacity-blocks", "40", "--in-flight", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert set(result) == KEYS
    assert result["policy"] == "lru"
    assert result["capacity_tokens"] == 40 * B
    assert result["infinite_hit_rate"] >= result["belady_hit_rate"] >= result["hit_rate"] > 0
    table = capsys.readouterr().out
    assert "60 requests" in table
    assert "20,480" in table


def test_command_sweeps_capacities_and_policies_and_plots(tmp_path, capsys):
    path = write_jsonl(tmp_path / "t.jsonl", conversations(60, seed=5))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    main(
        ["--trace", str(path), "--capacities", "30000,15000", "--policy", "lru,arc", "--max-requests", "40"]
        + ["--json", str(out), "--plot", str(png)]
    )
    results = json.loads(out.read_text())
    assert [(r["policy"], r["capacity_tokens"]) for r in results] == [
        ("lru", 14848),
        ("arc", 14848),
        ("lru", 29696),
        ("arc", 29696),
    ]
    assert all(set(r) == KEYS for r in results)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "40 requests" in capsys.readouterr().out


def test_host_tier_adds_hits_and_a_tier_that_holds_everything_reaches_the_infinite_cache():
    trace = conversations(300, seed=7)
    infinite = infinite_hit_rate(trace, B)
    device = replay(trace, 30, "lru")
    assert device < infinite
    for mode in OFFLOAD_MODES:
        small_tier = replay(trace, 30, "lru", ReplayConfig(offload_blocks=30, offload_mode=mode))
        assert device < small_tier < infinite, mode
    # written through, a tier as large as the trace holds every prefix ever computed
    everything = ReplayConfig(offload_blocks=10**6, offload_mode=WRITE_THROUGH)
    assert replay(trace, 30, "lru", everything) == pytest.approx(infinite, abs=1e-12)


def test_write_back_host_tier_adds_its_capacity_to_the_device():
    """The tier holds what the device lost, so device + tier hit like one cache of both sizes together."""
    trace = conversations(300, seed=8)
    config = ReplayConfig(in_flight=2)
    tiered = dataclasses.replace(config, offload_blocks=60, offload_mode=WRITE_BACK)
    assert replay(trace, 30, "lru", tiered) >= 0.95 * replay(trace, 90, "lru", config)
    through = dataclasses.replace(tiered, offload_mode=WRITE_THROUGH)
    assert replay(trace, 30, "lru", tiered) > replay(trace, 30, "lru", through)


def test_command_runs_each_policy_with_and_without_the_tier(tmp_path, capsys):
    path = write_jsonl(tmp_path / "t.jsonl", conversations(60, seed=9))
    out = tmp_path / "r.json"
    main(
        ["--trace", str(path), "--capacity-tokens", "15000", "--offload-tokens", "30000"]
        + ["--offload-mode", "write_back,write_through", "--json", str(out)]
    )
    results = json.loads(out.read_text())
    assert [(r["policy"], r["offload_tokens"], r["offload_mode"]) for r in results] == [
        ("lru", 0, None),
        ("lru", 29696, "write_back"),
        ("lru", 29696, "write_through"),
    ]
    assert results[1]["hit_rate"] >= results[0]["hit_rate"]
    assert "lru + 29,696-token host tier (write-back)" in capsys.readouterr().out
    for bad in (["--offload-mode", "eager"], ["--offload-tokens", "100"]):
        with pytest.raises(SystemExit):
            main(["--trace", str(path), *bad])
        assert "error" in capsys.readouterr().err


def test_command_runs_each_policy_with_the_retention_rule_and_prints_the_gap_closed(tmp_path, capsys):
    path = write_jsonl(tmp_path / "t.jsonl", conversations(120, seed=10))
    out = tmp_path / "r.json"
    main(
        ["--trace", str(path), "--capacity-blocks", "40", "--policy", "lru,arc", "--retention-rule", "shared"]
        + ["--json", str(out)]
    )
    results = json.loads(out.read_text())
    assert [(r["policy"], r["retention_rule"]) for r in results] == [
        ("lru", None),
        ("lru", "shared"),
        ("arc", None),
        ("arc", "shared"),
    ]
    lru = results[0]["hit_rate"]
    assert all(r["lru_hit_rate"] == lru for r in results)
    config = ReplayConfig(max_retained_fraction=1.0)
    assert results[1]["hit_rate"] == replay(conversations(120, seed=10), 40, "lru", config, retention_rule="shared")
    assert results[1]["belady_hit_rate"] >= results[1]["hit_rate"]
    table = capsys.readouterr().out
    assert "retention rules may keep 100% of the cache" in table
    gap = results[0]["belady_hit_rate"] - lru
    assert gap > 0
    assert "lru + shared retention" in table
    assert f"{(results[1]['hit_rate'] - lru) / gap:.1%}" in table
    assert "0.0%" in table.splitlines()[2]  # LRU closes none of its own gap
    for bad in (["--retention-rule", "sticky"], ["--retention-rule", "shared", "--in-flight", "2"]):
        with pytest.raises(SystemExit):
            main(["--trace", str(path), *bad])
        assert "error" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cost model's clock"):
        replay(conversations(10, seed=1), 40, "lru", ReplayConfig(in_flight=2), retention_rule="shared")


def test_the_retention_rule_ttls_run_on_the_replay_clock():
    """Two requests share a 3-block prefix; just before a third comes back to it, two fresh requests (one after the
    other) need the room, the second two blocks of what is cached. 5 minutes later the prefix is within its 600 s
    TTL (timed from its free on the trace's clock) and survives; 20 minutes later its TTL has ended, it goes first
    and the third request finds only its first block. Plain LRU loses the same two blocks either way."""

    def trace(late_ms):
        burst = [
            record([100 + 10 * i, 101 + 10 * i, 102 + 10 * i, 103 + 10 * i], timestamp=late_ms - 2000 + 1000 * i)
            for i in range(2)
        ]
        return [
            record([1, 2, 3, 50], timestamp=0),
            record([1, 2, 3, 51], timestamp=1),
            *burst,
            record([1, 2, 3, 52], timestamp=late_ms),
        ]

    queries = 5 * (3 * B + 1)
    kept, lost_two = (3 * B + 3 * B) / queries, (3 * B + B) / queries
    assert replay(trace(5 * 60_000), 8, "lru", retention_rule="shared") == kept
    assert replay(trace(20 * 60_000), 8, "lru", retention_rule="shared") == lost_two
    assert replay(trace(5 * 60_000), 8, "lru") == lost_two


def test_register_adds_the_trace_subcommand(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="prefixcache")
    bench = parser.add_subparsers(dest="bench", required=True)
    register(bench)
    args = parser.parse_args(["trace", "--list-policies"])
    args.func(args)
    assert capsys.readouterr().out.split() == list(EVICTION_POLICIES)
    path = write_jsonl(tmp_path / "t.jsonl", conversations(20, seed=6))
    args = parser.parse_args(["trace", "--trace", str(path), "--capacity-tokens", "20000", "--block-size", "256"])
    [result] = args.func(args)
    assert result.capacity_tokens == 78 * 256
    bad_args = (
        ["--policy", "lru,nope"],
        ["--policy", ","],
        ["--block-size", "100"],
        ["--capacity-tokens", "100"],
        ["--capacity-blocks", "2"],  # smaller than a request
        ["--capacities", "0,5"],
        [],
    )
    for bad in bad_args:
        argv = ["trace", *(["--trace", str(path)] if bad else []), *bad]
        with pytest.raises(SystemExit):
            args = parser.parse_args(argv)
            args.func(args)
        assert "error" in capsys.readouterr().err


# --- the real trace ----------------------------------------------------------------------------------


def test_conversation_trace_smoke():
    path = TRACES / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        pytest.skip("real Mooncake traces: ../shared/data/traces not found")
    trace = load_trace(path, max_requests=500)
    assert len(trace) == 500
    infinite = infinite_hit_rate(trace, B)
    capacity = 1_000_000 // B
    belady = replay(trace, capacity, BELADY)
    lru = replay(trace, capacity, "lru")
    arc = replay(trace, capacity, "arc")
    assert 0.1 < infinite < 0.3  # 16.4%: the first minutes share less than the whole trace (37.3%)
    assert infinite >= belady >= max(lru, arc) > 0.03
    assert belady > 2 * lru  # at 1M tokens LRU loses most of what an offline policy keeps


def test_conversation_trace_host_tier_adds_up_with_the_device():
    path = TRACES / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        pytest.skip("real Mooncake traces: ../shared/data/traces not found")
    trace = load_trace(path, max_requests=2000)
    device = 1_000_000 // B
    tiered = replay(trace, device, "lru", ReplayConfig(offload_blocks=2_000_000 // B))
    # 0.147 measured: as much as one 3M-token cache, three times the device alone (0.048)
    assert tiered >= 0.99 * replay(trace, 3_000_000 // B, "lru")
    assert tiered > 2 * replay(trace, device, "lru")


def test_conversation_trace_shared_retention_beats_lru():
    path = TRACES / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        pytest.skip("real Mooncake traces: ../shared/data/traces not found")
    trace = load_trace(path, max_requests=2000)
    capacity = 1_000_000 // B
    lru = replay(trace, capacity, "lru")
    shared = replay(trace, capacity, "lru", retention_rule="shared")
    # 0.080 against 0.048 measured (Belady 0.177: a quarter of the gap closed on this slice)
    assert shared > 1.5 * lru
