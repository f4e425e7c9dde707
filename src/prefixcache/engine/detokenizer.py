"""Incremental detokenization: each step decodes a few tokens, not the whole output again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding a token alone can be wrong (leading-space markers, multi-byte characters split across
    tokens), so each delta is the difference between decoding a short window that ends at the new
    tokens and the same window without them. A delta ending in an incomplete character (U+FFFD) is
    held back until the next token completes it, or until ``final``.

    ``skip_special_tokens`` (vLLM's default) leaves special tokens out of the text. With it off and
    ``spaces_between_special_tokens`` off, a special token that follows a special token adds exactly its own
    text, without the space a tokenizer's decoder may put before it (vLLM's rule).
    """

    tokenizer: Any
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prefix_offset: int = 0
    read_offset: int = 0
    _special_texts: dict[int, str] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.skip_special_tokens and not self.spaces_between_special_tokens:
            decoder = getattr(self.tokenizer, "added_tokens_decoder", {})
            self._special_texts = {token_id: str(token) for token_id, token in decoder.items()}

    def decode_new(self, token_ids: list[int], final: bool = False) -> str:
        if self._special_texts is None:
            return self._decode_window(token_ids, final)
        text = ""
        for end in range(self.read_offset + 1, len(token_ids) + 1):  # token by token, to see each neighbour
            previous, token = token_ids[end - 2] if end > 1 else None, token_ids[end - 1]
            if token in self._special_texts and previous in self._special_texts and self.read_offset == end - 1:
                self.prefix_offset, self.read_offset = self.read_offset, end
                text += self._special_texts[token]
            else:
                text += self._decode_window(token_ids[:end], final and end == len(token_ids))
        return text

    def _decode_window(self, token_ids: list[int], final: bool) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = decode(token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return full[len(prefix) :]
