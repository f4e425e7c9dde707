"""Random admit / append / free / preempt / reset sequences keep the manager's bookkeeping consistent.

Alongside the manager, the test records what each KV slot really holds: the token a request wrote
there, or copied there for a sub-block hit (copies run before the step's writes, and sub-block
prefixes are indexed after them, as in the engine). Every hit must return blocks whose recorded
content equals the request's own tokens. With a recurrent-state group it also records what each state slot
holds (the tokens it has consumed): the runner's zeroing or restore before the step, the step's saves, the
working slot after it; a request's working state must always be its own tokens up to where it computes from.
"""

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache.core import EVICTION_POLICIES, FULL_ATTENTION, KVCacheGroupSpec, KVCacheManager, Request
from prefixcache.core.eviction import EXPIRED
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.core.retention import DEFAULT_PRIORITY, RetentionRange
from prefixcache.core.state_table import CheckpointPolicy
from tests.core.conftest import FakeClock, manager_state

BLOCK_SIZE = 4
PREFIXES = [list(range(100, 112)), list(range(200, 206)), list(range(100, 108)) + [7, 7]]


class ManagerMachine(RuleBasedStateMachine):
    POLICY = "lru"
    SUB_BLOCK_SIZE: int | None = None
    GROUPS = (FULL_ATTENTION,)
    NUM_BLOCKS = 12
    RETENTION = False  # requests with retention directives and tenants, a clock that moves
    NUM_STATE_SLOTS = 0
    NUM_CHECKPOINT_SLOTS = 0
    CHECKPOINTS = CheckpointPolicy()
    RETENTION_RULE: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.mgr = KVCacheManager(
            num_blocks=self.NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            eviction_policy=self.POLICY,
            sub_block_size=self.SUB_BLOCK_SIZE,
            groups=self.GROUPS,
            max_retained_fraction=0.5,
            max_tenant_retained_fraction=0.25,
            max_retention_ttl_s=40.0,
            clock=self.clock,
            num_state_slots=self.NUM_STATE_SLOTS,
            num_checkpoint_slots=self.NUM_CHECKPOINT_SLOTS,
            checkpoint_policy=self.CHECKPOINTS,
            retention_rule=self.RETENTION_RULE,
        )
        self.states: dict[int, tuple] = {}
        self.running: list[Request] = []
        self.preempted: list[Request] = []
        self.slots: dict[int, list] = {}
        self.ids = itertools.count()

    def _run_step(self, req: Request, start: int) -> None:
        """What the model runner and engine do after an allocation: copies, writes, then indexing."""
        for op in self.mgr.take_transfers()[0]:
            self.slots.setdefault(op.dst, [None] * BLOCK_SIZE)[: op.num_tokens] = self.slots[op.src][: op.num_tokens]
        work = self.mgr.state_work(req)
        if work is not None:

            def consumed(n):
                return req.cache_salt, tuple(req.all_token_ids[:n])

            if work.zero:
                self.states[work.slot] = consumed(0)
            elif work.restore_from is not None:
                self.states[work.slot] = self.states[work.restore_from]
            assert self.states.get(work.slot) == consumed(start), "the working state is not the request's own"
            for n, slot in work.saves:
                assert n > 0 and (start + n) % BLOCK_SIZE == 0 and start + n <= req.num_computed_tokens
                self.states[slot] = consumed(start + n)
            self.states[work.slot] = consumed(req.num_computed_tokens)
        for table in self.mgr._tables[req.request_id]:
            for pos in range(start, req.num_computed_tokens):
                block = table[pos // BLOCK_SIZE]
                assert block is not self.mgr.null_block, "a token is computed into the null block"
                self.slots.setdefault(block.block_id, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = (
                    req.cache_salt,
                    req.all_token_ids[pos],
                )
        self.mgr.index_written_sub_blocks()

    def _admit(self, req: Request, chunk: int) -> bool:
        hit = self.mgr.find_prefix(req)
        num_cached = hit.num_tokens
        for g, blocks in enumerate(hit.blocks):
            if self.GROUPS[g].recurrent_state:
                assert blocks == [], "the recurrent-state group holds no blocks"
                continue
            assert len(blocks) == -(-num_cached // BLOCK_SIZE), "groups disagree on the hit"
            window = self.GROUPS[g].window_blocks(BLOCK_SIZE)
            for i, block in enumerate(blocks):
                if block is self.mgr.null_block:
                    assert window is not None and i < len(blocks) - window, "a block inside the window is missing"
                    continue
                n = min(BLOCK_SIZE, num_cached - i * BLOCK_SIZE)
                expected = [(req.cache_salt, t) for t in req.all_token_ids[i * BLOCK_SIZE : i * BLOCK_SIZE + n]]
                assert self.slots[block.block_id][:n] == expected, "a hit returned a block holding other tokens"
        num_new = min(chunk, req.num_tokens - num_cached)
        if self.mgr.allocate_slots(req, num_new, hit) is None:
            return False
        self._run_step(req, num_cached)
        self.running.append(req)
        return True

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        suffix=st.lists(st.integers(0, 3), max_size=9),
        salt=st.sampled_from([None, None, "t1"]),
        chunk=st.integers(1, 24),
    )
    def admit_new(self, prefix, suffix, salt, chunk):
        req = Request(f"r{next(self.ids)}", PREFIXES[prefix] + suffix, cache_salt=salt)
        self._admit(req, chunk)

    @precondition(lambda self: self.RETENTION)
    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        suffix=st.lists(st.integers(0, 3), max_size=9),
        tenant=st.sampled_from([None, "A", "B"]),
        chunk=st.integers(1, 24),
        ranges=st.lists(
            st.tuples(
                st.integers(0, 11),
                st.one_of(st.none(), st.integers(1, 12)),
                st.sampled_from([0, 10, DEFAULT_PRIORITY, 60, 100]),
                st.sampled_from([None, 5.0, 20.0, 100.0]),
            ),
            min_size=1,
            max_size=3,
        ),
    )
    def admit_retained(self, prefix, suffix, tenant, chunk, ranges):
        """A request whose ranges mark parts of its prompt (tenants share the salt, so they meet on blocks)."""
        tokens = PREFIXES[prefix] + suffix
        retention = [
            RetentionRange(start, None if length is None else min(start + length, len(tokens)), priority, ttl)
            for start, length, priority, ttl in ranges
            if start < len(tokens)
        ]
        self._admit(Request(f"r{next(self.ids)}", tokens, retention=retention, tenant=tenant), chunk)

    @precondition(lambda self: self.RETENTION)
    @rule(seconds=st.sampled_from([1.0, 5.0, 30.0]))
    def advance_clock(self, seconds):
        self.clock.advance(seconds)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), num=st.integers(1, 8), token=st.integers(0, 3))
    def step(self, index, num, token):
        """Continue prefill, or decode one token once the prompt is done."""
        req = self.running[index % len(self.running)]
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([token])
            num = 1
        num = min(num, req.num_tokens - req.num_computed_tokens)
        before = req.num_computed_tokens
        if self.mgr.allocate_slots(req, num) is None:
            assert req.num_computed_tokens == before
            return
        for spec, table in zip(self.GROUPS, self.mgr.block_ids(req), strict=True):
            gone = spec.first_needed_block(before, BLOCK_SIZE)
            assert table[:gone] == [0] * gone, "a block that left the window is still held"
        self._run_step(req, before)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        self.mgr.free(self.running.pop(index % len(self.running)))

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def preempt(self, index):
        req = self.running.pop(index % len(self.running))
        self.mgr.free(req)
        self.preempted.append(req)

    @precondition(lambda self: self.preempted)
    @rule(chunk=st.integers(1, 24))
    def resume(self, chunk):
        req = self.preempted[0]
        if self._admit(req, chunk):
            self.preempted.pop(0)

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        suffix=st.lists(st.integers(0, 3), max_size=9),
        salt=st.sampled_from([None, "t1"]),
    )
    def lookup(self, prefix, suffix, salt):
        """A lookup finds what admission would, and changes nothing, eviction order included."""
        tokens = PREFIXES[prefix] + suffix
        before = manager_state(self.mgr)
        found = self.mgr.lookup(tokens, cache_salt=salt)
        assert manager_state(self.mgr) == before
        assert found.cached_tokens == self.mgr.find_prefix(Request("probe", tokens, cache_salt=salt)).num_tokens
        assert found.cached_tokens + sum(found.missed_tokens.values()) == len(tokens)

    @rule()
    def reset(self):
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            assert self.mgr.find_prefix(Request("probe", PREFIXES[0] + [1])).num_tokens == 0

    @invariant()
    def bookkeeping_is_consistent(self):
        self.mgr.check_invariants()
        stats = self.mgr.stats
        assert stats.queries == stats.hits + sum(stats.missed_tokens.values())
        null = self.mgr.null_block
        held = {b for r in self.running for table in self.mgr.block_ids(r) for b in table if null is None or b != 0}
        assert self.mgr.num_free_blocks == self.mgr.num_usable_blocks - len(held)
        assert null is None or null.block_id not in self.slots, "the null block was written"

    @invariant()
    def free_blocks_leave_expired_first_then_by_priority(self):
        pool = self.mgr.pool
        ranks = [block.priority for block in pool.eviction_order()]  # expires what is due first
        assert ranks == sorted(ranks), "the eviction order is not expired, then lowest priority first"
        for block in pool.retained_free:
            assert block.priority == EXPIRED or block.expires_at > self.clock.now, "a due expiry was missed"


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestManagerMachine = ManagerMachine.TestCase

# The same invariants under every other registered eviction policy, and with sub-block matching.
_variants = {f"_{p}": {"POLICY": p} for p in EVICTION_POLICIES if p != ManagerMachine.POLICY}
_variants["_sub_block"] = {"SUB_BLOCK_SIZE": 2}
# Two groups sharing the pool, the second sliding (a query sees the 5 tokens before it: 2 blocks), under every
# eviction policy.
for _policy in EVICTION_POLICIES:
    _variants[f"_hybrid_{_policy}"] = {
        "POLICY": _policy,
        "GROUPS": (FULL_ATTENTION, KVCacheGroupSpec(sliding_window=6)),
        "NUM_BLOCKS": 25,
    }
# Directives, tenants and TTLs under every eviction policy, and beside a sliding group.
for _policy in EVICTION_POLICIES:
    _variants[f"_retention_{_policy}"] = {"POLICY": _policy, "RETENTION": True}
_variants["_hybrid_retention"] = {
    "RETENTION": True,
    "GROUPS": (FULL_ATTENTION, KVCacheGroupSpec(sliding_window=6)),
    "NUM_BLOCKS": 25,
}
# Three kinds: full attention, a sliding window and recurrent state (2 working states, 3 checkpoints, sparse ones
# every 2 blocks), under every eviction policy.
for _policy in EVICTION_POLICIES:
    _variants[f"_state_{_policy}"] = {
        "POLICY": _policy,
        "GROUPS": (FULL_ATTENTION, KVCacheGroupSpec(sliding_window=6), RECURRENT_STATE),
        "NUM_BLOCKS": 25,
        "NUM_STATE_SLOTS": 2,
        "NUM_CHECKPOINT_SLOTS": 3,
        "CHECKPOINTS": CheckpointPolicy(sparse_every_blocks=2),
    }
# The shared retention rule marking what requests share: alone, beside users' directives (their clock moves, so
# the rule's marks expire too), and with a sliding group.
_variants["_shared_retention"] = {"RETENTION_RULE": "shared"}
_variants["_shared_retention_with_directives"] = {"RETENTION_RULE": "shared", "RETENTION": True}
_variants["_hybrid_shared_retention"] = {
    "RETENTION_RULE": "shared",
    "GROUPS": (FULL_ATTENTION, KVCacheGroupSpec(sliding_window=6)),
    "NUM_BLOCKS": 25,
}
for _suffix, _attrs in _variants.items():
    _machine = type(f"ManagerMachine{_suffix}", (ManagerMachine,), _attrs)
    _machine.TestCase.settings = ManagerMachine.TestCase.settings
    globals()[f"TestManagerMachine{_suffix}"] = _machine.TestCase
