"""Latent generation targets through a frozen VAE (recipes/tiny_cpu_latent.yaml) train the
reference model in every layout, with the VAE in the data producers or on the generator's ranks."""

from __future__ import annotations

import pytest

from .conftest import launch, max_param_mismatch

RECIPE = "tiny_cpu_latent"
STEPS = "train.steps=3"
SGD = ["optim.name=sgd", "optim.lr=0.05"]
ON_GENERATOR = "model.generator.vae.placement=generator"
# A producer's first heartbeat can take longer than the default 20 s on a loaded 2-core host.
PRODUCERS = ["data.producers=1", "parallel.heartbeat_timeout_s=120"]
LAYOUTS = {
    # name: (ranks, overrides). data.producers=0 encodes in the trainer processes through the same
    # source wrapper a producer runs (cheap); PRODUCERS runs it in a producer process.
    "readme": (4, ["layout=disaggregated"]),
    "readme_producers": (4, ["layout=disaggregated", *PRODUCERS]),
    "gen_dp2": (5, ["layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.generator.dp=2"]),
    "gen_pp2": (4, ["layout=disaggregated", "parallel.llm.pp=1", "parallel.generator.pp=2"]),
    "monolithic_pp2": (4, ["layout=monolithic", *PRODUCERS]),
    # The VAE on the generator's first stage; its second stage draws the same noise without the latents.
    "gen_pp2_vae_on_generator": (4, ["layout=disaggregated", "parallel.llm.pp=1", "parallel.generator.pp=2",
                                     ON_GENERATOR]),
    "gen_dp2_vae_on_generator": (5, ["layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.pp=1",
                                     "parallel.generator.dp=2", ON_GENERATOR]),
}
CHEAP = {"readme"}


def _ref_overrides(overrides: list[str]) -> list[str]:
    """The reference encodes in-process with the VAE in the producer placement: the generator
    placement must give the same numbers."""
    keep = [o for o in overrides if not o.startswith(("layout=", "parallel.", "data.producers", ON_GENERATOR))]
    return keep + [STEPS, *SGD]


def _params(name: str):
    marks = () if name in CHEAP else (pytest.mark.slow,)
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.slow  # whole jobs; latent targets' unit tests stay in the default tier
@pytest.mark.parametrize("name", [_params(n) for n in LAYOUTS])
def test_latent_targets_train_the_reference_model(name, tmp_path, reference_run):
    nproc, overrides = LAYOUTS[name]
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, *overrides], recipe=RECIPE)
    ref_losses, ref_params = reference_run(_ref_overrides(overrides), RECIPE)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    assert all(r["loss/gen"] > 0 for r in rows)


@pytest.mark.slow
def test_another_vae_is_caught(tmp_path, reference_run):
    """Negative control: the same layout with a VAE of another scaling factor trains another model."""
    nproc, overrides = LAYOUTS["readme"]
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, *overrides, "model.generator.vae.scaling_factor=0.7"],
                             recipe=RECIPE)
    ref_losses, ref_params = reference_run(_ref_overrides(overrides), RECIPE)
    assert [r["loss"] for r in rows] != pytest.approx(ref_losses, rel=1e-5)
    gen = {k: v for k, v in params.items() if k.startswith("generator/")}
    assert max_param_mismatch(gen, {k: ref_params[k] for k in gen})[0] > 1e-5
