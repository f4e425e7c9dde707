"""The inference engine: scheduler, model runner, sampler and the offline ``LLM`` API."""

from prefixcache.engine.llm import LLM
from prefixcache.engine.llm_engine import EngineStats, LLMEngine
from prefixcache.engine.outputs import CompletionOutput, RequestOutput
from prefixcache.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
