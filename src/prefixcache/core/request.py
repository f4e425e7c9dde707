"""What the cache manager needs to know about a request: its tokens, its cache keys and its hashes."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixcache.core.hashing import LORA_TAG, MM_TAG, SALT_TAG, BlockHash, ExtraKeys, hash_blocks, pack_token_ids
from prefixcache.core.retention import BlockDirective, RetentionRange, check_retention


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """A multimodal item (image, audio) whose placeholder tokens sit at ``offset`` .. ``offset + length``.

    The placeholder token ids are the same for every image, so the item's content hash must be part
    of the key of every block the placeholder overlaps.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not self.identifier:
            raise ValueError("a multimodal feature needs a non-empty identifier (its content hash)")
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"multimodal feature span must have offset >= 0 and length > 0, got {self}")


@dataclass(slots=True, eq=False)
class Request:
    """A prompt plus the tokens generated so far.

    ``num_computed_tokens`` counts the tokens whose KV slots the manager has allocated (the cached
    prefix plus everything scheduled); ``block_hashes`` grows as blocks fill, so every block is hashed
    once per request however often it is looked up. ``retention`` are the request's retention directives (ranges of
    its tokens to keep at a priority, for a TTL) and ``tenant`` the API key's tenant whose quota bounds them.

    The manager counts, once per block position, the prompt tokens this request read from (``num_retained_read_
    tokens``: positions hit at its first admission) or wrote into (``num_retained_written_tokens``, and by the
    TTL the blocks were kept for in ``num_retained_written_tokens_by_ttl``) blocks above the default priority, and
    lists in ``retention_clamped`` the bounds its directives ran into.
    ``checkpoint_hints`` are prompt positions where a
    later request is likely to part from this one (the chat template's message boundaries): a model with
    recurrent layers checkpoints its state at the block boundary at or before each.
    """

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None
    mm_features: Sequence[MultiModalFeature] = ()
    skip_reading_prefix_cache: bool = False
    retention: Sequence[RetentionRange] = ()
    tenant: str | None = None
    checkpoint_hints: Sequence[int] = ()
    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = field(default=0, init=False)
    block_hashes: list[BlockHash] = field(default_factory=list, init=False)
    hash_key: tuple | None = field(default=None, init=False)
    counted_in_stats: bool = field(default=False, init=False)
    packed_token_ids: array = field(init=False, repr=False)
    num_retained_read_tokens: int = field(default=0, init=False)
    num_retained_written_tokens: int = field(default=0, init=False)
    num_retained_written_tokens_by_ttl: dict[float, int] = field(default_factory=dict, init=False)
    retention_clamped: list[str] = field(default_factory=list, init=False)
    retention_accounted_blocks: int = field(default=0, init=False)  # block positions counted read or written
    retention_read_end: int = field(default=0, init=False)  # positions before it were hits at first admission
    rule_reached_blocks: int = field(default=0, init=False)  # block positions the retention rule was told of
    block_directives: tuple[BlockDirective, ...] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"request {self.request_id!r}: cache_salt must be a non-empty string or None")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise ValueError(f"request {self.request_id!r}: lora_name must be a non-empty string or None")
        if self.tenant is not None and (not isinstance(self.tenant, str) or not self.tenant):
            raise ValueError(f"request {self.request_id!r}: tenant must be a non-empty string or None")
        try:
            self.retention = check_retention(self.retention, len(self.prompt_token_ids))
        except ValueError as exc:
            raise ValueError(f"request {self.request_id!r}: {exc}") from None
        hints = tuple(self.checkpoint_hints)
        num_prompt = len(self.prompt_token_ids)
        for position in hints:
            if isinstance(position, bool) or not isinstance(position, int) or not 0 < position <= num_prompt:
                raise ValueError(
                    f"request {self.request_id!r}: checkpoint hints must be prompt positions in 1 .. "
                    f"{num_prompt}, got {position!r}"
                )
        self.checkpoint_hints = hints
        self.packed_token_ids = pack_token_ids(self.prompt_token_ids)
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.mm_features = tuple(sorted(self.mm_features, key=lambda f: f.offset))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        """Append generated tokens; their blocks are hashed when the manager caches them."""
        self.packed_token_ids.extend(pack_token_ids(token_ids))
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    @property
    def has_extra_keys(self) -> bool:
        return bool(self.cache_salt or self.lora_name or self.mm_features)

    def block_extra_keys(self, block_index: int, block_size: int) -> ExtraKeys | None:
        """The tagged extra keys of one block: LoRA on every block, salt on the first, mm where overlapped."""
        keys: list[tuple] = []
        if self.lora_name is not None:
            keys.append((LORA_TAG, self.lora_name))
        if block_index == 0 and self.cache_salt is not None:
            keys.append((SALT_TAG, self.cache_salt))
        start, end = block_index * block_size, (block_index + 1) * block_size
        for feature in self.mm_features:
            if feature.offset >= end:
                break
            if feature.offset + feature.length > start:
                keys.append((MM_TAG, feature.identifier, feature.offset - start))
        return tuple(keys) or None

    def hash_blocks(
        self, algo: str, parent: BlockHash, start_block: int, num_blocks: int, block_size: int
    ) -> list[BlockHash]:
        """Chained hashes of ``num_blocks`` full blocks from ``start_block``, with this request's extra keys.

        ``parent`` is the hash of the block before ``start_block`` (the root hash for block 0). Engines and
        routers both hash through here, so they agree on every key.
        """
        extra = None
        if self.has_extra_keys:

            def extra(k: int) -> ExtraKeys | None:
                return self.block_extra_keys(k, block_size)

        return hash_blocks(algo, parent, self.packed_token_ids, start_block, num_blocks, block_size, extra)
