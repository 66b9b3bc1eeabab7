"""The Whisper audio-encoder family: equal to transformers' WhisperEncoder clip by clip, packing-
independent, preset sizes of the real models, a TP plan that splits heads correctly, a torch-free record."""

from __future__ import annotations

import copy
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.whisper import AUDIO_ENCODER_PRESETS, FAMILY, AudioEncoderConfig, modality, rows, width
from disttrain_ds.mllm.weights import map_key, with_checkpoint
from disttrain_ds.models.layers import Sequential

transformers = pytest.importorskip("transformers")
from transformers.models.whisper.modeling_whisper import (  # noqa: E402
    WhisperAttention,
    WhisperEncoder,
    WhisperForConditionalGeneration,
)

from disttrain_ds.families.whisper import model as wm  # noqa: E402

CFG = AudioEncoderConfig()  # tiny: 16 mels, width 32, 2 layers, 2 heads, max 64 frames
CTX = BuildContext(module="encoder", seed=0, llm_hidden=48)
LENGTHS = (10, 64, 24)  # frames per clip: short, the longest allowed, another


def _clips(lengths=LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(CFG.n_mels, n, generator=g) for n in lengths]


def _ours(path: str = "", rules=FAMILY.hf_rules, cfg: AudioEncoderConfig = CFG, ctx: BuildContext = CTX) -> Sequential:
    return Sequential([d.build() for d in with_checkpoint(ctx.module, wm.layers(cfg, ctx), path, rules)]).eval()


def _per_clip(out: torch.Tensor, clips: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.split(out, [rows(CFG, c.shape[1]) for c in clips]))


def _source(seed: int = 123) -> WhisperEncoder:
    """The 'pretrained' encoder the checkpoint comes from (HF's own init, seeded apart from ours)."""
    torch.manual_seed(seed)
    return WhisperEncoder(wm.hf_config(CFG)).eval()


def _hf_on_clip(state: dict[str, torch.Tensor], clip: torch.Tensor) -> torch.Tensor:
    """transformers' WhisperEncoder.forward on one clip alone.

    It insists on input length == 2 * max_source_positions, so the reference is an encoder whose
    position table is this clip's length: the same weights with the first ``rows`` positions
    (eager attention, so the reference does not share our SDPA path)."""
    frames = clip.shape[1]
    hc = wm.hf_config(replace(CFG, max_frames=frames))
    hc._attn_implementation = "eager"
    ref = WhisperEncoder(hc).eval()
    own = dict(state, **{"embed_positions.weight": state["embed_positions.weight"][: frames // 2]})
    ref.load_state_dict(own)
    with torch.no_grad():
        return ref(clip.unsqueeze(0)).last_hidden_state[0]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    src = _source()
    path = tmp_path_factory.mktemp("whisper") / "encoder"
    src.save_pretrained(path)
    return str(path), {k: v.detach().clone() for k, v in src.state_dict().items()}


def test_transformers_encoder_needs_the_full_length():
    """Why the reference rebuilds HF's encoder per clip length: it rejects a clip shorter than 30 s-equivalent."""
    with pytest.raises(ValueError, match="expects the mel input features to be of length"):
        _source()(torch.zeros(1, CFG.n_mels, 10))


def test_matches_transformers_clip_by_clip(pretrained):
    path, state = pretrained
    clips = _clips()
    with torch.no_grad():
        out = _ours(path)(wm.pack_clips(clips))
    assert out.shape == (sum(n // 2 for n in LENGTHS), width(CFG))
    for clip, got in zip(clips, _per_clip(out, clips)):
        torch.testing.assert_close(got, _hf_on_clip(state, clip), atol=1e-5, rtol=1e-5)


def test_negative_control_own_seeded_init_does_not_match(pretrained):
    path, state = pretrained
    clip = _clips()[0]
    with torch.no_grad():
        got = _ours()(wm.pack_clips([clip]))
    assert (got - _hf_on_clip(state, clip)).abs().max() > 1e-2


def test_checkpoint_without_a_key_map_is_refused_not_partly_loaded(pretrained):
    path, _ = pretrained
    with pytest.raises(ValueError, match="no tensor for"):
        _ours(path, rules=())


def test_reads_the_whisper_for_conditional_generation_layout(tmp_path):
    """``model.encoder.*`` keys load (the decoder's are left alone); checked on a full-length clip,
    where transformers' encoder runs as is."""
    hc = wm.hf_config(CFG)
    hc.vocab_size, hc.decoder_layers = 100, 1
    hc.pad_token_id = hc.bos_token_id = hc.eos_token_id = hc.decoder_start_token_id = 0
    torch.manual_seed(7)
    full = WhisperForConditionalGeneration(hc).eval()
    full.save_pretrained(tmp_path / "asr")
    clip = _clips((CFG.max_frames,))[0]
    with torch.no_grad():
        want = full.model.encoder(clip.unsqueeze(0)).last_hidden_state[0]
        got = _ours(str(tmp_path / "asr"))(wm.pack_clips([clip]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_key_map():
    rules = FAMILY.hf_rules
    for prefix in ("", "encoder.", "model.encoder."):
        assert map_key("encoder", prefix + "layers.3.self_attn.k_proj.weight", rules) == "block3/layer.self_attn.k_proj.weight"
        assert map_key("encoder", prefix + "conv2.bias", rules) == "embed/conv2.bias"
        assert map_key("encoder", prefix + "embed_positions.weight", rules) == "embed/embed_positions.weight"
        assert map_key("encoder", prefix + "layer_norm.weight", rules) == "head/layer_norm.weight"
    for key in ("model.decoder.layers.0.fc1.weight", "decoder.layer_norm.weight", "proj_out.weight", "model.layers.0.fc1.weight"):
        assert map_key("encoder", key, rules) is None


def test_packing_does_not_change_a_clip():
    """Clips of different (and equal) lengths together give each clip's rows alone."""
    model = _ours()
    clips = _clips((10, 64, 10, 24))
    with torch.no_grad():
        together = _per_clip(model(wm.pack_clips(clips)), clips)
        for clip, got in zip(clips, together):
            torch.testing.assert_close(got, model(wm.pack_clips([clip])), atol=1e-6, rtol=1e-6)
    back = wm.unpack_clips(*wm.pack_clips(clips))
    assert all(torch.equal(a, b) for a, b in zip(back, clips))


def test_gradients_reach_the_stem_but_not_the_fixed_positions():
    model = _ours().train()
    model(wm.pack_clips(_clips())).square().sum().backward()
    embed, block = model.layers[0], model.layers[1]
    assert embed.conv1.weight.grad is not None and block.layer.fc1.weight.grad is not None
    assert embed.embed_positions.weight.grad is None  # sinusoidal, as in transformers


@pytest.mark.parametrize("shape", [(CFG.n_mels, 11), (CFG.n_mels, CFG.max_frames + 2), (CFG.n_mels + 1, 10)])
def test_unreadable_clip_is_one_line(shape):
    with pytest.raises(ValueError, match="audio clip 1 has shape"):
        _ours()(wm.pack_clips([torch.zeros(CFG.n_mels, 4), torch.zeros(*shape)]))


def test_record():
    built = wm.layers(CFG, CTX)
    assert FAMILY.layer_count(CFG) == len(built) == CFG.layers + 2
    assert [d.name for d in built] == ["embed", "block0", "block1", "head"]
    assert FAMILY.role == "encoder" and FAMILY.config_type is AudioEncoderConfig and modality == "audio"
    assert width(CFG) == FAMILY.width(CFG) == CFG.hidden_size and rows(CFG, 3000) == 1500
    assert FAMILY.tp_sizes(CFG, "model.encoder", 48) == [("model.encoder.heads", 2), ("model.encoder.ffn_hidden", 64)]
    # Two encoders of one size start apart; one module builds the same weights twice.
    a, b = _ours(), _ours(ctx=replace(CTX, module="audio"))
    assert not torch.equal(a.layers[1].layer.fc1.weight, b.layers[1].layer.fc1.weight)
    assert torch.equal(a.layers[1].layer.fc1.weight, _ours().layers[1].layer.fc1.weight)


def test_record_imports_no_torch():
    code = "import sys, disttrain_ds.families.whisper; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# Encoder parameters of the public checkpoints (openai/whisper-small: 241.7M in all, of which the
# encoder 88.15M; openai/whisper-large-v3: encoder 637.0M), counted from their configs.
@pytest.mark.parametrize("preset, real", [("whisper-small", 88_154_112), ("whisper-large-v3", 636_968_960)])
def test_preset_sizes(preset, real):
    cfg = AudioEncoderConfig(**AUDIO_ENCODER_PRESETS[preset])
    try:
        with torch.device("meta"):
            hf = WhisperEncoder(wm.hf_config(cfg))
            ours = [d.build() for d in wm.layers(cfg, CTX)]
    finally:
        wm.clear_caches()  # the cache now holds a meta model
    n_ours = sum(p.numel() for m in ours for p in m.parameters())
    assert n_ours == sum(p.numel() for p in hf.parameters())
    assert abs(n_ours - real) / real < 0.01


@pytest.fixture
def tp():
    """tensor_parallel, which takes this family's plan from the registry (its network code is loaded here)."""
    from disttrain_ds.parallel import tensor_parallel

    return tensor_parallel


def test_tp_plan_splits_a_block(tp):
    block = wm.layers(CFG, CTX)[1].build()
    full = copy.deepcopy(block.layer)
    tp.shard_layer(block, tp.TPContext(None, 1, 2))
    attn, half = block.layer.self_attn, CFG.hidden_size // 2
    assert isinstance(attn.q_proj, tp.ColumnParallelLinear)
    assert torch.equal(attn.q_proj.weight, full.self_attn.q_proj.weight[half:])
    assert torch.equal(attn.q_proj.bias, full.self_attn.q_proj.bias[half:])
    assert isinstance(attn.k_proj, tp.ColumnParallelLinear) and attn.k_proj.bias is None
    assert isinstance(attn.out_proj, tp.RowParallelLinear)
    assert torch.equal(attn.out_proj.weight, full.self_attn.out_proj.weight[:, half:])
    assert isinstance(block.layer.fc1, tp.ColumnParallelLinear) and isinstance(block.layer.fc2, tp.RowParallelLinear)
    assert block.layer.fc1.weight.shape == (CFG.ffn_hidden // 2, CFG.hidden_size)
    assert attn.num_heads == CFG.heads // 2  # follows the shard's width


class _NoReduce:
    """Stands in for the TP all-reduce: each rank returns its partial sum (summed by the test)."""

    @staticmethod
    def apply(x, group):
        return x


@pytest.mark.parametrize("heads", [2, 4])
def test_tp_attention_shards_sum_to_the_whole(tp, monkeypatch, heads):
    """Each rank attends with its own heads: the ranks' partial outputs add up to the full layer.
    transformers' WhisperAttention as is (fixed ``num_heads``) fails here with a shape error."""
    monkeypatch.setattr(tp, "_ReduceFromTP", _NoReduce)
    cfg = replace(CFG, heads=heads)
    attn = wm.layers(cfg, CTX)[1].build().layer.self_attn
    x = torch.randn(3, 10, cfg.hidden_size)
    with torch.no_grad():
        whole = attn(x)[0]
        parts = [tp.shard_layer(copy.deepcopy(attn), tp.TPContext(None, r, 2))(x)[0] for r in range(2)]
        torch.testing.assert_close(sum(parts) - attn.out_proj.bias, whole, atol=1e-5, rtol=1e-5)
        plain = copy.deepcopy(attn)
        plain.__class__ = WhisperAttention
        plain = tp.shard_layer(plain, tp.TPContext(None, 0, 2))
        with pytest.raises(RuntimeError):
            plain(x)
