"""Where tensor parallelism on sequence slices with overlapped collectives
(``parallel.<module>.tp_overlap``) applies: rules on plain values, read from a recipe by
``recipe/checks.py`` (what ``true`` may ask for) and ``recipe/graph.py::sliced_tp_chunks`` (what runs)."""

from __future__ import annotations


def tp_overlap_blocker(family: str, sliced: bool, sp: int | str, tp: int, chunks: int, seq_len: int | None = None,
                       image_tokens: int | None = None) -> str | None:
    """Why a module of ``family`` (``sliced``: its blocks have a path on slices) cannot run on
    sequence slices at TP degree ``tp``, or None. The LLM's rows are ``seq_len`` long and must split;
    a generator's ``image_tokens`` tokens per image (``Family.image_tokens``) must split; an encoder's packed rows
    are padded to a multiple of ``tp`` per microbatch, and a microbatch with fewer rows per slice
    than ``chunks`` runs in fewer pieces."""
    if not sliced:
        return f"the {family} family has no sequence-sharded tensor-parallel path"
    if sp != 1:
        return f"does not combine with sequence parallelism (sp={sp})"
    if image_tokens is not None and image_tokens % tp:
        return f"tp {tp} must divide the {image_tokens} tokens of a generated image in its transformer blocks"
    if seq_len is None:
        return None
    if seq_len % tp:
        return f"data.seq_len {seq_len} must be divisible by tp {tp}"
    if seq_len // tp < chunks:
        return f"{chunks} tp_overlap_chunks exceed the {seq_len // tp} positions of each rank's slice (data.seq_len / tp)"
    return None


def tp_overlap_wanted(setting: bool | str, tp: int, cuda: bool) -> bool:
    """Whether ``tp_overlap: setting`` asks for slices at TP degree ``tp`` (auto: on CUDA)."""
    return tp > 1 and (setting is True or (setting == "auto" and cuda))
