"""Checks that a ``PackedSample`` honours the contract in ``samples.py`` (for tests and debugging)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from disttrain_ds.data.source import labels_for
from disttrain_ds.samples import GenShape, PackedSample, SpecialTokens


def _runs(mask: torch.Tensor) -> list[int]:
    """Lengths of the runs of True in a 1-D bool tensor, in order."""
    out, n = [], 0
    for v in mask.tolist() + [False]:
        if v:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


def _starts(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def sample_problems(
    s: PackedSample, special: SpecialTokens, patch_size: int, seq_len: int, gens: Sequence[GenShape],
    max_seq_len: int = 0,
) -> list[str]:
    """Every way ``s`` breaks the contract; empty when it is valid. ``gens``: each generator's target
    shape (``ShapeSpec.gens``: its targets in ``gen_targets[k]``, its own query tokens);
    ``max_seq_len``: sequences may be any multiple of ``seq_len`` up to it (``data.max_seq_len``)."""
    bad: list[str] = []
    ids, labels = s.input_ids, s.labels
    n = int(ids.shape[0]) if ids.dim() == 1 else -1
    if (ids.dtype != torch.long or labels.dtype != torch.long or ids.dim() != 1 or labels.shape != ids.shape
            or n % seq_len or not seq_len <= n <= max(seq_len, max_seq_len)):
        want = f"[{seq_len}]" if max_seq_len <= seq_len else f"[k x {seq_len}] up to {max_seq_len}"
        return [f"input_ids/labels must be int64 {want}, got {tuple(ids.shape)} {ids.dtype} / {tuple(labels.shape)}"]
    if int(ids.min()) < 0 or int(ids.max()) >= special.vocab_size:
        bad.append("token id outside the vocabulary")
    patches = []
    for im in s.images:
        if im.dtype != torch.float32 or im.dim() != 3 or im.shape[0] != 3:
            bad.append(f"image must be float32 [3, H, W], got {tuple(im.shape)} {im.dtype}")
            continue
        if im.shape[1] % patch_size or im.shape[2] % patch_size:
            bad.append(f"image side {tuple(im.shape[1:])} is not a multiple of patch {patch_size}")
        if float(im.min()) < -1.0 or float(im.max()) > 1.0:
            bad.append("image pixels outside [-1, 1]")
        patches.append((im.shape[1] // patch_size) * (im.shape[2] // patch_size))
    if _runs(ids == special.image) != patches:
        bad.append(f"placeholder runs {_runs(ids == special.image)} do not match image patches {patches}")
    rows = []
    for c in s.audio:
        if c.dtype != torch.float32 or c.dim() != 2 or c.shape[1] % 2 or c.shape[1] == 0:
            bad.append(f"audio clip must be float32 [n_mels, even frames], got {tuple(c.shape)} {c.dtype}")
            continue
        rows.append(c.shape[1] // 2)
    if _runs(ids == special.audio) != rows:
        bad.append(f"audio placeholder runs {_runs(ids == special.audio)} do not match clip rows {rows}")
    if len(s.gen_targets) > len(gens):
        bad.append(f"{len(s.gen_targets)} gen_targets entries for {len(gens)} generators")
    for k, (res, q) in enumerate((g.resolution, g.query_tokens) for g in gens):
        name = f"gen_targets[{k}]"
        gens = _runs(ids == special.query(k))
        g = s.targets(k)
        if g is None:
            g = torch.zeros(0, 1, res, res)
        if g.dim() != 4 or g.shape[0] != len(gens) or g.shape[-1] != res or g.shape[-2] != res:
            bad.append(f"{name} {tuple(g.shape)} do not match {len(gens)} query runs at resolution {res}")
        if any(n != q for n in gens):
            bad.append(f"generation query runs {gens} are not {q} long")
        if g.numel() and (float(g.min()) < -1.0 or float(g.max()) > 1.0):
            bad.append(f"{name} outside [-1, 1]")
    if not torch.equal(labels, labels_for(ids, special, s.doc_lens)):
        bad.append("labels are not the next text/marker token of the same document, with placeholders, queries, "
                   "padding and each document's last position ignored")
    used = int((ids != special.pad).sum())
    if not s.doc_lens or any(n <= 0 for n in s.doc_lens):
        bad.append(f"doc_lens {tuple(s.doc_lens)} must list each document's positive length")
    elif sum(s.doc_lens) != used:
        bad.append(f"doc_lens sum {sum(s.doc_lens)} != {used} non-padding tokens")
    else:
        docs = s.doc_ids()
        for lo, hi in zip(_starts(ids == special.boi), _starts(ids == special.eoi)):
            if docs[lo] != docs[hi]:
                bad.append(f"the image at positions {lo}..{hi} straddles two documents")
    if used and bool((ids[:used] == special.pad).any()):
        bad.append("padding inside the sequence (it must only trail)")
    return bad
