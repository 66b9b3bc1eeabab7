"""Tokenizers named by data.tokenizer: bytes, SmolLM2's BPE from its GGUF file, local directories."""

from __future__ import annotations

import pytest

from disttrain_ds.data.tokenizer import SMOLLM2_VOCAB, ByteTokenizer, load_tokenizer

TEXTS = [
    "A photo of a cat sitting on a red chair.",
    "Prices from 1999 to 2024: 12% off!",
    "héllo wörld — 日本語のテキスト",
    "  leading spaces\n\nand\ttabs  ",
]


def test_byte_tokenizer_round_trips_utf8_with_256_ids():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("smollm2")


def test_smollm2_has_vocab_49152_and_round_trips(smollm2):
    assert smollm2.vocab_size == SMOLLM2_VOCAB == 49152
    for text in TEXTS:
        ids = smollm2.encode(text)
        assert all(0 <= i < SMOLLM2_VOCAB for i in ids)
        assert smollm2.decode(ids) == text


def test_smollm2_applies_merges_and_splits_digits(smollm2):
    # Common words are single BPE tokens (GPT-2 byte-level 'Ġ' marks the leading space) ...
    assert smollm2.encode(" the") == [smollm2._tok.token_to_id("Ġthe")]
    assert len(smollm2.encode(TEXTS[0])) < len(TEXTS[0].encode()) / 2
    # ... while SmolLM2's pre-tokenizer keeps every digit its own token.
    assert smollm2.encode("2024") == [smollm2._tok.token_to_id(d) for d in "2024"]


def test_smollm2_control_tokens_stay_whole(smollm2):
    assert smollm2.encode("<|im_start|>") == [1]


def test_missing_tokenizer_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))
    msg = str(err.value)
    assert "data.tokenizer" in msg and "\n" not in msg


def test_local_tokenizer_directory_loads_offline_and_matches(tmp_path, smollm2):
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=smollm2._tok).save_pretrained(tmp_path)
    local = load_tokenizer(str(tmp_path))
    assert local.vocab_size == SMOLLM2_VOCAB
    for text in TEXTS:
        assert local.encode(text) == smollm2.encode(text)
