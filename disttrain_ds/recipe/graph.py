"""A recipe's module graph: which modules it has, their sections, families and parallel degrees.

Two ways to write the model in a recipe:

- the three-module form (``model.encoder``, ``model.llm``, ``model.generator`` with
  ``parallel.encoder`` ...): a graph of three modules named after their roles;
- the graph form, ``model.modules: {name: section}`` and ``parallel.modules: {name: degrees}``:
  any names, each section's ``family`` decides its role (a ViT is an encoder, a Llama the LLM, a
  U-Net a generator), so one LLM with any number of encoders and generators, or none.

Both end in ``model.modules`` / ``parallel.modules`` holding every module, which is what the
rest of the system reads through ``graph_of``, ``module_config`` and ``module_parallel``. In the
graph form the three-module keys hold a role's module when it has exactly one, else None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disttrain_ds.configtools import from_dict, to_dict
from disttrain_ds.errors import ConfigError
from disttrain_ds.families import DEFAULT_FAMILY, FAMILIES, Family, get_family
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.recipe.checkpoint_settings import checkpoint_fields
from disttrain_ds.recipe.tp_overlap import tp_overlap_blocker, tp_overlap_wanted
from disttrain_ds.topology import Topology

if TYPE_CHECKING:  # annotations only: config imports this module
    from disttrain_ds.recipe.schema import Recipe

ROLE_KEYS = tuple(DEFAULT_FAMILY)
"""The three-module form's section names (one per role)."""


def raw_module_sections(data: dict, src: str) -> dict[str, dict] | None:
    """A graph-form recipe's ``model.modules`` sections as written (raw data, each a mapping), or
    None for a three-module recipe; a one-line ConfigError for anything else."""
    model = data.get("model")
    if not isinstance(model, dict) or "modules" not in model:
        return None
    sections = model["modules"]
    if not isinstance(sections, dict) or not sections:
        raise ConfigError(f"{src}: 'model.modules' must be a mapping of module names to sections")
    for name, section in sections.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{src}: 'model.modules.{name}' must be a mapping")
    return sections


def raw_module_family(sections: dict[str, dict], name: str, src: str) -> Family:
    """The family a raw ``model.modules.<name>`` section names (one line if it names none)."""
    return family_named(sections[name].get("family"), src, f"model.modules.{name}.family")


def expand_graph_sections(data: dict, src: str) -> dict:
    """Parse ``model.modules`` sections with their families' config types (presets expanded);
    refuse the three-module keys beside them. Raw data in, raw data with parsed sections out."""
    sections = raw_module_sections(data, src)
    if sections is None:
        return data
    model = data["model"]
    parallel = data.get("parallel") if isinstance(data.get("parallel"), dict) else {}
    for where, keys in (("model", model), ("parallel", parallel)):
        for key in ROLE_KEYS:
            if key in keys:
                raise ConfigError(f"{src}: '{where}.{key}' cannot be used with 'model.modules'; "
                                  f"write it as {where}.modules.<name>")
    parsed: dict[str, Any] = {}
    for name, section in sections.items():
        key = f"model.modules.{name}"
        fam = raw_module_family(sections, name, src)
        preset = section.get("preset", "tiny")
        if not isinstance(preset, str) or preset not in fam.presets:
            raise ConfigError(f"{src}: '{key}.preset' must be one of {' | '.join(fam.presets)}, got {preset!r}")
        fixed = checkpoint_fields(fam, section, key, src)  # the checkpoint's config.json, over the preset
        parsed[name] = from_dict(fam.config_type, {**fam.presets[preset], **fixed, **section, "preset": preset},
                                 src=src, prefix=key + ".")
    graph = ModuleGraph.from_roles({n: FAMILIES[c.family].role for n, c in parsed.items()}, src)
    for name in (parallel.get("modules") or {}):
        if name not in graph.names:
            raise ConfigError(f"{src}: 'parallel.modules.{name}' names no module of model.modules "
                              f"({', '.join(graph.names)})")
    model["modules"] = parsed
    return data


def family_named(name: object, src: str, key: str) -> Family:
    """The family called ``name`` whatever its role; one-line error naming ``key`` otherwise."""
    if not isinstance(name, str) or name not in FAMILIES:
        raise ConfigError(f"{src}: '{key}' must be one of {' | '.join(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def link_sections(recipe: Recipe, default_parallel: type) -> None:
    """Make ``model.modules`` / ``parallel.modules`` hold every module in both recipe forms
    (``default_parallel()``: the degrees of a module ``parallel.modules`` does not list)."""
    m, p = recipe.model, recipe.parallel
    m._graph_form = bool(m.modules)  # not a field: says how messages name the sections
    if not m.modules:  # three-module form: the role sections are the graph
        m.modules = {k: getattr(m, k) for k in ROLE_KEYS}
        p.modules = {k: getattr(p, k) for k in ROLE_KEYS}
        return
    graph = graph_of(recipe)
    p.modules = {n: p.modules.get(n) or default_parallel() for n in graph.names}
    for role in ROLE_KEYS:
        names = graph.of_role(role)
        setattr(m, role, m.modules[names[0]] if len(names) == 1 else None)
        setattr(p, role, p.modules[names[0]] if len(names) == 1 else None)


def graph_of(recipe: Recipe) -> ModuleGraph:
    """The recipe's module graph (modules in data-flow order)."""
    modules = recipe.model.modules
    src = recipe.source_file or "<recipe>"
    return ModuleGraph.from_roles({n: family_named(c.family, src, f"model.modules.{n}.family").role
                                   for n, c in modules.items()}, src)


def module_config(recipe: Recipe, name: str):
    """The config section of module ``name``."""
    return recipe.model.modules[name]


def encoder_of(recipe: Recipe, modality: str):
    """The config of the recipe's encoder that reads ``modality`` (image | audio), or None."""
    return next((recipe.model.modules[n] for n in graph_of(recipe).encoders
                 if FAMILIES[recipe.model.modules[n].family].modality == modality), None)


def module_parallel(recipe: Recipe, name: str):
    """The parallel degrees of module ``name``."""
    return recipe.parallel.modules[name]


def module_degrees(recipe: Recipe) -> dict[str, tuple[int, int, int, int, bool]]:
    """(dp, pp, tp, sp, adaptive SP) each module runs with, in graph order (``sp: auto``: sp 1, the
    groups formed per microbatch); monolithic: encoders and generators take the LLM's DP and TP with
    PP 1 (they are stages of its pipeline)."""
    graph = graph_of(recipe)
    degrees = {n: (m.dp, m.pp, m.tp, 1 if m.sp == "auto" else m.sp, m.sp == "auto")
               for n, m in ((n, recipe.parallel.modules[n]) for n in graph.names)}
    if recipe.layout == "monolithic":
        dp, _, tp, _, _ = degrees[graph.llm]
        degrees.update({n: (dp, 1, tp, 1, False) for n in (*graph.encoders, *graph.generators)})
    return degrees


def sliced_tp_chunks(recipe: Recipe, name: str, tp: int, cuda: bool) -> int:
    """Pieces each overlapped collective is cut into where module ``name`` at TP degree ``tp`` runs
    on sequence slices (``parallel.<module>.tp_overlap``; auto: on CUDA where it applies), 0 where
    its activations stay replicated. ``tp``: the degree it runs at (the profiler also asks at
    degrees the recipe does not set)."""
    mp = module_parallel(recipe, name)
    if not tp_overlap_wanted(mp.tp_overlap, tp, cuda):
        return 0
    return 0 if tp_overlap_blocked(recipe, name, tp) else mp.tp_overlap_chunks


def tp_overlap_blocked(recipe: Recipe, name: str, tp: int) -> str | None:
    """Why module ``name`` cannot run on sequence slices at TP degree ``tp`` (``tp_overlap_blocker``), or None."""
    mp, family = module_parallel(recipe, name), module_family(recipe, name)
    seq_len = recipe.data.seq_len if name == graph_of(recipe).llm else None
    image_tokens = family.image_tokens(module_config(recipe, name)) if family.image_tokens else None
    return tp_overlap_blocker(family.name, family.sliced_tp, mp.sp, tp, mp.tp_overlap_chunks, seq_len, image_tokens)


def module_key(recipe: Recipe, name: str) -> str:
    """The recipe key of module ``name``'s section, for messages."""
    return f"model.modules.{name}" if getattr(recipe.model, "_graph_form", False) else f"model.{name}"


def parallel_key(recipe: Recipe, name: str) -> str:
    """The recipe key of module ``name``'s parallel degrees, for messages."""
    return "parallel." + module_key(recipe, name).removeprefix("model.")


def module_family(recipe: Recipe, name: str) -> Family:
    """The ``Family`` of module ``name``."""
    cfg = module_config(recipe, name)
    return get_family(cfg.family, graph_of(recipe).role(name), recipe.source_file or "<recipe>",
                      f"{module_key(recipe, name)}.family")


def as_written(recipe: Recipe) -> dict:
    """The recipe as plain data in the form it was written (three-module keys, or
    ``model.modules`` / ``parallel.modules``), without the other form's mirror of it."""
    data = to_dict(recipe)
    graph_form = getattr(recipe.model, "_graph_form", False)
    for section in ("model", "parallel"):
        for key in (ROLE_KEYS if graph_form else ("modules",)):
            data[section].pop(key, None)
    return data


def topology_of(recipe: Recipe) -> Topology:
    """The recipe's rank map from ``parallel.*`` (monolithic: encoder and generator take the LLM's DP/TP, PP 1)."""
    if recipe.layout == "reference":
        raise ConfigError(f"{recipe.source_file}: 'layout' reference runs in one process and has no rank map")
    return Topology.build(graph_of(recipe), module_degrees(recipe), recipe.layout)
