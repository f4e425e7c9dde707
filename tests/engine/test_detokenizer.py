"""IncrementalDetokenizer: the same deltas as decoding each window with ``tokenizer.decode`` (what it did before it
called the Rust tokenizer directly), for byte-level BPE, SentencePiece-style (Metaspace, byte fallback) and
WordPiece tokenizers, special tokens skipped or kept (and spaced or not), clean-up of tokenization spaces on or off;
no U+FFFD mid-stream when a character's bytes span tokens; and a stream that equals the one-shot decode."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.detokenizer import IncrementalDetokenizer, _text_decoder
from tests.helpers import CORPUS, build_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefix caching: ünïcode ✓ and emoji 🙂 survive token splits.",
    "中文字符 and ÅÄÖ, 👍🏽 (a skin tone: two code points), tabs\tand\nnewlines  double  spaces.",
    "Don't stop , he said ' quoted ' isn't it ? yes !",
]


@dataclass(slots=True)
class ReferenceDetokenizer:
    """The detokenizer as it was, through ``tokenizer.decode``: the behaviour to keep."""

    tokenizer: Any
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prefix_offset: int = 0
    read_offset: int = 0
    _special_texts: dict[int, str] | None = None

    def __post_init__(self) -> None:
        if not self.skip_special_tokens and not self.spaces_between_special_tokens:
            decoder = getattr(self.tokenizer, "added_tokens_decoder", {})
            self._special_texts = {token_id: str(token) for token_id, token in decoder.items()}

    def decode_new(self, token_ids: list[int], final: bool = False) -> str:
        if self._special_texts is None:
            return self._decode_window(token_ids, final)
        text = ""
        for end in range(self.read_offset + 1, len(token_ids) + 1):
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


def byte_level_bpe():
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<plain>"])  # an added token that is not special
    return tokenizer


def metaspace_byte_fallback(**kwargs):
    """A SentencePiece-style BPE (Llama 2's, Mistral's decoder): ``▁`` for spaces, unknown characters as
    ``<0xNN>`` byte tokens, the leading space stripped from what it decodes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    inner.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    inner.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    inner.train_from_iterator(CORPUS * 4, trainer)
    data = json.loads(inner.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    inner = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, unk_token="<unk>", bos_token="<s>", eos_token="</s>", **kwargs
    )


def wordpiece(**kwargs):
    """A WordPiece tokenizer (BERT's): a space between tokens, special ones included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    inner.decoder = decoders.WordPiece(cleanup=False)  # transformers' clean-up, not the decoder's, when asked
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[A]", "[B]"])
    inner.train_from_iterator([*CORPUS, *TEXTS] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=inner, additional_special_tokens=["[A]", "[B]"], **kwargs)


TOKENIZERS = {
    "byte-level-bpe": byte_level_bpe,
    "metaspace": metaspace_byte_fallback,
    "metaspace-cleanup": lambda: metaspace_byte_fallback(clean_up_tokenization_spaces=True),  # BPE: not cleaned
    "metaspace-cleanup-forced": lambda: metaspace_byte_fallback(
        clean_up_tokenization_spaces=True, clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True
    ),
    "wordpiece": wordpiece,
    "wordpiece-cleanup": lambda: wordpiece(clean_up_tokenization_spaces=True),
}
_built: dict[str, Any] = {}


def tokenizer_named(name: str):
    if name not in _built:
        _built[name] = TOKENIZERS[name]()
    return _built[name]


def special_ids(tokenizer) -> list[int]:
    return sorted(tokenizer.added_tokens_decoder)


def stream(detokenizer, token_ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """The deltas of feeding ``token_ids`` a chunk at a time (one token each by default), then ``final``."""
    deltas, end = [], 0
    for size in chunks or [1] * len(token_ids):
        end = min(len(token_ids), end + size)
        deltas.append(detokenizer.decode_new(token_ids[:end]))
    if end < len(token_ids):
        deltas.append(detokenizer.decode_new(token_ids))
    deltas.append(detokenizer.decode_new(token_ids, final=True))
    return deltas


def assert_same_as_reference(tokenizer, token_ids, chunks=None, **options) -> list[str]:
    deltas = stream(IncrementalDetokenizer(tokenizer, **options), token_ids, chunks)
    assert deltas == stream(ReferenceDetokenizer(tokenizer, **options), token_ids, chunks)
    return deltas


OPTIONS = [
    {"skip_special_tokens": True},
    {"skip_special_tokens": False},
    {"skip_special_tokens": False, "spaces_between_special_tokens": False},
]


def with_special_tokens(tokenizer, text: str) -> list[int]:
    """The text's ids with each special (and added) token put in after the first word, and two at the end."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    specials = special_ids(tokenizer)
    return [*ids[:2], *specials, *ids[2:], specials[-1], specials[0]]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("options", OPTIONS, ids=["skip", "keep", "keep-unspaced"])
def test_the_deltas_are_the_references_token_by_token_and_in_chunks(name, options):
    tokenizer = tokenizer_named(name)
    for text in TEXTS:
        ids = with_special_tokens(tokenizer, text)
        assert_same_as_reference(tokenizer, ids, **options)
        assert_same_as_reference(tokenizer, ids, [3, 1, 5, 2] * len(ids), **options)


@pytest.mark.parametrize("name", ["byte-level-bpe", "metaspace"])
def test_a_character_split_across_tokens_shows_whole_never_as_a_replacement_character(name):
    tokenizer = tokenizer_named(name)
    text = TEXTS[1] + " " + TEXTS[2]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode(ids[: i + 1]) for i in range(len(ids)))  # some token ends mid-character
    deltas = assert_same_as_reference(tokenizer, ids)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == text == tokenizer.decode(ids)


def test_final_flushes_an_incomplete_character():
    tokenizer = tokenizer_named("byte-level-bpe")
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    cut = next(i for i in range(len(ids)) if tokenizer.decode(ids[: i + 1]).endswith("\ufffd"))
    detokenizer = IncrementalDetokenizer(tokenizer)
    held = "".join(detokenizer.decode_new(ids[: i + 1]) for i in range(cut + 1))
    assert held == tokenizer.decode(ids[:cut]) and "\ufffd" not in held
    assert held + detokenizer.decode_new(ids[: cut + 1], final=True) == tokenizer.decode(ids[: cut + 1])


def test_special_tokens_skipped_kept_and_unspaced():
    tokenizer = tokenizer_named("wordpiece")
    ids = tokenizer.encode("hello [A] [B] [A] fox", add_special_tokens=False)

    def text(**options):
        return "".join(stream(IncrementalDetokenizer(tokenizer, **options), ids))

    assert text() == "hello fox" == tokenizer.decode(ids, skip_special_tokens=True)
    assert text(skip_special_tokens=False) == "hello [A] [B] [A] fox" == tokenizer.decode(ids)
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == "hello [A][B][A] fox"


def test_clean_up_of_tokenization_spaces_follows_the_tokenizer():
    """transformers cleans up " ," and the like after decoding where asked (a BPE tokenizer only when told it
    may corrupt it); each window is decoded so, as before."""
    plain, cleaning = tokenizer_named("wordpiece"), tokenizer_named("wordpiece-cleanup")
    ids = plain.encode("stop , he said ?", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(plain), ids)) == "stop , he said ?"
    ids = cleaning.encode("stop , he said ?", add_special_tokens=False)
    cleaned = "".join(assert_same_as_reference(cleaning, ids))
    assert cleaned == "stop, he said?" == cleaning.decode(ids)
    assert _text_decoder(tokenizer_named("wordpiece-cleanup"), True).__name__ == "fast_cleaned"
    assert _text_decoder(tokenizer_named("metaspace-cleanup"), True).__name__ == "fast"
    assert _text_decoder(tokenizer_named("metaspace-cleanup-forced"), True).__name__ == "fast_cleaned"
    forced = tokenizer_named("metaspace-cleanup-forced")
    assert_same_as_reference(forced, forced.encode("stop , he said ?", add_special_tokens=False))


def test_a_tokenizer_with_its_own_decode_is_decoded_through_it():
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    base = tokenizer_named("byte-level-bpe")
    shouting = Shouting(tokenizer_object=base.backend_tokenizer, eos_token="<|eos|>")
    ids = shouting.encode("The quick fox", add_special_tokens=False)
    assert "".join(assert_same_as_reference(shouting, ids)) == "THE QUICK FOX"
    assert _text_decoder(shouting, True).__name__ == "generic"
    assert _text_decoder(base, True).__name__ == "fast"

    class Plain:  # not a transformers tokenizer at all
        def decode(self, token_ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i % 26) for i in token_ids)

    assert "".join(stream(IncrementalDetokenizer(Plain()), [0, 1, 2])) == "abc"


def random_ids(tokenizer):
    return st.lists(st.integers(0, len(tokenizer) - 1), max_size=40)


CHUNKS = st.lists(st.integers(1, 4), max_size=40)
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(data=st.data(), name=st.sampled_from(sorted(TOKENIZERS)), options=st.sampled_from(OPTIONS))
def test_random_tokens_in_random_chunks_give_the_references_deltas(data, name, options):
    tokenizer = tokenizer_named(name)
    ids = data.draw(random_ids(tokenizer))
    assert_same_as_reference(tokenizer, ids, data.draw(CHUNKS), **options)


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_streaming_random_tokens_equals_the_one_shot_decode(data, skip):
    tokenizer = tokenizer_named("byte-level-bpe")
    ids = data.draw(random_ids(tokenizer))
    deltas = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), ids, data.draw(CHUNKS))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


@PROPERTY
@given(text=st.text(max_size=60), name=st.sampled_from(["byte-level-bpe", "metaspace"]))
def test_streaming_any_text_gives_it_back_with_no_replacement_character_mid_stream(text, name):
    tokenizer = tokenizer_named(name)
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(ids)
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == expected
    if "\ufffd" not in expected:
        assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.slow
def test_smollm2s_tokenizer_streams_this_repositorys_readme_as_before():
    from pathlib import Path

    from transformers import AutoTokenizer

    from prefixcache.model.loader import default_gguf_path

    try:
        gguf = default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    text = (Path(__file__).parents[2] / "README.md").read_text()[:4000] + TEXTS[1] + TEXTS[2]
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids[100:100] = special_ids(tokenizer)[:3]
    assert _text_decoder(tokenizer, True).__name__ == "fast"
    for options in OPTIONS:
        deltas = assert_same_as_reference(tokenizer, ids, **options)
        if options["skip_special_tokens"]:
            assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
