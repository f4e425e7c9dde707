"""How the engine lays ``--kv-cache-memory`` out for a model: its KV cache groups, the attention blocks, and for a
model with recurrent layers the working state slots and the state checkpoints beside them.

Torch-free and computed from the model's config alone (no weights, no tensors), so that ``prefixcache explain``
sizes its replay exactly as ``prefixcache serve`` sizes the cache it predicts. The engine core builds its cache
manager and tensors from the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.config import EngineConfig, parse_memory
from prefixcache.core import KVCacheGroupSpec
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.core.state_table import CheckpointPolicy, sparse_interval

if TYPE_CHECKING:  # the model package loads torch; its config alone does not need it
    from prefixcache.model.config import KVCacheGroup, ModelConfig

# Bytes of an element of each dtype the engine runs (EngineConfig resolves "auto" to one of them).
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The KV cache of one model under one ``EngineConfig``.

    ``model_groups`` are the attention layers' groups, ``groups`` their specs for the cache manager (with the
    recurrent-state group last for a model with recurrent layers). ``num_state_slots`` working states (one a
    running request, ``max_num_seqs``) and ``num_checkpoint_slots`` checkpoints of ``state_slot_bytes`` each come
    out of the memory first (the checkpoints ``max_state_checkpoint_fraction`` of it); ``num_blocks`` of
    ``block_bytes`` get the rest (or the exact count asked for). ``max_model_len`` is the context the engine runs,
    ``enable_caching`` whether it caches at all (not for a model whose attention is not causal).
    """

    model_groups: tuple[KVCacheGroup, ...]
    groups: tuple[KVCacheGroupSpec, ...]
    block_bytes: int
    state_slot_bytes: int
    num_blocks: int
    num_state_slots: int
    num_checkpoint_slots: int
    max_model_len: int
    enable_caching: bool

    @property
    def state_bytes(self) -> int:
        """What the recurrent states take, working ones and checkpoints (0 without recurrent layers)."""
        return (self.num_state_slots + self.num_checkpoint_slots) * self.state_slot_bytes

    def checkpoint_policy(self, block_size: int) -> CheckpointPolicy:
        """The checkpoint policy the engine runs: every rule, sparse checkpoints spaced for this budget."""
        every = sparse_interval(self.max_model_len, block_size, self.num_checkpoint_slots)
        return CheckpointPolicy(sparse_every_blocks=every)


def cache_layout(config: EngineConfig, model_config: ModelConfig) -> CacheLayout:
    """The layout the engine gives ``model_config`` under ``config``; ValueError naming the setting for a context
    longer than the model's or a memory that holds fewer than two blocks."""
    positions = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > positions:
        raise ValueError(
            f"max_model_len {config.max_model_len} (--max-model-len) is longer than the {positions:,} positions "
            f"the model was trained for (max_position_embeddings in its config); use at most {positions}"
        )
    enable_caching = config.enable_prefix_caching and model_config.is_causal
    itemsize = DTYPE_ITEMSIZE[config.dtype]
    # Layers of one attention spec form a KV cache group; without the hybrid manager, one group of all.
    model_groups = model_config.kv_cache_groups(hybrid=not config.disable_hybrid_kv_cache_manager)
    groups = tuple(KVCacheGroupSpec(group.sliding_window) for group in model_groups)
    block_bytes = model_config.kv_bytes_per_block(config.block_size, itemsize, model_groups)
    memory = parse_memory(config.kv_cache_memory)
    # Recurrent layers: one working state a running request and the checkpoints, out of the same memory.
    state_slot_bytes = num_state_slots = num_checkpoint_slots = 0
    if model_config.state_layers:
        groups += (RECURRENT_STATE,)
        state_slot_bytes = model_config.state_bytes_per_slot(itemsize)
        num_state_slots = config.max_num_seqs
        if enable_caching:
            num_checkpoint_slots = int(memory * config.max_state_checkpoint_fraction) // state_slot_bytes
    state_bytes = (num_state_slots + num_checkpoint_slots) * state_slot_bytes
    num_blocks = config.num_blocks or max(0, memory - state_bytes) // block_bytes
    if num_blocks < 2:
        raise ValueError(_too_few_blocks(config, block_bytes, state_bytes))
    return CacheLayout(
        model_groups,
        groups,
        block_bytes,
        state_slot_bytes,
        num_blocks,
        num_state_slots,
        num_checkpoint_slots,
        config.max_model_len or positions,
        enable_caching,
    )


def _too_few_blocks(config: EngineConfig, block_bytes: int, state_bytes: int) -> str:
    """Why the KV cache cannot work, naming the setting the user gave: the exact count, or the memory budget (of
    which a model with recurrent layers first takes ``state_bytes`` for its states)."""
    if config.num_blocks is not None:
        return f"num_blocks {config.num_blocks} (--num-gpu-blocks-override) is fewer than the 2 KV blocks needed"
    return (
        f"kv_cache_memory {config.kv_cache_memory!r} (--kv-cache-memory) holds fewer than 2 KV blocks of "
        f"{block_bytes:,} bytes each"
        + (f" beside {state_bytes:,} bytes of recurrent states" if state_bytes else "")
        + "; raise it"
    )
