"""Events from a real engine run, read back by a consumer with its own decoder."""

import itertools

from prefixcache.core import Request
from prefixcache.engine import SamplingParams
from tests.kv_events.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored, as_uint64

BLOCK = 4


def run(llm, prompt: list[int], max_tokens: int = 3):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    [output] = llm.generate([prompt], params, use_tqdm=False)
    return output


def expected_hashes(llm, token_ids: list[int]) -> list[bytes]:
    return llm.engine.core.manager.block_hashes(Request("expected", token_ids))


def all_events(llm, consumer) -> list:
    batches = consumer.replay_through(llm.engine.core.kv_events.publisher.next_seq - 1)
    assert [seq for seq, _ in batches] == list(range(len(batches))), "sequence numbers are 0, 1, 2, ..."
    return [event for _, batch in batches for event in batch.events]


def test_events_are_off_unless_enabled(tiny_loaded, tiny_llama_dir):
    from prefixcache.engine import LLM

    assert LLM(str(tiny_llama_dir), loaded=tiny_loaded, dtype="float32", num_blocks=16).engine.core.kv_events is None


def test_a_request_publishes_its_blocks_with_tokens_parent_and_size(make_llm, consumers):
    llm = make_llm()
    consumer = consumers(llm.engine.core.kv_events.publisher)
    prompt = list(range(10, 20))
    output = run(llm, prompt)
    stored = all_events(llm, consumer)
    assert stored and all(isinstance(e, BlockStored) for e in stored)
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == prompt[:8]  # the prompt's two full blocks, in the first step
    all_tokens = prompt + output.outputs[0].token_ids
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes == [as_uint64(h) for h in expected_hashes(llm, all_tokens)[: len(hashes)]]
    assert [t for e in stored for t in e.token_ids] == all_tokens[: len(hashes) * BLOCK]
    for before, after in itertools.pairwise(stored):
        assert after.parent_block_hash == before.block_hashes[-1]
    assert all((e.block_size, e.medium, e.lora_id, e.lora_name) == (BLOCK, "GPU", None, None) for e in stored)
    assert all(e.extra_keys == [None] * len(e.block_hashes) for e in stored)


def test_a_batch_is_published_only_after_the_forward_pass(make_llm, monkeypatch):
    llm = make_llm()
    engine = llm.engine.core
    log: list[str] = []
    execute, publish = engine.runner.execute, engine.kv_events.publisher.publish

    def logged_execute(step):
        log.append("execute")
        return execute(step)

    def logged_publish(batch):
        log.append("publish")
        publish(batch)

    monkeypatch.setattr(engine.runner, "execute", logged_execute)
    monkeypatch.setattr(engine.kv_events.publisher, "publish", logged_publish)
    run(llm, list(range(10, 22)), max_tokens=2)
    assert log[:2] == ["execute", "publish"]
    assert all(a == "execute" for a, b in itertools.pairwise(log) if b == "publish")


def test_eviction_removes_exactly_the_hashes_that_left_the_cache(make_llm, consumers):
    llm = make_llm(num_blocks=8, events={"block_hash_encoding": "bytes"})
    consumer = consumers(llm.engine.core.kv_events.publisher)
    run(llm, list(range(100, 112)), max_tokens=1)
    run(llm, list(range(200, 228)), max_tokens=1)  # 7 of 8 blocks: the first prompt's blocks are reused
    events = all_events(llm, consumer)
    stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed, "nothing was evicted"
    assert len(removed) == len(set(removed))
    assert set(removed) <= stored
    pool = llm.engine.core.manager.pool
    assert all(pool.get_cached_block(h) is None for h in removed)
    first_prompt = set(expected_hashes(llm, list(range(100, 112))))
    assert set(removed) <= first_prompt
    assert all(e.medium == "GPU" for e in events if isinstance(e, BlockRemoved))


def test_a_reset_publishes_all_blocks_cleared_at_once(make_llm, consumers):
    llm = make_llm()
    consumer = consumers(llm.engine.core.kv_events.publisher)
    run(llm, list(range(10, 20)))
    assert llm.reset_prefix_cache()
    events = all_events(llm, consumer)  # no step ran since the reset
    assert isinstance(events[-1], AllBlocksCleared)
    assert not any(isinstance(e, AllBlocksCleared) for e in events[:-1])


def test_the_null_publisher_runs_without_sockets(make_llm):
    llm = make_llm(events={"publisher": "null"})
    run(llm, list(range(10, 20)))
    assert llm.engine.core.kv_events.num_dropped == 0
    assert not hasattr(llm.engine.core.kv_events.publisher, "endpoint")


def removed_hashes(events: list, medium: str) -> list:
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes]


def test_host_tier_publishes_what_it_gains_and_gives_back_with_its_medium(make_llm, consumers):
    llm = make_llm(num_blocks=8, kv_offload_cpu="1MiB", events={"block_hash_encoding": "bytes"})
    core = llm.engine.core
    consumer = consumers(core.kv_events.publisher)
    first = list(range(100, 112))
    run(llm, first, max_tokens=1)
    run(llm, list(range(200, 228)), max_tokens=1)  # evicts blocks of the first prompt into the host tier
    evicted = removed_hashes(all_events(llm, consumer), "GPU")
    assert evicted and set(evicted) <= set(expected_hashes(llm, first))
    core.offload.writer.flush()
    run(llm, list(range(300, 304)), max_tokens=1)  # the next planned step delivers the tier's events
    host_stored = [e for e in all_events(llm, consumer) if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [h for e in host_stored for h in e.block_hashes][: len(evicted)] == evicted  # write-back
    assert all((e.token_ids, e.parent_block_hash, e.block_size) == ([], None, BLOCK) for e in host_stored)
    run(llm, [*first, 1], max_tokens=1)  # loaded back into the device: the write-back host tier gives them up
    run(llm, list(range(400, 404)), max_tokens=1)
    assert set(evicted) <= set(removed_hashes(all_events(llm, consumer), "CPU"))
