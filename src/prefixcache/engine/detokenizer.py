"""Incremental detokenization: each step decodes a few tokens, not the whole output again."""

from __future__ import annotations

from collections.abc import Callable
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

    A Hugging Face fast tokenizer is decoded through its Rust ``tokenizers`` object directly (what its
    ``decode`` does, without the Python layers around it: a fifth of the cost); any other through ``decode``.
    """

    tokenizer: Any
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prefix_offset: int = 0
    read_offset: int = 0
    _special_texts: dict[int, str] | None = field(default=None, init=False)
    _decode: Callable[[list[int]], str] = field(init=False)
    _prefix_text: str | None = field(default=None, init=False)  # the decoded window prefix_offset:read_offset

    def __post_init__(self) -> None:
        self._decode = _text_decoder(self.tokenizer, self.skip_special_tokens)
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
                self._prefix_text = None
                text += self._special_texts[token]
            else:
                text += self._decode_window(token_ids[:end], final and end == len(token_ids))
        return text

    def _decode_window(self, token_ids: list[int], final: bool) -> str:
        prefix = self._prefix_text
        if prefix is None:  # the window moved since the last call
            prefix = self._prefix_text = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self._prefix_text = None
        return full[len(prefix) :]


def _text_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=...)``: the Rust tokenizer's own ``decode`` where the
    tokenizer is a transformers fast tokenizer whose ``decode`` is transformers' own (not a subclass's), with
    transformers' clean-up of tokenization spaces after it where that would apply it; ``decode`` otherwise."""

    def generic(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    cleanup = _fast_tokenizer_cleanup(tokenizer)
    if cleanup is None:
        return generic
    backend_decode = tokenizer.backend_tokenizer.decode
    if not cleanup:

        def fast(token_ids: list[int]) -> str:
            return backend_decode(token_ids, skip_special_tokens=skip_special_tokens)

        return fast
    clean_up = tokenizer.clean_up_tokenization

    def fast_cleaned(token_ids: list[int]) -> str:
        return clean_up(backend_decode(token_ids, skip_special_tokens=skip_special_tokens))

    return fast_cleaned


def _fast_tokenizer_cleanup(tokenizer: Any) -> bool | None:
    """Whether ``tokenizer.decode`` (with no ``clean_up_tokenization_spaces`` passed) cleans up the Rust
    tokenizer's text; None where ``decode`` is not transformers' fast-tokenizer decode, so not known to be the
    Rust tokenizer's."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    try:  # transformers 5: a BPE tokenizer is never cleaned up unless told it may be corrupted
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast

        bpe_exempt = True
    except ImportError:  # transformers 4: cleaned up whenever clean_up_tokenization_spaces is set
        from transformers.tokenization_utils_fast import PreTrainedTokenizerFast as Fast

        bpe_exempt = False
    cls = type(tokenizer)
    if not isinstance(tokenizer, Fast) or cls.decode is not PreTrainedTokenizerBase.decode:
        return None
    if cls._decode is not Fast._decode or "decode" in vars(tokenizer) or "_decode" in vars(tokenizer):
        return None
    if not tokenizer.clean_up_tokenization_spaces:
        return False
    backend = tokenizer.backend_tokenizer
    if bpe_exempt and type(backend.model).__name__ == "BPE":
        return bool(
            getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        )
    return True
