"""bench route: the simulation over several real managers, its reference, the live workload's ideal, the command."""

import json
import random
from pathlib import Path

import pytest

from prefixcache.bench.route import SINGLE, main, simulate, simulate_single
from prefixcache.bench.route_live import LiveWorkload, ideal_hit_rate
from prefixcache.bench.trace import ReplayConfig, TraceRequest, load_trace
from prefixcache.router.policy import make_policy
from tests.bench.test_trace import conversations, write_jsonl
from tests.helpers import build_tokenizer

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
B = 512
CONFIG = ReplayConfig(block_size=128, in_flight=4)


def tenants_trace(num_tenants: int, num_requests: int, seed: int) -> list[TraceRequest]:
    """Each tenant's requests share its own 3-block system prompt, then 1 block of their own."""
    rng = random.Random(seed)
    systems = [(3 * t, 3 * t + 1, 3 * t + 2) for t in range(num_tenants)]
    next_id = 3 * num_tenants
    out = []
    for i in range(num_requests):
        out.append(TraceRequest(float(i), 4 * B, 8, (*rng.choice(systems), next_id)))
        next_id += 1
    return out


def test_prefix_routing_keeps_tenants_apart_where_round_robin_thrashes():
    trace = tenants_trace(num_tenants=8, num_requests=400, seed=1)
    # each engine: 48 blocks of 128, about two tenants' system prompts (12 blocks each) plus requests in flight
    results = {name: simulate(trace, 4, 48, make_policy(name), CONFIG) for name in ("prefix", "round_robin")}
    assert results["prefix"].hit_rate > 1.5 * results["round_robin"].hit_rate
    assert results["prefix"].request_imbalance < 1.5
    for result in results.values():
        assert sum(result.requests) == len(trace)


def test_the_index_predicts_every_hit_when_nothing_waits():
    trace = conversations(300, seed=2)
    result = simulate(trace, 3, 4000, make_policy("prefix"), ReplayConfig(block_size=128))
    assert result.predicted_cached_tokens == result.cached_tokens > 0


def test_the_reference_is_one_engine_with_all_the_capacity():
    trace = conversations(200, seed=3)
    single = simulate_single(trace, 4, 50, ReplayConfig(block_size=128), False)
    assert single.policy == SINGLE and single.engines == 1 and single.capacity_tokens == 200 * 128
    assert single.requests == [len(trace)]


def test_the_command_prints_and_writes_every_policy(tmp_path, capsys):
    path = write_jsonl(tmp_path / "t.jsonl", conversations(120, seed=4))
    out = tmp_path / "r.json"
    main_args = ["sim", "--trace", str(path), "--engines", "2", "--capacity-tokens", "40000", "--block-size", "128"]
    main([*main_args, "--json", str(out), "--plot", str(tmp_path / "r.png")])
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == [SINGLE, "prefix", "round_robin", "least_load"]
    assert all(r["request_imbalance"] >= 1.0 for r in rows)
    assert (tmp_path / "r.png").stat().st_size > 0
    assert "infinite-capacity hit rate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["sim", "--trace", str(path), "--policy", "random"])


def test_the_live_workloads_ideal_counts_blocks_an_earlier_request_filled():
    tokenizer = build_tokenizer()
    workload = LiveWorkload.make(seed=0, tokenizer=tokenizer, tenants=2, system_len=32, user_len=4, num_requests=10)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in workload.prompts]
    systems = {}
    for tenant, prompt in zip(workload.tenants, workload.prompts, strict=True):
        systems.setdefault(tenant, prompt)
    assert len(ids) == 10 and all(len(p) >= 36 for p in ids)
    # each tenant's first request hits nothing, every later one the whole blocks of its system prompt
    system_blocks = {t: len(tokenizer.encode(s, add_special_tokens=False)) // 16 for t, s in systems.items()}
    expected = sum(system_blocks[t] * 16 for k, t in enumerate(workload.tenants) if t in workload.tenants[:k])
    assert ideal_hit_rate(ids, 16) == pytest.approx(expected / sum(map(len, ids)))


def test_a_fleet_conversation_grows_and_popularity_moves_by_phase():
    tokenizer = build_tokenizer()
    fleet = LiveWorkload.fleet(0, tokenizer, 8, 32, 4, 600, 1.0, turns=3, phases=2, answer_len=4, think=0.5)
    assert fleet.num_requests == 600 and all(len(c.turns) == 3 for c in fleet.conversations)
    for c in fleet.conversations:
        assert c.turns[0] < c.turns[1] < c.turns[2] and c.turns[2].startswith(c.turns[1])
    halves = [fleet.conversations[:100], fleet.conversations[100:]]
    hottest = [max(range(8), key=[x.tenant for x in half].count) for half in halves]
    assert hottest == [0, 4]  # the Zipf order rotated by half the tenants at the second phase


def test_prefix_stays_within_five_percent_of_one_big_engine_on_the_mooncake_trace():
    path = TRACES / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        pytest.skip(f"real Mooncake traces: {TRACES} not found")
    trace = load_trace(path, max_requests=3000)
    capacity = 250_000 // B
    single = simulate_single(trace, 4, capacity, ReplayConfig(), False)
    prefix = simulate(trace, 4, capacity, make_policy("prefix"), ReplayConfig())
    round_robin = simulate(trace, 4, capacity, make_policy("round_robin"), ReplayConfig())
    assert prefix.hit_rate >= 0.95 * single.hit_rate
    assert prefix.hit_rate > round_robin.hit_rate
    assert prefix.request_imbalance < 1.2
