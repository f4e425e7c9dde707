"""The offline API, shaped like vLLM's ``LLM`` so users can switch with few changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from prefixcache.config import EngineConfig
from prefixcache.engine.llm_engine import EngineStats, LLMEngine, PromptInput
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.model import LoadedModel

Messages = list[dict[str, Any]]


class LLM:
    """Generate for a list of prompts, batching them all through one engine.

    ``LLM(model=None)`` loads the default model, SmolLM2-135M-Instruct. Keyword arguments are the
    fields of :class:`~prefixcache.config.EngineConfig`; ``loaded`` reuses weights already in memory
    (benchmarks build several engines on one model).
    """

    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), loaded)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Every prompt is validated before any runs."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        request_ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_ids.append(self.engine.add_request(prompt, p, cache_salt=cache_salt))
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"prompt": None, "prompt_token_ids": self.apply_chat_template(c, add_generation_prompt)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        return self.engine.apply_chat_template(messages, add_generation_prompt)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in request_ids]
