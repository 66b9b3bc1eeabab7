"""Two generators fed by one LLM train the reference math under NCCL's rules.

``tiny_two_gen`` (vit -> LLM -> unet ``painter`` + dit ``sketcher``, different target sizes and
query lengths) runs disaggregated with the LLM's last stage fanning out over DP=2 to both generators
and matches its single-process reference in per-step losses, per-generator losses and final
parameters (fp32, SGD). Negative controls: the states of one generator's targets sent in the wrong
order, and one generator's gradient dropped, are both caught by the same comparison.
"""

from __future__ import annotations

import pytest

from .conftest import launch, max_param_mismatch
from .test_fidelity import SGD, STEPS

RECIPE = "tiny_two_gen"
GENS = ("painter", "sketcher")
FAN_OUT = ["parallel.modules.painter.dp=2", "parallel.modules.sketcher.dp=2", "train.micro_batch=2"]


def _run(tmp_path, reference_run, overrides: list[str], nproc: int, fault: str | None = None):
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, "layout=disaggregated", *overrides], fault=fault,
                             recipe=RECIPE)
    ref_losses, ref_params = reference_run([STEPS, *SGD, *overrides], RECIPE)
    return rows, params, ref_losses, ref_params


def _part(params: dict, module: str) -> dict:
    return {k: v for k, v in params.items() if k.startswith(f"{module}/")}


@pytest.mark.slow  # the default tier keeps a graph of its own generators: test_graphs.py
def test_llm_fanning_out_to_two_generators_matches_reference(tmp_path, reference_run):
    # vision 1 + LLM PP=2 + painter DP=2 + sketcher DP=2.
    rows, params, ref_losses, ref_params = _run(tmp_path, reference_run, FAN_OUT, 7)
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    assert {k.split("/")[0] for k in params} == {"vision", "llm", *GENS}
    for r in rows:
        assert r["loss/gen"] == pytest.approx(sum(r[f"loss/gen/{g}"] for g in GENS), rel=1e-9)
    assert all(any(r[f"loss/gen/{g}"] > 0 for r in rows) for g in GENS)  # both generators had targets
    last = rows[-1]
    assert all(last[f"perf/mfu/{m}"] > 0 and f"time/{m}_compute" in last for m in ("vision", "llm", *GENS))


@pytest.mark.slow
def test_one_generator_getting_another_targets_states_is_caught(tmp_path, reference_run):
    """Each sketcher target conditioned on another target's queries: the fidelity check (1e-5) fails
    on the sketcher's weights (the tiny DiT's conditioning moves them by a few 1e-5 in three steps)."""
    rows, params, ref_losses, ref_params = _run(tmp_path, reference_run, FAN_OUT, 7, fault="flip_rows_to_sketcher")
    assert rows[0]["loss"] != ref_losses[0]
    assert max_param_mismatch(_part(params, "sketcher"), _part(ref_params, "sketcher"))[0] > 2e-5
    assert max_param_mismatch(_part(params, "painter"), _part(ref_params, "painter"))[0] < 1e-5  # the other route is intact


@pytest.mark.slow
def test_one_generators_dropped_gradient_is_caught(tmp_path, reference_run):
    """The sketcher's own weights still match at first, but the LLM misses its gradient."""
    rows, params, ref_losses, ref_params = _run(tmp_path, reference_run, FAN_OUT, 7, fault="drop_grad_from_sketcher")
    assert max_param_mismatch(_part(params, "llm"), _part(ref_params, "llm"))[0] > 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("overrides, nproc", [
    # Two LLM replicas fan in to one painter replica; the painter has two stages, the sketcher one
    # (the sketcher's last stage is not the global last stage).
    (["parallel.modules.llm.dp=2", "parallel.modules.llm.pp=1", "parallel.modules.vision.dp=2",
      "parallel.modules.painter.pp=2"], 7),
    # Tensor parallelism in the LLM and the sketcher: TP index 0 sends and receives each boundary.
    (["parallel.modules.llm.tp=2", "parallel.modules.llm.pp=1", "parallel.modules.sketcher.tp=2"], 6),
    # The sketcher split over two stages, fed by the PP=2 LLM.
    (["parallel.modules.sketcher.pp=2"], 6),
])
def test_other_two_generator_layouts_match_reference(tmp_path, reference_run, overrides, nproc):
    rows, params, ref_losses, ref_params = _run(tmp_path, reference_run, overrides, nproc)
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"


def _named_pairs(root) -> str:
    """Local captioned pairs whose ``generate`` names the painter, the sketcher, or neither."""
    import json

    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    for i, rgb in enumerate([(255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 255, 0), (0, 255, 255)]):
        Image.new("RGB", (40, 30), rgb).save(root / "images" / f"{i}.png")
    marks = ["painter", "sketcher", False, "sketcher"]
    lines = [{"image": f"images/{i % 5}.png", "caption": f"square number {i}", "generate": marks[i % 4]}
             for i in range(16)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(root / "pairs.jsonl")


@pytest.mark.slow
def test_two_generators_on_local_records_naming_them_match_reference(tmp_path, reference_run):
    """Real records route each target to the generator they name, disaggregated as in the reference."""
    data = ["data.source=local", f"data.path={_named_pairs(tmp_path / 'data')}", "model.modules.sketcher.in_channels=3"]
    rows, params, ref_losses, ref_params = _run(tmp_path / "run", reference_run, data, 5)
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    assert all(any(r[f"loss/gen/{g}"] > 0 for r in rows) for g in GENS)  # both generators had targets
