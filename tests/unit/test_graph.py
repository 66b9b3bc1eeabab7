"""The module graph: roles, order, edges, critical path and stage offsets (pure)."""

import pytest

from disttrain_ds.errors import ConfigError
from disttrain_ds.graph import ModuleGraph


def test_default_graph_is_the_three_module_chain():
    g = ModuleGraph.default()
    assert g.names == ("encoder", "llm", "generator")
    assert g.edges == (("encoder", "llm"), ("llm", "generator"))
    assert g.upstream("llm") == ("encoder",) and g.downstream("llm") == ("generator",)


def test_modules_are_ordered_by_role_then_recipe_order():
    g = ModuleGraph.from_roles({"gen": "generator", "audio": "encoder", "lm": "llm", "vision": "encoder"})
    assert g.names == ("audio", "vision", "lm", "gen")
    assert g.encoders == ("audio", "vision") and g.llm == "lm" and g.generators == ("gen",)
    assert g.upstream("lm") == ("audio", "vision")


def test_understanding_only_and_generation_only_graphs():
    vlm = ModuleGraph.from_roles({"vision": "encoder", "llm": "llm"})
    assert vlm.generators == () and vlm.downstream("llm") == ()
    t2i = ModuleGraph.from_roles({"llm": "llm", "unet": "generator"})
    assert t2i.encoders == () and t2i.upstream("llm") == ()


@pytest.mark.parametrize("roles, needle", [
    ({"a": "encoder"}, "exactly one module with role llm"),
    ({"a": "llm", "b": "llm", "c": "encoder"}, "exactly one module with role llm, got 2 (a, b)"),
    ({"llm": "llm"}, "at least one encoder or generator"),
    ({"llm": "llm", "x": "decoder"}, "'model.modules.x.role' must be one of encoder | llm | generator"),
    ({"llm": "llm", "Vision": "encoder"}, "module name 'Vision'"),
    ({"llm": "llm", "a/b": "encoder"}, "module name 'a/b'"),
])
def test_bad_graphs_are_one_line_errors(roles, needle):
    with pytest.raises(ConfigError, match="^r.yaml: ") as e:
        ModuleGraph.from_roles(roles, src="r.yaml")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_critical_path_takes_the_slowest_encoder_and_generator():
    g = ModuleGraph.from_roles({"a": "encoder", "b": "encoder", "llm": "llm", "g1": "generator", "g2": "generator"})
    assert g.critical_path({"a": 1.0, "b": 3.0, "llm": 10.0, "g1": 5.0, "g2": 2.0}) == 18.0
    three = ModuleGraph.default()
    w = {"encoder": 0.1, "llm": 0.7, "generator": 0.2}
    assert three.critical_path(w) == w["llm"] + (w["encoder"] + w["generator"])  # same float order


def test_stage_offsets_align_encoders_before_and_generators_after_the_llm():
    g = ModuleGraph.from_roles({"a": "encoder", "b": "encoder", "llm": "llm", "g1": "generator", "g2": "generator"})
    offsets, total = g.stage_offsets({"a": 2, "b": 1, "llm": 3, "g1": 1, "g2": 2})
    assert offsets == {"a": 0, "b": 1, "llm": 2, "g1": 5, "g2": 5}
    assert total == 2 + 3 + 2
    offsets, total = ModuleGraph.default().stage_offsets({"encoder": 1, "llm": 2, "generator": 1})
    assert offsets == {"encoder": 0, "llm": 1, "generator": 3} and total == 4
