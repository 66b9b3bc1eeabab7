"""Where sequence-sharded, overlapped tensor parallelism (``parallel.<module>.tp_overlap``) applies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from disttrain_ds.recipe.graph import graph_of, module_parallel, parallel_key

if TYPE_CHECKING:
    from disttrain_ds.recipe.schema import Recipe


def _blocker(r: Recipe, name: str, tp: int) -> str | None:
    """Why the sharded path cannot serve module ``name`` at TP degree ``tp``, or None."""
    mp = module_parallel(r, name)
    if name != graph_of(r).llm:
        return "only the LLM has a sequence-sharded tensor-parallel path"
    if mp.sp != 1:
        return f"does not combine with sequence parallelism (sp={mp.sp})"
    if r.data.seq_len % tp:
        return f"data.seq_len {r.data.seq_len} must be divisible by tp {tp}"
    if r.data.seq_len // tp < mp.tp_overlap_chunks:
        return (f"{mp.tp_overlap_chunks} tp_overlap_chunks exceed the {r.data.seq_len // tp} positions "
                f"of each rank's slice (data.seq_len / tp)")
    return None


def tp_overlap_problem(r: Recipe, name: str) -> tuple[str, str] | None:
    """(key, why) if module ``name``'s ``tp_overlap`` settings are invalid, else None."""
    mp, key = module_parallel(r, name), parallel_key(r, name)
    if mp.tp_overlap not in (True, False, "auto"):
        return f"{key}.tp_overlap", f"must be true, false or auto, got {mp.tp_overlap!r}"
    if not isinstance(mp.tp_overlap_chunks, int) or isinstance(mp.tp_overlap_chunks, bool) or mp.tp_overlap_chunks < 1:
        return f"{key}.tp_overlap_chunks", f"must be an integer >= 1, got {mp.tp_overlap_chunks!r}"
    if mp.tp_overlap is True and mp.tp > 1 and r.layout != "reference":
        why = _blocker(r, name, mp.tp)
        if why:
            return f"{key}.tp_overlap", why
    return None


def tp_overlap_at(r: Recipe, name: str, tp: int, cuda: bool) -> bool:
    """Whether module ``name`` at TP degree ``tp`` runs on sequence slices with overlapped collectives
    (``auto``: on CUDA where it applies); what the profiler times at degrees the recipe does not set."""
    mp = module_parallel(r, name)
    if tp == 1 or mp.tp_overlap is False or (mp.tp_overlap == "auto" and not cuda):
        return False
    return _blocker(r, name, tp) is None


def tp_overlap_on(r: Recipe, name: str, cuda: bool) -> bool:
    """Whether this job runs module ``name`` on sequence slices (the reference layout has no TP)."""
    return r.layout != "reference" and tp_overlap_at(r, name, module_parallel(r, name).tp, cuda)
