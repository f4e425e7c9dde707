"""vLLM's text options, on the API side of the engine: stop strings held off by ``min_tokens``, special tokens
kept or skipped (and spaced), ``truncate_prompt_tokens`` keeping the prompt's end."""

from __future__ import annotations

import pytest

from prefixcache.engine import SamplingParams
from prefixcache.engine.detokenizer import IncrementalDetokenizer
from prefixcache.engine.input_processor import InputProcessor, PromptOptions
from prefixcache.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineInfo
from prefixcache.engine.output_processor import OutputProcessor
from tests.helpers import build_tokenizer

INFO = EngineInfo("tiny", 32, 512, 4, 64, "sha256", "prefixcache", True, 256)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def generate_text(tokenizer, token_ids: list[int], params: SamplingParams) -> tuple[str, str | None, int]:
    """Feed ``token_ids`` one step at a time through an OutputProcessor: (text, finish reason, tokens taken)."""
    processor = OutputProcessor(tokenizer)
    processor.add_request(EngineCoreRequest("r", [5, 6], params), None)
    for taken, token in enumerate(token_ids, 1):
        [output], _ = processor.process_outputs([EngineCoreOutput("r", [token], 0)])
        if output.finished:
            return output.outputs[0].text, output.outputs[0].finish_reason, taken
    return output.outputs[0].text, None, len(token_ids)


def test_no_stop_string_ends_the_first_min_tokens(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick", add_special_tokens=False)
    first = next(i for i in range(1, len(ids)) if "quick" in tokenizer.decode(ids[:i]))
    text, reason, _ = generate_text(tokenizer, ids, SamplingParams(max_tokens=64, stop=("quick",)))
    assert (text, reason) == ("The ", "stop")
    held = SamplingParams(max_tokens=64, stop=("quick",), min_tokens=first)
    text, reason, taken = generate_text(tokenizer, ids, held)
    assert reason == "stop" and text == "The quick brown fox jumps over the lazy dog. The "
    assert taken == len(ids)


def test_special_tokens_are_skipped_unless_asked_for(tokenizer):
    ids = [*tokenizer.encode("fox", add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|end|>")]
    ids += tokenizer.encode(" dog", add_special_tokens=False)
    assert generate_text(tokenizer, ids, SamplingParams(max_tokens=64))[0] == "fox dog"
    kept = generate_text(tokenizer, ids, SamplingParams(max_tokens=64, skip_special_tokens=False))[0]
    assert kept == "fox<|end|> dog" == tokenizer.decode(ids, skip_special_tokens=False)


def wordpiece_tokenizer():
    """A tokenizer whose decoder puts a space between tokens, special ones included (as BERT's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.decoder = decoders.WordPiece()
    inner.train_from_iterator(["hello there world"] * 5, trainers.WordPieceTrainer(special_tokens=["[UNK]", "[A]"]))
    return PreTrainedTokenizerFast(tokenizer_object=inner, additional_special_tokens=["[A]", "[B]"])


def test_without_spaces_between_special_tokens_a_special_token_joins_the_one_before_it():
    tokenizer = wordpiece_tokenizer()
    ids = tokenizer.encode("hello [A] [B] [A] there", add_special_tokens=False)

    def decoded(spaces: bool) -> str:
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        return "".join(detokenizer.decode_new(ids[: i + 1]) for i in range(len(ids)))

    assert decoded(True) == "hello [A] [B] [A] there" == tokenizer.decode(ids)
    assert decoded(False) == "hello [A][B][A] there"


def test_truncate_prompt_tokens_keeps_the_last_tokens(tokenizer):
    processor = InputProcessor(tokenizer, INFO)
    prompt = list(range(10, 50))  # 40 tokens, beyond the 32-token context
    request, text = processor.process(prompt, SamplingParams(max_tokens=4, truncate_prompt_tokens=6), "a")
    assert request.prompt_token_ids == prompt[-6:] and text is None
    request, _ = processor.process(prompt, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1), "b")
    assert request.prompt_token_ids == prompt[-28:]  # the context (32) less max_tokens (4)
    short, text = processor.process("The quick", SamplingParams(max_tokens=4, truncate_prompt_tokens=20), "c")
    assert text == "The quick" and short.prompt_token_ids == tokenizer.encode("The quick", add_special_tokens=False)
    with pytest.raises(ValueError, match="context length"):
        processor.process(prompt, SamplingParams(max_tokens=4), "d")


def test_truncate_prompt_tokens_minus_one_keeps_what_fits_a_kv_cache_smaller_than_the_context(tokenizer):
    small_cache = EngineInfo("tiny", 32, 512, 4, 6, "sha256", "prefixcache", True, 20)  # 20 tokens, context 32
    processor = InputProcessor(tokenizer, small_cache)
    prompt = list(range(10, 50))
    request, _ = processor.process(prompt, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1), "a")
    assert request.prompt_token_ids == prompt[-16:]  # the KV cache (20) less max_tokens (4)
    with pytest.raises(ValueError, match="cannot fit the KV cache of 20 tokens"):
        processor.process(prompt[:17], SamplingParams(max_tokens=4), "b")


def test_a_prompt_only_request_takes_a_whole_context(tokenizer):
    """echo with max_tokens 0: the one token sampled after the prompt is never shown, so it needs no room."""
    processor = InputProcessor(tokenizer, INFO)
    prompt = list(range(10, 42))  # exactly the 32-token context
    request, _ = processor.process(prompt, SamplingParams(max_tokens=1), "a", options=PromptOptions(prompt_only=True))
    assert request.prompt_token_ids == prompt
    with pytest.raises(ValueError, match="context length"):
        processor.process(prompt, SamplingParams(max_tokens=1), "b")
    with pytest.raises(ValueError, match="context length"):
        processor.process([*prompt, 5], SamplingParams(max_tokens=1), "c", options=PromptOptions(prompt_only=True))


def test_a_text_prompt_gets_the_tokenizers_bos_unless_asked_not_to():
    bos_tokenizer = build_tokenizer(bos=True)
    processor = InputProcessor(bos_tokenizer, INFO)
    bare = bos_tokenizer.encode("The quick", add_special_tokens=False)
    bos = bos_tokenizer.bos_token_id
    assert processor.process("The quick", SamplingParams(), "a")[0].prompt_token_ids == [bos, *bare]
    assert processor.process({"prompt": "The quick"}, SamplingParams(), "b")[0].prompt_token_ids == [bos, *bare]
    unmarked = PromptOptions(add_special_tokens=False)
    assert processor.process("The quick", SamplingParams(), "c", options=unmarked)[0].prompt_token_ids == bare
    assert processor.process(bare, SamplingParams(), "d")[0].prompt_token_ids == bare  # token ids as they are
    # truncation keeps the text's end behind its BOS, as vLLM's left-truncating tokenizer does; given ids are cut
    cut = processor.process("The quick", SamplingParams(truncate_prompt_tokens=2), "e")[0].prompt_token_ids
    assert len(bare) > 1 and cut == [bos, bare[-1]]
    given = processor.process([bos, *bare], SamplingParams(truncate_prompt_tokens=2), "f")[0].prompt_token_ids
    assert given == bare[-2:]
    chat = processor.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.count(bos) == 1 and chat[0] == bos  # the template's own
    assert processor.apply_chat_template([{"role": "user", "content": "Hi"}], add_special_tokens=True) == [bos, *chat]


def test_the_stop_token_is_left_out_of_the_text_unless_asked_for(tokenizer):
    fox, dog = (tokenizer.encode(word, add_special_tokens=False) for word in ("fox", " dog"))
    stop = dog[0]
    processor = OutputProcessor(tokenizer)

    def text(params: SamplingParams, last: int, reason: str = "stop", stop_reason: int | None = None) -> str:
        processor.add_request(EngineCoreRequest("r", [5, 6], params), None)
        processor.process_outputs([EngineCoreOutput("r", fox, 0)])
        [output], _ = processor.process_outputs([EngineCoreOutput("r", [last], 0, reason, stop_reason)])
        assert output.outputs[0].token_ids == [*fox, last]
        return output.outputs[0].text

    assert text(SamplingParams(stop_token_ids=(stop,)), stop, stop_reason=stop) == "fox"
    kept = SamplingParams(stop_token_ids=(stop,), include_stop_str_in_output=True)
    assert text(kept, stop, stop_reason=stop) == "fox" + tokenizer.decode([stop])
    eos = tokenizer.eos_token_id
    assert text(SamplingParams(skip_special_tokens=False), eos) == "fox"  # EOS ended it: not text
    assert text(SamplingParams(skip_special_tokens=False), eos, "length") == "fox<|eos|>"
