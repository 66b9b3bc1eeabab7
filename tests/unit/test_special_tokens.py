"""A tokenizer's own special tokens are the model's: its end-of-text ends every document, the id it
puts before a text begins every document, its padding pads (unless it is also its end token); only
what it lacks is appended after its vocabulary, and an export says which is which."""

from __future__ import annotations

import json

import pytest

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producers import build_source
from disttrain_ds.data.tokenizer import load_tokenizer, own_specials, special_tokens
from disttrain_ds.samples import GenShape, ShapeSpec, SpecialTokens

WORDS = ["<unk>", "<s>", "</s>", "<pad>", "a", "red", "cat", "on", "the", "mat"]


def _tokenizer_dir(tmp_path, *, begins: bool = True, pad: str | None = None, name: str = "tok"):
    """A Llama-style tokenizer directory: ``<s>`` put before every text (when ``begins``), ``</s>`` its end."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if begins:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    extra = {"pad_token": pad} if pad else {}
    path = tmp_path / name
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            **extra).save_pretrained(str(path))
    load_tokenizer.cache_clear()
    return path


def test_without_own_tokens_the_ids_follow_the_vocabulary_as_before():
    s = SpecialTokens.after(256)
    assert (s.pad, s.image, s.boi, s.eoi, s.gen, s.eod, s.bos, s.own) == (256, 257, 258, 259, 260, 261, -1, ())
    assert special_tokens(load_tokenizer("byte")) == s


def test_own_end_and_begin_are_taken_and_only_the_rest_appended():
    s = SpecialTokens.after(100, own={"eod": 2, "bos": 1})
    assert (s.eod, s.bos, s.own) == (2, 1, ("eod", "bos"))
    assert sorted((s.pad, s.image, s.boi, s.eoi, s.gen)) == [100, 101, 102, 103, 104]
    assert s.vocab_size == 105


def test_a_padding_id_that_is_also_the_end_token_is_not_taken():
    s = SpecialTokens.after(100, own={"eod": 2, "pad": 2})
    assert s.eod == 2 and s.pad >= 100 and s.own == ("eod",)
    assert SpecialTokens.after(100, own={"eod": 2, "pad": 3}).pad == 3


def test_an_own_id_outside_the_vocabulary_is_one_line():
    with pytest.raises(ValueError, match="eod id 100 is outside its vocabulary of 100"):
        SpecialTokens.after(100, own={"eod": 100})


def test_a_llama_style_tokenizer_gives_its_end_and_begin_ids(tmp_path):
    tok = load_tokenizer(str(_tokenizer_dir(tmp_path)))
    assert tok.specials == {"eod": 2, "bos": 1}
    # Negative control: a tokenizer that puts nothing before a text (Qwen2) has no begin id.
    plain = load_tokenizer(str(_tokenizer_dir(tmp_path, begins=False, pad="<pad>", name="plain")))
    assert plain.specials == {"eod": 2, "pad": 3}
    from transformers import AutoTokenizer

    assert own_specials(AutoTokenizer.from_pretrained(str(tmp_path / "plain"))) == {"eod": 2, "pad": 3}


def test_packed_documents_begin_and_end_with_the_tokenizers_own_ids(tmp_path):
    path = _tokenizer_dir(tmp_path)
    records = tmp_path / "pairs.jsonl"
    records.write_text("".join(json.dumps({"caption": c, "url": f"http://example.com/{i}.jpg"}) + "\n"
                               for i, c in enumerate(["a red cat", "the cat on the mat", "a mat", "red red cat"])))
    shape = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))
    cfg = DataConfig(source="laion", path=str(records), tokenizer=str(path), seq_len=64, image_sizes=[16])
    src = build_source(cfg, shape, 2, 0)
    special = src.special
    assert (special.eod, special.bos) == (2, 1) and special.vocab_size == len(WORDS) + 5  # no new end row
    for sample in src.global_batch(0):
        ids, start = sample.input_ids.tolist(), 0
        for n in sample.doc_lens:
            doc = ids[start:start + n]
            assert doc[0] == 1 and doc[-1] == 2, doc
            assert doc.count(1) == 1 and doc.count(2) == 1
            start += n


def test_an_export_says_which_ids_are_the_tokenizers_and_which_were_added(tmp_path):
    from disttrain_ds.checkpoint.export import export_tokenizer
    from disttrain_ds.estimate.memory import vocab_size
    from disttrain_ds.recipe.schema import load_recipe

    recipe = load_recipe("tiny_cpu", [f"data.tokenizer={_tokenizer_dir(tmp_path)}"])
    out = tmp_path / "out"
    out.mkdir()
    export_tokenizer(recipe, out, vocab_size(recipe))
    info = json.loads((out / "tokens.json").read_text())
    assert info["from_tokenizer"] == {"eod": 2, "bos": 1}
    assert set(info["added"]) == {"pad", "image", "boi", "eoi", "gen"} and min(info["added"].values()) == len(WORDS)
    assert load_tokenizer(str(out)).specials == {"eod": 2, "bos": 1}  # the exported tokenizer reads back the same
