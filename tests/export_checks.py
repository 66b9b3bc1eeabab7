"""Shared by the export tests: a step directory written the way DeepSpeed lays one out, and the
check that an exported module loads with ``from_pretrained`` and computes what the trained one does."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from disttrain_ds.models.layers import Sequential
from disttrain_ds.recipe.graph import topology_of


def perturbed_states(spec, modules, seed: int = 7) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {layer/param: tensor}}: the seeded init plus seeded noise (a load that silently kept
    the init would not match)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in modules:
        state = {}
        for d in spec.layers(m):
            for k, v in d.build().state_dict().items():
                noise = torch.randn(v.shape, generator=g) * 0.02 if v.is_floating_point() else 0
                state[f"{d.name}/{k}"] = v + noise
        out[m] = state
    return out


def write_step_dir(root: Path, recipe, spec, states: dict, step: int = 1) -> Path:
    """A complete step directory holding ``states`` in DeepSpeed's file layout (one file per layer
    and TP rank, cut by ``shard_layer`` as the runtime cuts it) with a checksummed manifest."""
    from disttrain_ds.checkpoint.files import CHECKSUM, file_entry
    from disttrain_ds.checkpoint.manifest import FORMAT, MANIFEST, fingerprint, step_dir_name
    from disttrain_ds.parallel.tensor_parallel import TPContext, shard_layer

    step_dir = root / step_dir_name(step)
    topology = topology_of(recipe)
    for m, state in states.items():
        par = topology.module(m)
        (step_dir / m).mkdir(parents=True)
        for idx, d in enumerate(spec.layers(m)):
            layer = d.build()
            layer.load_state_dict({k.split("/", 1)[1]: v for k, v in state.items() if k.split("/", 1)[0] == d.name})
            for r in range(par.tp):
                cut = shard_layer(copy.deepcopy(layer), TPContext(None, r, par.tp))
                torch.save(cut.state_dict(), step_dir / m / f"layer_{idx:02d}-model_{r:02d}-model_states.pt")
    files = {p.relative_to(step_dir).as_posix(): file_entry(p) for p in sorted(step_dir.rglob("*")) if p.is_file()}
    manifest = {"format": FORMAT, "step": step, "time": time.time(), "recipe": recipe.source_file,
                "run_dir": str(root), "fingerprint": fingerprint(recipe, topology.world_size), "checksum": CHECKSUM, "files": files}
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    return step_dir


def trained_body(spec, module: str, state: dict[str, torch.Tensor]) -> Sequential:
    """The module's own layers (projector aside) holding ``state``."""
    layers = []
    for d in spec.layers(module):
        if d.name == "projector":
            continue
        layer = d.build()
        layer.load_state_dict({k.split("/", 1)[1]: v for k, v in state.items() if k.split("/", 1)[0] == d.name})
        layers.append(layer)
    return Sequential(layers).eval()


def load_exported(family: str, path: Path):
    """``from_pretrained`` of the library class for ``family``; (model, loading info)."""
    if family == "vit":
        from transformers import ViTModel

        return ViTModel.from_pretrained(path, add_pooling_layer=False, output_loading_info=True)
    if family in ("llama", "qwen2"):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    if family == "whisper":
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        return WhisperEncoder.from_pretrained(path, output_loading_info=True)
    if family == "unet":
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel.from_pretrained(path, output_loading_info=True)
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel.from_pretrained(path, output_loading_info=True)


def output_diff(spec, module: str, state: dict[str, torch.Tensor], out_dir: Path) -> float:
    """Max abs difference between the exported model (``from_pretrained``, which must report no
    missing or unexpected keys) and the trained layers on the same inputs, and between the exported
    projector's tensors and the trained ones."""
    from safetensors.torch import load_file

    fam, cfg = spec.family(module), spec.config(module)
    hf, info = load_exported(fam.name, out_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf = hf.float().eval()
    ours = trained_body(spec, module, state)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        if fam.name == "vit":
            from disttrain_ds.models.pixels import pack_images

            img = torch.randn(3, cfg.image_size, cfg.image_size, generator=g)
            mine = ours(pack_images([img]))
            theirs = hf(img[None], interpolate_pos_encoding=True).last_hidden_state[0, 1:]
        elif fam.role == "llm":
            ids = torch.randint(0, 200, (1, 12), generator=g)
            mine = ours((ids, torch.zeros(0, cfg.hidden_size), torch.zeros_like(ids)))[0]  # one document
            theirs = hf(ids).logits
        elif fam.name == "unet":
            cond = torch.randn(1, 4, cfg.cross_attention_dim, generator=g)
            noisy = torch.randn(1, cfg.in_channels, cfg.resolution, cfg.resolution, generator=g)
            t = torch.tensor([17])
            mine = ours((cond, noisy, t))
            theirs = hf(noisy, t, encoder_hidden_states=cond).sample
        elif fam.name == "whisper":
            from disttrain_ds.families.whisper.model import pack_clips

            mel = torch.randn(cfg.n_mels, cfg.max_frames, generator=g)
            mine = ours(pack_clips([mel]))
            theirs = hf(mel[None]).last_hidden_state[0]
        elif fam.name == "dit":
            cond = torch.randn(1, 4, cfg.cross_attention_dim, generator=g)
            noisy = torch.randn(1, cfg.in_channels, cfg.resolution, cfg.resolution, generator=g)
            t = torch.tensor([17])
            mine = ours((cond, noisy, t))
            theirs = hf(noisy, encoder_hidden_states=cond, timestep=t,
                        added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample[:, : cfg.in_channels]
        else:
            raise AssertionError(f"no output check for family {fam.name}")
    diff = float((mine - theirs).abs().max())
    proj = {k: v for k, v in state.items() if k.startswith("projector/")}
    if proj:
        saved = load_file(str(out_dir / "projector.safetensors"))
        assert saved.keys() == proj.keys()
        diff = max(diff, *(float((saved[k] - proj[k].float()).abs().max()) for k in proj))
    return diff
