"""Incremental detokenization: each step decodes a few tokens, not the whole output again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding a token alone can be wrong (leading-space markers, multi-byte characters split across
    tokens), so each delta is the difference between decoding a short window that ends at the new
    tokens and the same window without them. A delta ending in an incomplete character (U+FFFD) is
    held back until the next token completes it, or until ``final``.
    """

    tokenizer: Any
    prefix_offset: int = 0
    read_offset: int = 0

    def decode_new(self, token_ids: list[int], final: bool = False) -> str:
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(token_ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return full[len(prefix) :]
