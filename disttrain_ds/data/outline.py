"""A sample's outline: its counts and shapes as plain values, and a stand-in rebuilt from them.

When each host reads only its own samples (``data.read: host``), the logging rank still reports
figures over the whole global batch (tokens, batch size in bytes, MFU, DP balance). Each sample's
reader sends it a few numbers instead of the sample (``outline``), and ``stand_in`` rebuilds a
``PackedSample`` with the same token counts, document lengths and tensor shapes: its image, audio
and target tensors are zero-strided views that hold no memory, so no pixel crosses hosts.
"""

from __future__ import annotations

import torch

from disttrain_ds.samples import IGNORE_INDEX, PackedSample, SpecialTokens


def _placeholders(special: SpecialTokens) -> tuple[int, ...]:
    return tuple(t for t in (special.image, special.gen, special.audio, special.pad) if t >= 0)


def outline(s: PackedSample, special: SpecialTokens) -> dict:
    """Plain counts and shapes of ``s`` (what ``stand_in`` needs)."""
    return {
        "sample_id": s.sample_id, "seq_len": int(s.input_ids.shape[0]), "doc_lens": tuple(s.doc_lens),
        "ids": {t: int((s.input_ids == t).sum()) for t in _placeholders(special)},
        "labelled": int((s.labels != IGNORE_INDEX).sum()),
        "images": [tuple(im.shape) for im in s.images], "audio": [tuple(c.shape) for c in s.audio],
        "gen": [tuple(t.shape) for t in s.gen_targets],
    }


def _hollow(shape: tuple[int, ...], value: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    return torch.full((), value, dtype=dtype).expand(*shape)


def stand_in(o: dict, special: SpecialTokens) -> PackedSample:
    """A sample with ``o``'s counts and shapes: text positions first (id 0), then each placeholder
    run, then padding; no pixels. Only for figures, never for training."""
    runs = [(t, n) for t, n in o["ids"].items()]
    text = o["seq_len"] - sum(n for _, n in runs)
    ids = torch.cat([torch.zeros(text, dtype=torch.long)] + [torch.full((n,), t, dtype=torch.long) for t, n in runs])
    return PackedSample(
        ids, _hollow((o["seq_len"],), IGNORE_INDEX, torch.long), [_hollow(sh) for sh in o["images"]],
        [_hollow(sh) for sh in o["gen"]], o["sample_id"], tuple(o["doc_lens"]), {"stand_in": True},
        [_hollow(sh) for sh in o["audio"]],
    )


def fill_in(samples: list, outlines, special: SpecialTokens) -> list:
    """``samples`` with every position this host did not read (None) replaced by the stand-in of
    its outline; ``outlines``: (position, outline) pairs gathered from the ranks that read them."""
    view = list(samples)
    for p, o in outlines:
        if view[p] is None:
            view[p] = stand_in(o, special)
    return view
