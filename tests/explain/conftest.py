"""Factories for explain tests: prompts as token ids (exact positions) or as text through the tiny tokenizer."""

import pytest

from prefixcache.explain.log import Prompt
from tests.helpers import build_tokenizer


def prompts_of(token_lists, salts=None) -> list[Prompt]:
    salts = salts or [None] * len(token_lists)
    return [
        Prompt(line, list(tokens), salt)
        for line, (tokens, salt) in enumerate(zip(token_lists, salts, strict=True), start=1)
    ]


def decode_ids(ids) -> str:
    """Token ids shown as themselves, for tests on token-id prompts."""
    return " ".join(str(t) for t in ids)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()
