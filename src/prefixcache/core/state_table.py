"""The recurrent-state group's table: each running request's working state slot, and the state checkpoints.

A recurrent layer (Gated DeltaNet, Mamba2, a short convolution) keeps no per-token K/V but one fixed-size state
per sequence, updated token by token. Reusing a prefix of ``k`` blocks therefore needs the state *exactly*
after those ``k * block_size`` tokens: a **checkpoint**, a copy of the state taken at a block boundary and
keyed by the hash of the block it ends (so the same tokens, salt and LoRA find it, as they find the blocks).
The model's state cache is slot-major: slots ``0 .. num_working_slots - 1`` are the running requests' working
states (one each, taken at admission, given back at ``free`` and preemption), the next
``num_checkpoint_slots`` hold checkpoints. Both counts are fixed when the engine sizes its memory, so
checkpoints are accounted against the KV cache memory like blocks are.

Where checkpoints are taken decides the hit rate; :class:`CheckpointPolicy` has one switch a rule:

- ``finish``: the last full block the request computed (prompt and output): its *frontier*, moved forward as
  it decodes (the previous frontier's slot is reused unless someone hit it), left behind when it finishes, so
  the next turn of a conversation hits all of it;
- ``junction``: a request whose attention groups match ``k`` blocks of a cached path with no checkpoint at
  ``k`` resumes from the deepest checkpoint below and leaves one at ``k``: every later request that parts
  there hits all ``k`` blocks (the third appearance of a prefix, and the second when sparse checkpoints
  help the second);
- ``sparse``: every ``sparse_every_blocks`` blocks along a prompt's prefill (:func:`sparse_interval` picks
  it from the budget), so even the second request sharing a prefix resumes close to where they part;
- ``hint``: at the block boundary at or before each of the request's ``checkpoint_hints`` (the chat
  template's message boundaries);
- ``step_end`` (off by default): where a scheduled step ends exactly on a block boundary, vLLM's "align"
  mode (with its large block size), to compare against.

A checkpoint saved while a step is scheduled is written by that step's forward pass, so it becomes findable
only at :meth:`StateTable.step_done` (the manager's ``take_transfers``). The budget is the number of
checkpoint slots: a save that finds none free evicts the **least useful** ready checkpoint, in this order:
one whose block some attention group no longer holds (no hit can reach it), then a sparse one never hit (a
guess that did not pay), then the least recently used (saved or hit). Recency rather than hit counts: a
conversation's previous frontier was hit once by its next turn and is of no use after it, while the new
frontier, not hit yet, is what the next turn needs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixcache.core.block_pool import BlockPoolListener, StoredBlocks
from prefixcache.core.hashing import BlockHash
from prefixcache.core.request import Request

CHECKPOINT_RULES = ("finish", "junction", "sparse", "hint", "step_end")


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Which rules place checkpoints (see the module's docstring); ``sparse_every_blocks`` 0 turns sparse off."""

    sparse_every_blocks: int = 0
    at_finish: bool = True
    at_junctions: bool = True
    at_hints: bool = True
    at_step_ends: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sparse_every_blocks, bool) or not isinstance(self.sparse_every_blocks, int):
            raise ValueError(f"sparse_every_blocks must be an integer, got {self.sparse_every_blocks!r}")
        if self.sparse_every_blocks < 0:
            raise ValueError(f"sparse_every_blocks must be >= 0, got {self.sparse_every_blocks}")


DEFAULT_CHECKPOINT_POLICY = CheckpointPolicy()
# vLLM's "align" mode: a checkpoint only where a scheduled step ends on a (large) block boundary.
ALIGNED_POLICY = CheckpointPolicy(at_finish=False, at_junctions=False, at_hints=False, at_step_ends=True)


# The densest sparse checkpoints, in tokens: every save cuts the recurrent layers' chunked prefill there, and
# each copies a whole state, so a budget with room for many still places them no closer than this.
MIN_SPARSE_TOKENS = 256


def sparse_interval(max_model_len: int, block_size: int, num_checkpoint_slots: int) -> int:
    """The sparse rule's interval in blocks: a prefill of the longest request leaves at most half the
    checkpoint slots (sparse checkpoints are evicted before the others, so the rest keep their room), and
    never closer than ``MIN_SPARSE_TOKENS``; 0 (off) with fewer than two slots."""
    if num_checkpoint_slots < 2:
        return 0
    max_blocks = -(-max_model_len // block_size)
    return max(-(-MIN_SPARSE_TOKENS // block_size), -(-max_blocks // (num_checkpoint_slots // 2)))


@dataclass(slots=True, eq=False)
class Checkpoint:
    """The state after the first ``num_blocks`` blocks of a prefix, in state slot ``slot``, keyed by the hash of
    block ``num_blocks - 1``; ``rule`` placed it; ``ready`` once the forward pass that saves it ran."""

    slot: int
    block_hash: BlockHash
    num_blocks: int
    rule: str
    ready: bool = False
    hits: int = 0
    last_used: int = 0


@dataclass(slots=True)
class StateWork:
    """A request's state work for one step, for the model runner: before the forward pass, zero ``slot``
    (``zero``) or copy checkpoint slot ``restore_from`` into it (the first step after admission only; with neither
    at admission, an offload tier's checkpoint is loaded into it); during
    it, for each ``(n, s)`` of ``saves``, copy the state after the first ``n`` tokens of this step's chunk into
    slot ``s`` (``n`` a multiple of the block size, counted from the chunk's first token)."""

    slot: int
    zero: bool = False
    restore_from: int | None = None
    saves: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class CheckpointStats:
    """Checkpoints saved, evicted and hit (requests admitted from one) by the rule that placed them."""

    saved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECKPOINT_RULES, 0))
    evicted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECKPOINT_RULES, 0))
    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECKPOINT_RULES, 0))


@dataclass(slots=True)
class _Running:
    slot: int
    work: StateWork
    junction: int  # the boundary (blocks) to leave a junction checkpoint at; 0 for none
    hints: tuple[int, ...]  # boundaries (blocks) of the request's hints
    frontier: Checkpoint | None = None
    first_step: bool = True


class StateTable:
    """Working state slots and checkpoints of one recurrent-state group (see the module's docstring).

    ``attention_lookups`` tell whether each attention group still holds a block hash (an orphaned checkpoint
    goes first); ``block_size`` is the attention groups' block size, the checkpoints' granularity.
    ``listeners`` (KV events, a router's index) hear each checkpoint as a block of group ``group`` stored when
    its save is planned (before it is written, as blocks are) and removed when it goes, so a consumer that
    keeps each group's hashes predicts the hit with ``longest_common_hit``, as vLLM's events of a mamba group
    allow. ``on_evicted`` hears each ready checkpoint the budget evicts, while its slot still holds it (until the
    forward pass of the step that reuses the slot): the offload tiers demote it, as the pool's evicted blocks.
    """

    def __init__(
        self,
        num_working_slots: int,
        num_checkpoint_slots: int,
        policy: CheckpointPolicy,
        block_size: int,
        attention_lookups: Sequence[Callable[[BlockHash], object | None]],
        group: int = 1,
        listeners: Sequence[BlockPoolListener] = (),
        on_evicted: Callable[[Checkpoint], None] | None = None,
    ) -> None:
        if num_working_slots < 1:
            raise ValueError(f"a recurrent-state group needs working state slots, got {num_working_slots}")
        if num_checkpoint_slots < 0:
            raise ValueError(f"num_checkpoint_slots must be >= 0, got {num_checkpoint_slots}")
        self.num_working_slots = num_working_slots
        self.num_checkpoint_slots = num_checkpoint_slots
        self.policy = policy
        self.block_size = block_size
        self._attention_lookups = list(attention_lookups)
        self.group = group
        self._listeners = list(listeners)
        self._on_evicted = on_evicted
        self._free_working: deque[int] = deque(range(num_working_slots))
        self._free_checkpoints: deque[int] = deque(range(num_working_slots, num_working_slots + num_checkpoint_slots))
        self.checkpoints: dict[BlockHash, Checkpoint] = {}
        self._pending: list[Checkpoint] = []
        self._running: dict[str, _Running] = {}
        self._clock = 0
        self.stats = CheckpointStats()

    @property
    def num_slots(self) -> int:
        """State slots the model's state cache has: working ones, then checkpoint ones."""
        return self.num_working_slots + self.num_checkpoint_slots

    @property
    def has_working_slot(self) -> bool:
        return bool(self._free_working)

    @property
    def pending(self) -> tuple[Checkpoint, ...]:
        """The checkpoints this step saves (written by its forward pass, findable after :meth:`step_done`)."""
        return tuple(self._pending)

    def lookup(self, block_hash: BlockHash) -> Checkpoint | None:
        """The ready checkpoint at the end of the block of ``block_hash``, if any."""
        checkpoint = self.checkpoints.get(block_hash)
        return checkpoint if checkpoint is not None and checkpoint.ready else None

    def admit(
        self, request: Request, checkpoint: Checkpoint | None, junction_blocks: int, loaded: bool = False
    ) -> None:
        """Give ``request`` a working slot, restored from ``checkpoint`` (zeroed without one, left as it is when the
        state is ``loaded`` into it from elsewhere: an offload tier); it leaves a junction checkpoint at
        ``junction_blocks`` (0: none). The caller checked :attr:`has_working_slot`."""
        slot = self._free_working.popleft()
        if checkpoint is not None:
            self._clock += 1
            checkpoint.hits += 1
            checkpoint.last_used = self._clock
            self.stats.hits[checkpoint.rule] += 1
        zero = checkpoint is None and not loaded
        work = StateWork(slot, zero=zero, restore_from=None if checkpoint is None else checkpoint.slot)
        hints = ()
        if self.policy.at_hints and request.checkpoint_hints:
            hints = tuple(sorted({position // self.block_size for position in request.checkpoint_hints}))
        junction = junction_blocks if self.policy.at_junctions else 0
        self._running[request.request_id] = _Running(slot, work, junction, hints)

    def schedule_saves(self, request: Request, hashes: Sequence[BlockHash], start: int, end: int) -> None:
        """Plan the checkpoints the step computing tokens ``start .. end - 1`` of ``request`` takes, into its
        :meth:`work` (a new one for every step after the admission's)."""
        running = self._running[request.request_id]
        if running.first_step:
            running.first_step = False
        else:
            running.work = StateWork(running.slot)
        block_size = self.block_size
        first, last = start // block_size + 1, end // block_size
        if last < first:
            return
        policy = self.policy
        rules: dict[int, str] = {}
        if policy.sparse_every_blocks:
            every = policy.sparse_every_blocks
            prompt_blocks = request.num_prompt_tokens // block_size
            for boundary in range(-(-first // every) * every, min(last, prompt_blocks) + 1, every):
                rules[boundary] = "sparse"
        for boundary in running.hints:
            if first <= boundary <= last:
                rules[boundary] = "hint"
        if first <= running.junction <= last:
            rules[running.junction] = "junction"
        if policy.at_step_ends and end % block_size == 0:
            rules.setdefault(last, "step_end")
        if policy.at_finish:
            rules.setdefault(last, "finish")
        for boundary in sorted(rules):
            self._save(running, request, hashes, boundary, rules[boundary], start)
        if policy.at_finish and rules[last] != "finish":
            self._drop_frontier(running)  # a deeper checkpoint of another rule covers the request's state

    def work(self, request: Request) -> StateWork:
        """The state work of ``request``'s step just scheduled."""
        return self._running[request.request_id].work

    def step_done(self) -> None:
        """The step's saves are planned and handed to the runner: from the next step on they can be hit."""
        for checkpoint in self._pending:
            checkpoint.ready = True
        self._pending.clear()

    def free(self, request: Request) -> None:
        """Give the request's working slot back (finished or preempted); its checkpoints stay."""
        running = self._running.pop(request.request_id, None)
        if running is not None:
            self._free_working.append(running.slot)

    def reset(self) -> None:
        """Forget every checkpoint (the pool was reset: no request runs)."""
        self.checkpoints.clear()
        self._pending.clear()
        w = self.num_working_slots
        self._free_checkpoints = deque(range(w, w + self.num_checkpoint_slots))

    def check_invariants(self) -> None:
        """Assert that slots, checkpoints and running requests agree. For tests and debugging."""
        working = [r.slot for r in self._running.values()] + list(self._free_working)
        assert sorted(working) == list(range(self.num_working_slots)), f"working slots lost or shared: {working}"
        held = [c.slot for c in self.checkpoints.values()] + list(self._free_checkpoints)
        w = self.num_working_slots
        assert sorted(held) == list(range(w, self.num_slots)), f"checkpoint slots lost or shared: {sorted(held)}"
        for block_hash, checkpoint in self.checkpoints.items():
            assert checkpoint.block_hash == block_hash, "a checkpoint is keyed by another hash"
        for checkpoint in self._pending:
            assert not checkpoint.ready and self.checkpoints.get(checkpoint.block_hash) is checkpoint, (
                "a pending checkpoint is ready or gone"
            )

    def _save(
        self, running: _Running, request: Request, hashes: Sequence[BlockHash], boundary: int, rule: str, start: int
    ) -> None:
        block_hash = hashes[boundary - 1]
        if block_hash in self.checkpoints:
            if rule == "finish":
                self._drop_frontier(running)
            return
        slot = None
        if rule == "finish":
            slot = self._drop_frontier(running, keep_slot=True)
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return
        self._clock += 1
        checkpoint = Checkpoint(slot, block_hash, boundary, rule, last_used=self._clock)
        self.checkpoints[block_hash] = checkpoint
        self._pending.append(checkpoint)
        self.stats.saved[rule] += 1
        running.work.saves.append((boundary * self.block_size - start, slot))
        if rule == "finish":
            running.frontier = checkpoint
        if self._listeners:
            size, last = self.block_size, boundary - 1
            stored = StoredBlocks(
                block_hashes=[block_hash],
                parent_block_hash=hashes[last - 1] if last else None,
                token_ids=request.all_token_ids[last * size : boundary * size],
                block_size=size,
                lora_name=request.lora_name,
                extra_keys=[request.block_extra_keys(last, size)],
                group=self.group,
            )
            for listener in self._listeners:
                listener.blocks_stored(stored)

    def _drop_frontier(self, running: _Running, keep_slot: bool = False) -> int | None:
        """Drop the request's previous frontier checkpoint unless someone hit it (or it is not written yet);
        its slot is returned for reuse with ``keep_slot``, else freed."""
        frontier, running.frontier = running.frontier, None
        if (
            frontier is None
            or frontier.hits
            or not frontier.ready
            or self.checkpoints.get(frontier.block_hash) is not frontier
        ):
            return None
        self._remove(frontier)
        if keep_slot:
            return frontier.slot
        self._free_checkpoints.append(frontier.slot)
        return None

    def _take_slot(self) -> int | None:
        """A free checkpoint slot, evicting the least useful ready checkpoint when none is; None when every slot
        holds a checkpoint this step is still to write (or there are none)."""
        if self._free_checkpoints:
            return self._free_checkpoints.popleft()
        candidates = [c for c in self.checkpoints.values() if c.ready]
        if not candidates:
            return None
        victim = min(candidates, key=self._usefulness)
        if self._on_evicted is not None:
            self._on_evicted(victim)
        self._remove(victim)
        self.stats.evicted[victim.rule] += 1
        return victim.slot

    def _remove(self, checkpoint: Checkpoint) -> None:
        del self.checkpoints[checkpoint.block_hash]
        for listener in self._listeners:
            listener.blocks_removed([checkpoint.block_hash], self.group)

    def _usefulness(self, checkpoint: Checkpoint) -> tuple[bool, bool, int]:
        """Ordered so that the least useful is the smallest: orphaned, a sparse one never hit, least recently
        used."""
        reachable = all(lookup(checkpoint.block_hash) is not None for lookup in self._attention_lookups)
        return reachable, checkpoint.hits > 0 or checkpoint.rule != "sparse", checkpoint.last_used
