"""Prompts to token ids exactly as the engine tokenizes them; torch-free, so tools like ``explain`` share it.

Text is encoded without special tokens (a completion prompt is taken as written); a conversation goes
through the model's own chat template.
"""

from __future__ import annotations

from typing import Any


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """The conversation as prompt token ids; ValueError when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def token_texts(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each token decoded on its own: joined, any span reads as text (a character split across tokens
    shows as a replacement character)."""
    return [tokenizer.decode([token_id]) for token_id in token_ids]
