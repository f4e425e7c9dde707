"""Turns the last-position logits of each sampling request into its next token."""

from __future__ import annotations

import torch

from prefixcache.engine.sampling_params import SamplingParams


class Sampler:
    """Greedy rows are one batched argmax; the rest apply temperature, top-k and top-p, then draw.

    A request with a ``seed`` draws from its own generator, so its tokens do not depend on what else
    is in the batch.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        tokens = logits.argmax(dim=-1)
        for row, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            if not p.greedy:
                tokens[row] = self._draw(logits[row], p, self._generator_for(request_id, p))
        return tokens.tolist()

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def _generator_for(self, request_id: str, p: SamplingParams) -> torch.Generator:
        if p.seed is None:
            return self.generator
        generator = self.request_generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(p.seed)
            self.request_generators[request_id] = generator
        return generator

    @staticmethod
    def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        logits = logits.float() / p.temperature
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative - sorted_logits.softmax(dim=-1) >= p.top_p  # keep the smallest set reaching top_p
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[0]
