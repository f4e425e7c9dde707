"""How one backend's KV cache events become entries of the router's index.

- :class:`EngineKeyedBlocks`: a ``prefixcache serve`` backend hashes blocks exactly as the router hashes
  prompts (same algorithm, seed and salting, checked at ``/v1/cache/config``), so the hashes its events
  carry are the index's keys as they come, whatever the medium and whether or not the event has tokens.
- :class:`ContentKeyedBlocks`: any other engine (vLLM) hashes its own way (another algorithm, a random
  seed per process), so its hashes are only names. Each ``BlockStored`` carries its blocks' token ids and
  the parent's hash: the router rebuilds its own chained hash of the content, the parent resolved through
  the backend-hash -> router-hash map kept here, and keys the index by that. ``BlockRemoved`` and
  ``AllBlocksCleared`` go through the same map, which forgets a block once no medium holds it.

What the content does not tell cannot be keyed, and is counted instead (``blocks_unindexed``): a block
whose extra keys hold more than its LoRA name (vLLM publishes a cache salt, multimodal items and prompt
embeddings there, none of which a router can rebuild from a request) and the blocks chained under it; a
store without tokens (an offload tier's) of a block never seen with them; a block whose parent the router
never saw (stored before it listened, beyond the replay). A prompt of such blocks is routed by load.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.core.hashing import LORA_TAG, BlockHash, ExtraKeys, hash_blocks, pack_token_ids, root_hash
from prefixcache.router.index import PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.wire import MEDIUM_GPU, BlockRemoved, BlockStored, external_block_hash

# The router's own content hash. A collision could only send a request to the wrong backend (each engine
# checks its own cache with its own hash), never share K/V, so the fast non-cryptographic hash is enough.
CONTENT_HASH_ALGO = "xxhash"
CONTENT_HASH_SEED = "prefixcache-router-content"
CONTENT_ROOT = root_hash(CONTENT_HASH_ALGO, CONTENT_HASH_SEED)


class BadEventError(ValueError):
    """An event that contradicts the wire format (token ids that are not ids, a length that does not add up)."""


class EventsRefusedError(RuntimeError):
    """The backend's events cannot describe the prompts the router hashes (another block size)."""


class EngineKeyedBlocks:
    """A backend whose block hashes are the router's own: stored and removed as they come."""

    def __init__(self, index: PrefixIndex, backend: str) -> None:
        self.index = index
        self.backend = backend

    def store(self, event: BlockStored) -> None:
        self.index.store(self.backend, map(external_block_hash, event.block_hashes), event.medium or MEDIUM_GPU)

    def remove(self, event: BlockRemoved) -> None:
        self.index.remove(self.backend, map(external_block_hash, event.block_hashes), event.medium or MEDIUM_GPU)

    def clear(self, medium: str | None = None) -> None:
        """``medium``'s entries (a reset of the engine's cache keeps its offload tiers'), or all of them."""
        self.index.clear(self.backend, medium)


class ContentKeyedBlocks(EngineKeyedBlocks):
    """A backend keyed by the router's hash of each block's tokens. ``block_size`` is the router's for prompts;
    ``lora_names`` collects the adapters seen in events, which a request's ``model`` may name."""

    def __init__(self, index: PrefixIndex, backend: str, metrics: RouterMetrics, block_size: int) -> None:
        super().__init__(index, backend)
        self.metrics = metrics
        self.block_size = block_size
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
            known = [self._router_hash[h] for h in theirs if h in self._router_hash]
            self._unindexed(len(theirs) - len(known))
            self.index.store(self.backend, [external_block_hash(d) for d in known], medium)
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
        ours = hash_blocks(CONTENT_HASH_ALGO, parent, packed, 0, keyable, self.block_size, _lora_keys(event.lora_name))
        self._unindexed(len(theirs) - keyable)
        self._router_hash.update(zip(theirs, ours, strict=False))
        self.index.store(self.backend, [external_block_hash(d) for d in ours], medium)

    def remove(self, event: BlockRemoved) -> None:
        medium = event.medium or MEDIUM_GPU
        for theirs in map(external_block_hash, event.block_hashes):
            digest = self._router_hash.get(theirs)
            if digest is None:
                continue
            ours = external_block_hash(digest)
            self.index.remove(self.backend, [ours], medium)
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
