"""Runs one scheduled step on the model: builds the flat batch, runs the forward pass, samples.

The forward pass is the batch's: if it raises, the step fails. What follows it is per request
(prompt log-probabilities, sampling), and a failure there fails only that request (``errors``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from prefixcache.core.sub_block import CopyOp
from prefixcache.engine.sampler import Sampler
from prefixcache.engine.scheduler import ScheduledChunk, SchedulerOutput
from prefixcache.model import AttentionMetadata, DecoderForCausalLM, KVCacheGroup

if TYPE_CHECKING:
    from prefixcache.offload.worker import OffloadWorker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per request id: the sampled token and its log-probabilities, prompt log-probabilities, or an error."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class ModelRunner:
    """Owns the paged KV cache tensors and the sampler; knows nothing of scheduling or caching policy.

    ``kv_cache_groups`` (default: the mask-only single group) lay out the cache; each chunk brings one block
    table per group. ``offload`` (set when KV offload tiers are on) moves blocks between the cache tensors and
    the tiers around the forward pass.
    """

    def __init__(
        self,
        model: DecoderForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
        seed: int,
        kv_cache_groups: Sequence[KVCacheGroup] | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_cache_groups = tuple(kv_cache_groups or model.config.kv_cache_groups(hybrid=False))
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, dtype, self.device, self.kv_cache_groups)
        self.sampler = Sampler(seed, self.device, eos_token_ids)
        self.offload: OffloadWorker | None = None

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if self.offload is not None:
            self.offload.before_forward(step.offload)
        self._copy_blocks(step.copies)
        chunks = step.chunks
        token_ids: list[int] = []
        for chunk in chunks:
            token_ids.extend(chunk.request.all_token_ids[chunk.start : chunk.start + chunk.num_new_tokens])
        tables = [group_tables(c.block_ids, len(self.kv_cache_groups)) for c in chunks]
        starts, num_new = [c.start for c in chunks], [c.num_new_tokens for c in chunks]
        group_metadata = [
            AttentionMetadata.build(
                [t[g] for t in tables], starts, num_new, self.block_size, self.device, group.sliding_window
            )
            for g, group in enumerate(self.kv_cache_groups)
        ]
        metadata = group_metadata[0]  # the groups' token layout is the same: positions, rows of each request
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
            metadata.positions,
            self.kv_caches,
            group_metadata,
        )
        if self.offload is not None:
            self.offload.after_forward(step.offload)
        out = ModelRunnerOutput()
        sampling_rows, sampling = [], []
        starts = metadata.query_start_loc.tolist()
        for i, chunk in enumerate(chunks):
            request_id = chunk.request.request_id
            if chunk.request.sampling_params.prompt_logprobs is not None:
                try:
                    out.prompt_logprobs[request_id] = self._prompt_logprobs(hidden[starts[i] : starts[i + 1]], chunk)
                except Exception as exc:  # one request's failure is its own
                    logger.warning("prompt logprobs failed for request %s: %r", request_id, exc)
                    out.errors[request_id] = f"computing prompt logprobs failed: {exc}"
                    continue
            if chunk.samples:
                sampling_rows.append(i)
                sampling.append(chunk.request)
        if sampling:
            logits = self.model.compute_logits(hidden[metadata.last_token_indices[sampling_rows]])
            sampled = self.sampler.sample(logits, sampling)
            out.sampled, out.logprobs = sampled.token_ids, sampled.logprobs
            out.errors |= sampled.errors
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, chunk: ScheduledChunk) -> list[dict[int, float] | None]:
        """Log-probabilities of each next prompt token (and the top-k) at this chunk's positions."""
        request = chunk.request
        k = request.sampling_params.prompt_logprobs
        end = min(chunk.start + chunk.num_new_tokens, request.num_prompt_tokens - 1)
        count = end - chunk.start
        result: list[dict[int, float] | None] = [None] if chunk.start == 0 else []
        if count <= 0:
            return result
        logprobs = self.model.compute_logits(hidden[:count]).log_softmax(dim=-1)
        targets = torch.tensor(request.prompt_token_ids[chunk.start + 1 : end + 1], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top = logprobs.topk(k, dim=-1) if k else None
        for i, token in enumerate(targets.tolist()):
            entry = {token: chosen[i]}
            if top is not None:
                entry |= dict(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
            result.append(entry)
        return result

    def _copy_blocks(self, copies: list[CopyOp]) -> None:
        """Sub-block hits: the first tokens of a shared block into the request's own block, every layer."""
        for op in copies:
            for key_cache, value_cache in self.kv_caches:
                key_cache[op.dst, : op.num_tokens] = key_cache[op.src, : op.num_tokens]
                value_cache[op.dst, : op.num_tokens] = value_cache[op.src, : op.num_tokens]

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)


def group_tables(block_ids: Sequence[int] | Sequence[Sequence[int]], num_groups: int) -> Sequence[Sequence[int]]:
    """A chunk's block table per KV cache group: ``block_ids`` is one table per group, or (from a scheduler that
    knows one group) the single group's table."""
    if block_ids and not isinstance(block_ids[0], int):
        tables = cast("Sequence[Sequence[int]]", block_ids)
    else:
        tables = [cast("Sequence[int]", block_ids)]
    if len(tables) != num_groups:
        raise ValueError(f"a chunk has {len(tables)} block tables for {num_groups} KV cache groups")
    return tables
