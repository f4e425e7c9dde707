"""How one backend's KV cache events become entries of the router's index.

- :class:`EngineKeyedBlocks`: a ``prefixcache serve`` backend hashes blocks exactly as the router hashes
  prompts (same algorithm, seed and salting, checked at ``/v1/cache/config``), so the hashes its events
  carry are the index's keys as they come, whatever the medium and whether or not the event has tokens.
  Its config also reports its KV cache groups, which the index knows from the start.
- :class:`ContentKeyedBlocks`: any other engine (vLLM) hashes its own way (another algorithm, a random
  seed per process), so its hashes are only names. Each ``BlockStored`` carries its blocks' token ids and
  the parent's hash: the router rebuilds its own chained hash of the content, the parent resolved through
  the backend-hash -> router-hash map kept here, and keys the index by that. ``BlockRemoved`` and
  ``AllBlocksCleared`` go through the same map, which forgets a block once no medium holds it.

Both keep each copy under its KV cache group (``group_idx``; none: group 0) and teach the index each group's
spec from the ``BlockStored`` that names it (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``), so
a hybrid backend's hit is predicted by the engine's rule (:mod:`~prefixcache.router.index`). A group of a
kind the router cannot predict is logged once; that backend is routed by load.

What the content does not tell cannot be keyed, and is counted instead (``blocks_unindexed``): a block
whose extra keys hold more than its LoRA name (vLLM publishes a cache salt, multimodal items and prompt
embeddings there, none of which a router can rebuild from a request) and the blocks chained under it; a
store without tokens (an offload tier's) of a block never seen with them; a block whose parent the router
never saw (stored before it listened, beyond the replay). A prompt of such blocks is routed by load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from prefixcache.core.hashing import LORA_TAG, BlockHash, ExtraKeys, hash_blocks, pack_token_ids, root_hash
from prefixcache.core.kv_cache_groups import KVCacheGroupSpec, spec_of_kind
from prefixcache.router.index import PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.wire import MEDIUM_GPU, BlockRemoved, BlockStored, external_block_hash

# The router's own content hash. A collision could only send a request to the wrong backend (each engine
# checks its own cache with its own hash), never share K/V, so the fast non-cryptographic hash is enough.
CONTENT_HASH_ALGO = "xxhash"
CONTENT_HASH_SEED = "prefixcache-router-content"
CONTENT_ROOT = root_hash(CONTENT_HASH_ALGO, CONTENT_HASH_SEED)
# A model has a KV cache group per few layers: a group index past this is not an engine's.
MAX_KV_CACHE_GROUPS = 1 << 12

logger = logging.getLogger(__name__)


class BadEventError(ValueError):
    """An event that contradicts the wire format (token ids that are not ids, a length that does not add up)."""


class EventsRefusedError(RuntimeError):
    """The backend's events cannot describe the prompts the router hashes (another block size)."""


class EngineKeyedBlocks:
    """A backend whose block hashes are the router's own: stored and removed as they come. ``block_size`` is
    the backend's; ``groups`` its KV cache groups as it reported them (none: learned from its events)."""

    def __init__(
        self, index: PrefixIndex, backend: str, block_size: int, groups: Sequence[KVCacheGroupSpec | None] = ()
    ) -> None:
        self.index = index
        self.backend = backend
        self.block_size = block_size
        self._unpredictable_kinds: set[str] = set()
        index.set_groups(backend, block_size, groups)

    def store(self, event: BlockStored) -> None:
        """Raises BadEventError for a group the event cannot name."""
        group = self._learn_group(event)
        hashes = map(external_block_hash, event.block_hashes)
        self.index.store(self.backend, hashes, event.medium or MEDIUM_GPU, group, event.retention)

    def remove(self, event: BlockRemoved) -> None:
        hashes = map(external_block_hash, event.block_hashes)
        self.index.remove(self.backend, hashes, event.medium or MEDIUM_GPU, _group_of(event))

    def clear(self, medium: str | None = None) -> None:
        """``medium``'s entries (a reset of the engine's cache keeps its offload tiers'), or all of them."""
        self.index.clear(self.backend, medium)

    def _learn_group(self, event: BlockStored) -> int:
        """The event's group, whose spec the index learns when the event names it; BadEventError for a group
        index out of range or a sliding group without a window (nothing learned then)."""
        group = _group_of(event)
        kind = event.kv_cache_spec_kind
        if kind is None:
            return group
        try:
            spec = spec_of_kind(kind, event.kv_cache_spec_sliding_window)
        except ValueError as exc:
            raise BadEventError(str(exc)) from None
        if spec is None and kind not in self._unpredictable_kinds:
            self._unpredictable_kinds.add(kind)
            logger.warning(
                "backend %s has a KV cache group of kind %r, whose hits the router cannot predict: routed by load",
                self.backend,
                kind,
            )
        self.index.learn_group(self.backend, group, spec, self.block_size)
        return group


class ContentKeyedBlocks(EngineKeyedBlocks):
    """A backend keyed by the router's hash of each block's tokens. ``block_size`` is the router's for prompts;
    ``lora_names`` collects the adapters seen in events, which a request's ``model`` may name."""

    def __init__(self, index: PrefixIndex, backend: str, metrics: RouterMetrics, block_size: int) -> None:
        super().__init__(index, backend, block_size)
        self.metrics = metrics
        self.lora_names: set[str] = set()
        self._router_hash: dict[int, BlockHash] = {}  # the backend's hash -> the router's digest

    def __len__(self) -> int:
        """Blocks of the backend the router can name."""
        return len(self._router_hash)

    def store(self, event: BlockStored) -> None:
        """Raises EventsRefusedError on another block size, BadEventError on an event that does not add up."""
        theirs = [external_block_hash(h) for h in event.block_hashes]
        medium = event.medium or MEDIUM_GPU
        if not event.token_ids:  # an offload tier naming blocks by hash only: those seen with tokens are known
            group = self._learn_group(event)
            known = [self._router_hash[h] for h in theirs if h in self._router_hash]
            self._unindexed(len(theirs) - len(known))
            self.index.store(self.backend, [external_block_hash(d) for d in known], medium, group)
            return
        if event.block_size != self.block_size:
            raise EventsRefusedError(
                f"its KV events carry blocks of {event.block_size} tokens and the router hashes prompts in blocks "
                f"of {self.block_size}: restart the router with --kv-event-block-size {event.block_size}"
            )
        if len(event.token_ids) != len(theirs) * self.block_size:
            raise BadEventError(f"{len(event.token_ids)} token ids for {len(theirs)} blocks of {self.block_size}")
        if event.parent_block_hash is None:
            parent = CONTENT_ROOT
        else:
            parent = self._router_hash.get(external_block_hash(event.parent_block_hash))
            if parent is None:
                self._unindexed(len(theirs))
                return
        keyable = _keyable_blocks(event)
        if event.lora_name:
            self.lora_names.add(event.lora_name)
        try:
            packed = pack_token_ids(event.token_ids)
        except ValueError as exc:
            raise BadEventError(str(exc)) from None
        group = self._learn_group(event)
        ours = hash_blocks(CONTENT_HASH_ALGO, parent, packed, 0, keyable, self.block_size, _lora_keys(event.lora_name))
        self._unindexed(len(theirs) - keyable)
        self._router_hash.update(zip(theirs, ours, strict=False))
        self.index.store(self.backend, [external_block_hash(d) for d in ours], medium, group, event.retention)

    def remove(self, event: BlockRemoved) -> None:
        medium = event.medium or MEDIUM_GPU
        group = _group_of(event)
        for theirs in map(external_block_hash, event.block_hashes):
            digest = self._router_hash.get(theirs)
            if digest is None:
                continue
            ours = external_block_hash(digest)
            self.index.remove(self.backend, [ours], medium, group)
            if not self.index.holds(self.backend, ours):
                del self._router_hash[theirs]

    def clear(self, medium: str | None = None) -> None:
        super().clear(medium)
        if medium is None:
            self._router_hash.clear()
            return
        held = self.index.holds
        self._router_hash = {t: d for t, d in self._router_hash.items() if held(self.backend, external_block_hash(d))}

    def _unindexed(self, count: int) -> None:
        if count:
            self.metrics.blocks_unindexed.labels(self.backend).inc(count)


def _group_of(event: BlockStored | BlockRemoved) -> int:
    """The KV cache group an event names (group 0 when it names none); BadEventError when out of range."""
    group = event.group_idx
    if group is None:
        return 0
    if not 0 <= group < MAX_KV_CACHE_GROUPS:
        raise BadEventError(f"group_idx {group} is not a KV cache group")
    return group


def _keyable_blocks(event: BlockStored) -> int:
    """Leading blocks whose extra keys are at most the LoRA name: what a request's tokens and model rebuild."""
    if not event.extra_keys:
        return len(event.block_hashes)
    lora_only = (event.lora_name,) if event.lora_name else ()
    for k, keys in enumerate(event.extra_keys):
        if keys and tuple(keys) != lora_only:
            return min(k, len(event.block_hashes))
    return len(event.block_hashes)


def _lora_keys(lora_name: str | None) -> Callable[[int], ExtraKeys | None] | None:
    """The tagged extra keys a request for the adapter hashes every block with (see ``Request.block_extra_keys``)."""
    if not lora_name:
        return None
    keys = ((LORA_TAG, lora_name),)
    return lambda _: keys
