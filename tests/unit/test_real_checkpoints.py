"""Real pretrained checkpoints, where this machine has any: each one imports through its family and
computes what transformers computes on the same weights (fp32, 1e-4 relative to the output's scale).

Looked for in ``$DISTTRAIN_PRETRAINED`` (a folder of ``save_pretrained`` directories) and in the
Hugging Face cache (``$HF_HOME`` or ``~/.cache/huggingface``, snapshots already on disk: nothing is
downloaded). Skipped when there are none."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from disttrain_ds.models.layers import Sequential
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.setup import build_data_and_spec

FAMILY_OF = {"llama": "llama", "qwen2": "qwen2", "clip": "clip", "clip_vision_model": "clip", "siglip": "siglip",
             "siglip_vision_model": "siglip", "vit": "vit"}
"""config.json model_type -> the family that reads it."""


def _found() -> list[Path]:
    roots = [Path(os.environ["DISTTRAIN_PRETRAINED"])] if os.environ.get("DISTTRAIN_PRETRAINED") else []
    hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    dirs = [d for r in roots if r.is_dir() for d in r.iterdir()]
    dirs += [s for m in hub.glob("models--*") for s in (m / "snapshots").glob("*")] if hub.is_dir() else []
    out = []
    for d in dirs:
        try:
            kind = json.loads((d / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            continue
        if kind in FAMILY_OF and any(d.glob("*.safetensors")):
            out.append(d)
    return sorted(out)


FOUND = _found()


@pytest.mark.skipif(not FOUND, reason="no pretrained checkpoint on this machine ($DISTTRAIN_PRETRAINED, HF cache)")
@pytest.mark.parametrize("path", FOUND, ids=lambda p: p.name)
def test_a_real_checkpoint_computes_what_transformers_computes(path):
    import transformers

    config = json.loads((path / "config.json").read_text())
    family = FAMILY_OF[config["model_type"]]
    role = "llm" if family in ("llama", "qwen2") else "vision"
    more = [f"model.modules.llm.vocab_size={config['vocab_size']}"] if role == "llm" else []
    recipe = load_recipe("tiny_vlm", [f"model.modules.{role}.family={family}", f"model.modules.{role}.checkpoint={path}",
                                      *more])
    spec = build_data_and_spec(recipe)[1]
    ours = Sequential([d.build() for d in spec.layers(role)[:None if role == "llm" else -1]]).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if role == "llm":
            ids = torch.randint(0, config["vocab_size"], (1, 16), generator=g)
            got = ours((ids, torch.zeros(0, spec.llm.hidden_size), torch.zeros_like(ids)))[0]
            want = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()(ids).logits
        else:
            side = recipe.model.modules["vision"].image_size
            image = torch.randn(3, side, side, generator=g)
            got = ours((image.reshape(-1), torch.tensor([[side, side]])))
            hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
            hf = getattr(hf, "vision_model", hf)
            cfg = recipe.model.modules["vision"]
            if family == "vit":
                want = hf(pixel_values=image.unsqueeze(0)).last_hidden_state[0, 1:]
            else:
                hidden = hf(pixel_values=image.unsqueeze(0), output_hidden_states=True).hidden_states
                want = hidden[cfg.feature_layer][0, 1 if family == "clip" else 0:]
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-4 * max(scale, 1.0)
