"""The input processor's chat prompts on a model with recurrent layers: each message's end goes to the core as a
checkpoint hint (where the tiny template puts it), beside the ``cache_control`` breakpoints; other models get
none. Hints given with token ids move with a truncation and are refused where they are not prompt positions."""

from __future__ import annotations

import msgspec
import pytest

from prefixcache.core import FULL_ATTENTION
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.engine import SamplingParams
from prefixcache.engine.chat_breakpoints import Breakpoint, chat_token_ids
from prefixcache.engine.input_processor import InputProcessor
from prefixcache.engine.messages import EngineInfo
from tests.helpers import CORPUS, build_tokenizer

ATTENTION_ONLY = EngineInfo("tiny", 512, 512, 16, 64, "sha256", "prefixcache", True, 1024)
RECURRENT = EngineInfo(
    "tiny", 512, 512, 16, 64, "sha256", "prefixcache", True, 1024, kv_cache_groups=(FULL_ATTENTION, RECURRENT_STATE)
)
CONVERSATION = [
    {"role": "system", "content": " ".join(CORPUS)},
    {"role": "user", "content": CORPUS[1]},
    {"role": "assistant", "content": CORPUS[3]},
    {"role": "user", "content": CORPUS[0]},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def message_ends(tokenizer) -> list[int]:
    """The tiny template renders a conversation cut after a message as the prompt's start."""
    return [len(chat_token_ids(tokenizer, CONVERSATION[:i], False)) for i in range(1, len(CONVERSATION) + 1)]


def test_a_recurrent_model_gets_each_message_end_as_a_hint_beside_the_breakpoints(tokenizer):
    processor = InputProcessor(tokenizer, RECURRENT)
    prompt, [position] = processor.chat_prompt(CONVERSATION, breakpoints=[Breakpoint("message", 1)])
    ends = message_ends(tokenizer)
    assert prompt == {
        "prompt": None,
        "prompt_token_ids": chat_token_ids(tokenizer, CONVERSATION),
        "checkpoint_hints": ends,
    }
    assert position == ends[1] and ends == sorted(ends) and ends[-1] < len(prompt["prompt_token_ids"])
    request, _ = processor.process(prompt, SamplingParams(max_tokens=4), "a")
    assert request.checkpoint_hints == tuple(ends)


@pytest.mark.parametrize(
    "info", [ATTENTION_ONLY, msgspec.structs.replace(RECURRENT, enable_prefix_caching=False)], ids=["attention", "off"]
)
def test_no_hints_where_nothing_checkpoints_state(tokenizer, info):
    prompt, positions = InputProcessor(tokenizer, info).chat_prompt(CONVERSATION)
    assert prompt == {"prompt": None, "prompt_token_ids": chat_token_ids(tokenizer, CONVERSATION)} and positions == []
    assert InputProcessor(tokenizer, info).process(prompt, SamplingParams(), "a")[0].checkpoint_hints == ()


def test_hints_move_with_a_truncation_and_bad_ones_are_refused(tokenizer):
    processor = InputProcessor(tokenizer, RECURRENT)
    prompt = {"prompt_token_ids": list(range(10, 50)), "checkpoint_hints": [5, 16, 40]}
    kept, _ = processor.process(prompt, SamplingParams(max_tokens=4, truncate_prompt_tokens=30), "a")
    assert kept.prompt_token_ids == list(range(20, 50)) and kept.checkpoint_hints == (6, 30)
    for hints in ([0], [41], [True], "16"):
        with pytest.raises(ValueError, match=r"checkpoint_hints must be a list of prompt positions in 1 \.\. 40"):
            processor.process({**prompt, "checkpoint_hints": hints}, SamplingParams(), "b")
    with pytest.raises(ValueError, match="send them with prompt_token_ids"):
        processor.process({"prompt": "The quick", "checkpoint_hints": [1]}, SamplingParams(), "c")
