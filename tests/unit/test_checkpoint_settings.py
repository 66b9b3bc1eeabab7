"""A checkpoint's config.json fixes its module: shapes and settings read from it, the library's
logits reproduced, contradictions and settings the family cannot reproduce refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from disttrain_ds.errors import ConfigError
from disttrain_ds.estimate.memory import vocab_size
from disttrain_ds.models.layers import Sequential
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.imports import check_imports
from disttrain_ds.runtime.setup import build_data_and_spec

SETTINGS = dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=96,
                num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=256)
"""Not the tiny preset's shapes: grouped-query attention 9 / 3, eps and RoPE base off their defaults."""


def _llama_dir(tmp_path, vocab: int, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}, **SETTINGS, **overrides}
    cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **settings)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        hf = LlamaForCausalLM(cfg).eval()
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):  # transformers starts biases at zero: make them matter
                param.data.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama", hf


def _assert_refused(tmp_path, config: dict, recipe: str, module_key: str, key: str) -> None:
    """A checkpoint directory holding only ``config``, given to ``module_key``, stops the recipe's
    load in one line naming ``key`` and the module's checkpoint."""
    path = tmp_path / "ckpt"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe, [f"{module_key}.checkpoint={path}"])
    msg = str(err.value)
    assert f"'{key}'" in msg and f"{module_key}.checkpoint" in msg and "\n" not in msg


def _logits(spec, ids):
    llm = Sequential([d.build() for d in spec.layers("llm")])
    return llm((ids, torch.zeros(0, spec.llm.hidden_size), torch.zeros_like(ids)))[0]


def test_a_llama_checkpoints_config_fixes_the_llm_and_its_logits_match_transformers(tmp_path):
    vocab = vocab_size(load_recipe("tiny_cpu"))
    path, hf = _llama_dir(tmp_path, vocab)
    recipe = load_recipe("tiny_cpu", [f"model.llm.checkpoint={path}"])
    llm = recipe.model.llm
    assert (llm.hidden_size, llm.heads, llm.kv_heads, llm.ffn_hidden, llm.layers) == (72, 9, 3, 96, 2)
    assert (llm.rms_norm_eps, llm.rope_theta, llm.max_position) == (1e-5, 1e5, 256)
    spec = build_data_and_spec(recipe)[1]
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = _logits(spec, ids), hf(ids).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        # Negative control: the same weights under the default eps (what dropping the setting gives) differ.
        dropped = spec.with_changes("llm", rms_norm_eps=1e-6)
        assert (_logits(dropped, ids) - theirs).abs().max() > 1e-4


ROPES = {
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 2.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0},
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_each_rope_scaling_of_a_checkpoint_gives_transformers_logits(tmp_path, kind):
    vocab = vocab_size(load_recipe("tiny_cpu"))
    # 40 positions over a 32-position model: dynamic NTK rescales, and llama3 / yarn reach past 16.
    path, hf = _llama_dir(tmp_path, vocab, max_position_embeddings=32,
                          rope_parameters={"rope_type": kind, "rope_theta": 1e4, **ROPES[kind]})
    recipe = load_recipe("tiny_cpu", [f"model.llm.checkpoint={path}"])
    assert (recipe.model.llm.rope_type, recipe.model.llm.rope_scaling) == (kind, ROPES[kind])
    spec = build_data_and_spec(recipe)[1]
    ids = torch.randint(0, vocab, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits
        torch.testing.assert_close(_logits(spec, ids), theirs, rtol=1e-5, atol=1e-5)
        # Negative control: the same weights under plain RoPE (the scaling dropped) differ.
        plain = spec.with_changes("llm", rope_type="default", rope_scaling={})
        assert (_logits(plain, ids) - theirs).abs().max() > 1e-4


def test_the_graph_form_reads_the_checkpoint_too(tmp_path):
    vocab = vocab_size(load_recipe("tiny_vlm"))
    path, _ = _llama_dir(tmp_path, vocab)
    recipe = load_recipe("tiny_vlm", [f"model.modules.llm.checkpoint={path}"])
    assert (recipe.model.modules["llm"].heads, recipe.model.modules["llm"].rms_norm_eps) == (9, 1e-5)


def test_a_recipe_field_that_contradicts_the_checkpoint_is_one_line_naming_both(tmp_path):
    path, _ = _llama_dir(tmp_path, 300)
    assert load_recipe("tiny_cpu", [f"model.llm.checkpoint={path}", "model.llm.heads=9"]).model.llm.heads == 9
    with pytest.raises(ConfigError) as err:
        load_recipe("tiny_cpu", [f"model.llm.checkpoint={path}", "model.llm.heads=4"])
    msg = str(err.value)
    assert "'model.llm.heads' is 4 but its checkpoint says 9" in msg and "\n" not in msg


@pytest.mark.parametrize("change, key", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [2.0],
                          "original_max_position_embeddings": 64}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5}},
     "rope_scaling"),
    ({"head_dim": 0.5}, "head_dim"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral"}, "model_type"),
])
def test_settings_the_family_cannot_reproduce_are_refused_naming_them(tmp_path, change, key):
    _assert_refused(tmp_path, {"model_type": "llama", "vocab_size": 300, **SETTINGS, **change}, "tiny_cpu",
                    "model.llm", key)


def test_head_dim_and_biases_of_a_llama_checkpoint_give_transformers_logits(tmp_path):
    vocab = vocab_size(load_recipe("tiny_cpu"))
    # Heads 16 wide over a 72-wide model (9 x 16 = 144 != 72), and every projection biased.
    path, hf = _llama_dir(tmp_path, vocab, head_dim=16, attention_bias=True, mlp_bias=True)
    recipe = load_recipe("tiny_cpu", [f"model.llm.checkpoint={path}"])
    llm = recipe.model.llm
    assert (llm.head_dim, llm.attention_bias, llm.mlp_bias) == (16, True, True)
    spec = build_data_and_spec(recipe)[1]
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf(ids).logits
        torch.testing.assert_close(_logits(spec, ids), theirs, rtol=1e-5, atol=1e-5)
        # Negative control: the MLP biases dropped (an import that only matched the tensors it knew).
        dropped = spec.with_changes("llm", mlp_bias=False)
        assert (_logits(dropped, ids) - theirs).abs().max() > 1e-4


def test_qwen2_refuses_llamas_bias_settings():
    with pytest.raises(ConfigError, match="'model.llm.mlp_bias' is a llama-family setting"):
        load_recipe("tiny_cpu", ["model.llm.family=qwen2", "model.llm.mlp_bias=true"])


def test_qwen2_reads_its_own_checkpoints_and_refuses_a_sliding_window(tmp_path):
    path = tmp_path / "qwen2"
    path.mkdir()
    config = {"model_type": "qwen2", "vocab_size": 300, **SETTINGS, "rope_theta": 1e6}
    (path / "config.json").write_text(json.dumps(config))
    recipe = load_recipe("tiny_cpu", ["model.llm.family=qwen2", f"model.llm.checkpoint={path}"])
    assert (recipe.model.llm.heads, recipe.model.llm.rope_theta) == (9, 1e6)
    (path / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(ConfigError, match="'use_sliding_window'"):
        load_recipe("tiny_cpu", ["model.llm.family=qwen2", f"model.llm.checkpoint={path}"])
    # The Llama family does not read a Qwen2 checkpoint as its own.
    with pytest.raises(ConfigError, match="'model_type' is 'qwen2'"):
        load_recipe("tiny_cpu", [f"model.llm.checkpoint={path}"])


def test_a_vit_checkpoints_config_fixes_the_encoder_and_its_features_match_transformers(tmp_path):
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=3, intermediate_size=80, patch_size=8,
                    image_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.random.fork_rng():
        torch.manual_seed(4)
        hf = ViTModel(cfg, add_pooling_layer=False).eval()
    hf.save_pretrained(tmp_path / "vit")
    recipe = load_recipe("tiny_cpu", [f"model.encoder.checkpoint={tmp_path / 'vit'}"])
    e = recipe.model.encoder
    assert (e.hidden_size, e.layers, e.heads, e.ffn_hidden, e.patch_size, e.image_size) == (48, 3, 3, 80, 8, 32)
    spec = build_data_and_spec(recipe)[1]
    image = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(2))
    vit = Sequential([d.build() for d in spec.layers("encoder")[:-1]])  # the projector aside
    with torch.no_grad():
        ours = vit((image.reshape(-1), torch.tensor([[32, 32]])))
        theirs = hf(image[None], interpolate_pos_encoding=True).last_hidden_state[0, 1:]  # CLS dropped
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # Negative control: read with the recipe's own shapes it would not even load.
    with pytest.raises(ConfigError, match="'model.encoder.heads' is 2 but its checkpoint says 3"):
        load_recipe("tiny_cpu", [f"model.encoder.checkpoint={tmp_path / 'vit'}", "model.encoder.heads=2"])


@pytest.mark.parametrize("family, config, key", [
    ("vit", {"model_type": "vit", "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 3,
             "intermediate_size": 80, "patch_size": 8, "image_size": 32, "hidden_act": "relu"}, "hidden_act"),
    ("vit", {"model_type": "clip_vision_model", "hidden_size": 48}, "model_type"),
    ("whisper", {"model_type": "whisper", "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2,
                 "encoder_ffn_dim": 64, "num_mel_bins": 16, "max_source_positions": 32, "scale_embedding": True},
     "scale_embedding"),
])
def test_encoder_settings_the_family_cannot_reproduce_are_refused_naming_them(tmp_path, family, config, key):
    recipe, module = ("tiny_cpu", "model.encoder") if family == "vit" else ("tiny_omni", "model.modules.ear")
    _assert_refused(tmp_path, config, recipe, module, key)


def test_a_whisper_checkpoints_config_fixes_the_audio_encoder(tmp_path):
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(d_model=48, encoder_layers=3, encoder_attention_heads=3, encoder_ffn_dim=80, num_mel_bins=16,
                        max_source_positions=40, decoder_layers=1, decoder_attention_heads=3, decoder_ffn_dim=16,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    WhisperModel(cfg).save_pretrained(tmp_path / "whisper")
    recipe = load_recipe("tiny_omni", [f"model.modules.ear.checkpoint={tmp_path / 'whisper'}"])
    ear = recipe.model.modules["ear"]
    assert (ear.hidden_size, ear.layers, ear.heads, ear.ffn_hidden, ear.n_mels, ear.max_frames) == (48, 3, 3, 80, 16, 80)


def test_a_unet_checkpoints_config_fixes_the_generator(tmp_path):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32, 32),
                                down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                                layers_per_block=1, attention_head_dim=4, cross_attention_dim=24, norm_num_groups=8,
                                use_linear_projection=True, upcast_attention=True)
    unet.save_pretrained(tmp_path / "unet")
    recipe = load_recipe("tiny_cpu", [f"model.generator.checkpoint={tmp_path / 'unet'}"])
    g = recipe.model.generator
    assert (g.resolution, g.in_channels, g.block_out_channels, g.layers_per_block) == (8, 4, [16, 32, 32], 1)
    assert (g.attention_head_dim, g.cross_attention_dim, g.use_linear_projection, g.upcast_attention) == (
        [4, 4, 4], 24, True, True)
    check_imports(recipe)  # the layers the generator builds hold every tensor of the checkpoint's shapes


@pytest.mark.parametrize("change, key", [
    ({"act_fn": "gelu"}, "act_fn"),
    ({"_class_name": "UNet2DModel"}, "_class_name"),
    ({"class_embed_type": "timestep"}, "class_embed_type"),
    ({"out_channels": 8}, "out_channels"),
])
def test_unet_settings_the_family_cannot_reproduce_are_refused_naming_them(tmp_path, change, key):
    config = {"_class_name": "UNet2DConditionModel", "sample_size": 16, "in_channels": 3, "out_channels": 3,
              "block_out_channels": [16, 32], "layers_per_block": 1, "attention_head_dim": 8,
              "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
              "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": 32, "norm_num_groups": 8,
              "use_linear_projection": False, **change}
    _assert_refused(tmp_path, config, "tiny_cpu", "model.generator", key)


def test_a_dit_checkpoints_config_fixes_the_generator_and_its_extras_are_refused(tmp_path):
    from diffusers import PixArtTransformer2DModel

    PixArtTransformer2DModel(num_attention_heads=3, attention_head_dim=8, in_channels=2, out_channels=4, num_layers=3,
                             cross_attention_dim=24, sample_size=8, patch_size=2, caption_channels=None,
                             use_additional_conditions=False).save_pretrained(tmp_path / "dit")
    recipe = load_recipe("tiny_two_gen", [f"model.modules.sketcher.checkpoint={tmp_path / 'dit'}"])
    d = recipe.model.modules["sketcher"]
    assert (d.heads, d.head_dim, d.layers, d.in_channels, d.resolution, d.learn_sigma) == (3, 8, 3, 2, 8, True)
    check_imports(recipe)
    config = json.loads((tmp_path / "dit" / "config.json").read_text())
    for change, key in (({"norm_type": "ada_norm_zero"}, "norm_type"), ({"use_additional_conditions": True},
                        "use_additional_conditions"), ({"out_channels": 3}, "out_channels")):
        (tmp_path / "dit" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=f"'{key}'"):
            load_recipe("tiny_two_gen", [f"model.modules.sketcher.checkpoint={tmp_path / 'dit'}"])
