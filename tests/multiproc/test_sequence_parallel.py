"""Ulysses sequence parallelism computes the reference LLM's loss and gradients (fp32, gloo under
NCCL's rules).

Layers: every rank builds the seeded LLM layers (embedding with image rows, decoder blocks, head) whole,
runs the single-process reference on packed multi-document rows with padding, then the SP run:
its slice of each row, the all-to-all around attention, the lead's image rows broadcast to the
group. The LLM's parameter gradients, averaged over the SP group as DeepSpeed's data axis averages
them, and the image rows' gradient on the lead equal the reference's; the loss summed over the
group equals the reference loss. Negative controls: the loss without the SP factor, attention
across documents, and an all-to-all whose gradient is not exchanged back, each caught.

Jobs: the LLM engine with ``parallel.llm.sp`` trains the reference's losses and parameters over
3 SGD steps (synthetic rows of one or two documents plus padding), alone and composed with DP, PP
and TP; the SP lead alone crosses module boundaries.
"""

from __future__ import annotations

import json

import pytest
import torch

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.llama.config import LLMConfig
from disttrain_ds.families.llama.model import llm_layers
from disttrain_ds.samples import IGNORE_INDEX, NO_DOC

from .conftest import launch, max_param_mismatch
from .test_comm import run_ranks
from .test_fidelity import SGD, STEPS
from .test_post_balance import LAYOUT as POST_BALANCED

IMAGE = 3
CFG = LLMConfig(hidden_size=32, heads=4, kv_heads=2, ffn_hidden=64, layers=2, vocab_size=40, max_position=64)
TOL = 1e-5


def _batch() -> dict:
    """Two rows of 16: several documents of unequal lengths, image placeholders, then padding."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, CFG.vocab_size, (2, 16), generator=g)
    doc = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 4 + [NO_DOC] * 3])
    ids[0, 6:9] = IMAGE
    ids[1, 1:3] = IMAGE
    ids[1, 13:] = 0
    labels = torch.randint(4, CFG.vocab_size, (2, 16), generator=g)
    labels[1, 13:] = IGNORE_INDEX
    labels[0, 6:9] = IGNORE_INDEX
    embeds = torch.randn(5, CFG.hidden_size, generator=g)
    return {"ids": ids, "doc": doc, "labels": labels, "embeds": embeds}


def _layers():
    ctx = BuildContext(module="llm", seed=11, llm_hidden=CFG.hidden_size, image_token=IMAGE)
    return [d.build() for d in llm_layers(CFG, ctx)]


def _run(layers, b: dict, embeds: torch.Tensor, doc: torch.Tensor, sp=None, factor: float = 1.0):
    """The loss (summed cross-entropy over this rank's labelled positions, times ``factor``)."""
    x = (b["ids"], embeds, doc)
    for layer in layers:
        x = layer(x)
    logits, _ = x
    labels = b["labels"] if sp is None else sp.shard(b["labels"])
    valid = labels != IGNORE_INDEX
    return torch.nn.functional.cross_entropy(logits[valid], labels[valid], reduction="sum") * factor


def _sp_worker(rank: int, fault: str = "", tp: int = 1) -> dict:
    import torch.distributed as dist

    from disttrain_ds.parallel.sequence_parallel import SPContext, attach
    from disttrain_ds.parallel.tensor_parallel import TPContext, shard_layer

    world = dist.get_world_size()
    sp_size = world // tp
    b = _batch()
    ref = _layers()
    ref_embeds = b["embeds"].clone().requires_grad_(True)
    ref_loss = _run(ref, b, ref_embeds, b["doc"])
    ref_loss.backward()

    # Ranks laid out (sp, tp) as in a module's data axis: TP index fastest. Every rank makes every
    # group in one order (eager NCCL start-up).
    tp_groups = [dist.new_group([s * tp + t for t in range(tp)]) for s in range(sp_size)]
    sp_groups = [dist.new_group([s * tp + t for s in range(sp_size)]) for t in range(tp)]
    sp_rank, tp_rank = divmod(rank, tp)
    sp = SPContext(sp_groups[tp_rank], sp_rank, sp_size, lead=tp_rank, drop_grad=fault == "drop_grad")
    tpc = TPContext(tp_groups[sp_rank] if tp > 1 else None, tp_rank, tp, sp_rank * tp)
    layers = [attach(shard_layer(layer, tpc), sp) for layer in _layers()]
    placeholder = b["embeds"] if sp.is_lead else torch.zeros_like(b["embeds"])
    embeds = placeholder.clone().requires_grad_(True)
    doc = torch.zeros_like(b["doc"]) if fault == "one_document" else b["doc"]
    factor = 1.0 if fault == "no_factor" else sp.grad_factor
    loss = _run(layers, b, sp.from_lead(embeds), doc, sp, factor)
    loss.backward()

    total = loss.detach() / factor
    dist.all_reduce(total, group=sp.group)
    worst = {"loss": abs(float(total) - float(ref_loss)) / abs(float(ref_loss))}
    # Parameter gradients averaged over the SP group (DeepSpeed's data axis averages over it).
    ref_params = {f"{i}.{n}": p for i, layer in enumerate(ref) for n, p in layer.named_parameters()}
    err = 0.0
    for i, layer in enumerate(layers):
        for n, p in layer.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, group=sp.group)
            g /= sp_size
            want = ref_params[f"{i}.{n}"].grad
            if g.shape != want.shape:  # a TP shard: compare with its rows or columns of the whole
                want = _tp_slice(want, g.shape, tp_rank)
            err = max(err, float((g - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    worst["params"] = err
    if sp.is_lead:
        worst["embeds"] = float((embeds.grad - ref_embeds.grad).abs().max() / ref_embeds.grad.abs().max())
    else:
        worst["embeds"] = float(embeds.grad.abs().max())  # a placeholder's gradient stays zero
    return worst


def _tp_slice(whole: torch.Tensor, shape: torch.Size, tp_rank: int) -> torch.Tensor:
    dim = next(d for d, (a, b) in enumerate(zip(whole.shape, shape)) if a != b)
    return whole.narrow(dim, tp_rank * shape[dim], shape[dim])


def _results(world: int, fault: str = "", tp: int = 1) -> dict:
    out = run_ranks(world, _Worker(fault, tp), timeout=180)
    bad = {r: v for r, v in out.items() if v[0] != "ok"}
    assert not bad, bad
    return {r: v[1] for r, v in out.items()}


class _Worker:
    """Picklable ``fn(rank)`` for ``run_ranks``."""

    def __init__(self, fault: str, tp: int):
        self.fault, self.tp = fault, tp

    def __call__(self, rank: int) -> dict:
        return _sp_worker(rank, self.fault, self.tp)


def test_sp2_llm_loss_and_gradients_equal_the_reference_with_packed_documents():
    for rank, worst in _results(2).items():
        assert worst["loss"] < TOL, (rank, worst)
        assert worst["params"] < TOL, (rank, worst)
        assert worst["embeds"] < TOL, (rank, worst)


@pytest.mark.parametrize("fault", ["no_factor", "one_document", "drop_grad"])
def test_sp2_faults_are_caught(fault):
    """A loss without the SP factor, attention across documents, a dropped all-to-all gradient."""
    worst = _results(2, fault)
    assert max(max(w["loss"], w["params"]) for w in worst.values()) > 1e-3, worst


@pytest.mark.slow
def test_tp2_sp2_llm_gradients_equal_the_reference():
    for rank, worst in _results(4, tp=2).items():
        assert worst["loss"] < TOL, (rank, worst)
        assert worst["params"] < TOL, (rank, worst)
        assert worst["embeds"] < TOL, (rank, worst)


JOBS = {
    # name: (ranks, overrides)
    "llm_sp2": (4, ["parallel.llm.pp=1", "parallel.llm.sp=2"]),
}
SLOW_JOBS = {
    "llm_pp2_sp2": (6, ["parallel.llm.sp=2"]),
    "llm_tp2_sp2": (6, ["parallel.llm.pp=1", "parallel.llm.tp=2", "parallel.llm.sp=2"]),
    "llm_dp2_sp2_gen_dp2": (7, ["parallel.llm.pp=1", "parallel.llm.dp=2", "parallel.llm.sp=2",
                                "parallel.generator.dp=2"]),
    "llm_dp2_same_samples": (4, ["parallel.llm.pp=1", "parallel.llm.dp=2"]),  # DP 2 beside SP 2: the reference's too
    # Post-balanced encoder and generator replicas (units routed one by one) around an SP LLM.
    "post_balanced_llm_dp2_sp2": (8, [*POST_BALANCED, "parallel.llm.sp=2"]),
}


def _job(name: str, jobs: dict, tmp_path, reference_run, module: str = "llm") -> None:
    nproc, overrides = jobs[name]
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, "layout=disaggregated", *overrides])
    ref_losses, ref_params = reference_run([STEPS, *SGD, *(o for o in overrides if not o.startswith(("layout=", "parallel.")))])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    grid = next(m for m in _topology(overrides).modules if m.name == module)
    senders = {r for r in grid.ranks if json.loads((tmp_path / f"sends_rank{r}.json").read_text())}
    assert senders and all(grid.sp_index(r) == 0 and grid.coords(r)[2] == 0 for r in senders), senders


def _topology(overrides: list[str]):
    from disttrain_ds.recipe.graph import topology_of
    from disttrain_ds.recipe.schema import load_recipe

    return topology_of(load_recipe("tiny_cpu", ["layout=disaggregated", *overrides]))


@pytest.mark.parametrize("name", list(JOBS))
def test_sp_job_trains_the_reference(name, tmp_path, reference_run):
    _job(name, JOBS, tmp_path, reference_run)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_JOBS))
def test_more_sp_jobs_train_the_reference(name, tmp_path, reference_run):
    _job(name, SLOW_JOBS, tmp_path, reference_run)


@pytest.mark.slow
def test_a_checkpoint_written_under_sp_resumes_without_it_and_back(tmp_path, reference_run):
    """SP ranks are data-axis coordinates to the checkpoint: 3 steps at SP 2 resume at PP 2 (and
    3 steps at PP 2 resume at DP 2 x SP 2), with the reference's 6 losses and parameters."""
    from .test_reshard import README, check_against_reference, first_three_steps, resume

    ref_losses, ref_params = reference_run(["optim.warmup_steps=5", "train.steps=6"])
    sp = (4, ["parallel.llm.pp=1", "parallel.llm.sp=2"])
    losses, params, log = resume(tmp_path, first_three_steps(tmp_path, sp), (4, README), "b")
    check_against_reference(losses, params, ref_losses, ref_params)
    assert "parallel.llm.sp (checkpoint: 2, this run: 1)" in log, log[-2000:]
    back = tmp_path / "back"
    wide_sp = (6, ["parallel.llm.pp=1", "parallel.llm.dp=2", "parallel.llm.sp=2"])
    losses, params, _ = resume(back, first_three_steps(back, (4, README)), wide_sp, "b")
    check_against_reference(losses, params, ref_losses, ref_params)


def _documents(root) -> str:
    """Local interleaved documents, most short, some longer than seq_len (128 byte tokens)."""
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    for i in range(3):
        Image.new("RGB", (32, 24), (80 * i, 40, 200 - 60 * i)).save(root / "images" / f"{i}.png")
    words = "the kite rose over the grey beach while the wind turned and a dog ran after it ".split()
    lines = []
    for i in range(12):
        n = 260 + 17 * i if i % 3 == 1 else 20 + 3 * i  # every third document needs 3 or 4 x 128 tokens
        text = " ".join(words[(i + j) % len(words)] for j in range(n // 5))[:n]
        lines.append({"segments": [{"text": text[: n // 2]}, {"image": f"images/{i % 3}.png"},
                                   {"text": text[n // 2:]}, {"image": f"images/{(i + 1) % 3}.png", "generate": True}]})
    (root / "docs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(root / "docs.jsonl")


@pytest.mark.slow
def test_sp_job_on_sequences_of_their_own_lengths_trains_the_reference(tmp_path, reference_run):
    """Documents longer than seq_len become sequences of 256-512 tokens beside 128-token ones,
    padded per microbatch; SP 2 trains what the reference does."""
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.runtime.setup import build_data_and_spec

    data = ["data.source=local", f"data.path={_documents(tmp_path / 'data')}", "data.max_seq_len=512",
            "train.micro_batch=2", "model.generator.in_channels=3"]
    source, _ = build_data_and_spec(load_recipe("tiny_cpu", data))
    lengths = {int(s.input_ids.shape[0]) for step in range(3) for s in source.global_batch(step)}
    assert 128 in lengths and max(lengths) > 128, lengths  # mixed lengths reach the model
    rows, params, _ = launch(tmp_path / "job", 4, [STEPS, *SGD, "layout=disaggregated", "parallel.llm.pp=1",
                                                   "parallel.llm.sp=2", *data])
    ref_losses, ref_params = reference_run([STEPS, *SGD, *data])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"


@pytest.mark.slow  # adaptive groups: the default tier keeps the SP 2 job; unit tests pin the group search
def test_adaptive_sp_mixes_an_sp2_group_and_two_single_ranks_and_trains_the_reference(tmp_path, reference_run):
    """sp: auto on 4 LLM ranks, sequences of 128-512 tokens: at the all-to-all bandwidth given, every
    step forms one group of 2 for its longest sequence and runs the others alone; losses and
    parameters equal the reference's."""
    data = ["data.source=local", f"data.path={_documents(tmp_path / 'data')}", "data.max_seq_len=512",
            "model.generator.in_channels=3"]
    auto = ["layout=disaggregated", "parallel.llm.pp=1", "parallel.llm.dp=4", "parallel.llm.sp=auto",
            "parallel.sp_bandwidth_gbs=[1000,1000]"]
    rows, params, _ = launch(tmp_path / "job", 6, [STEPS, *SGD, *auto, *data])
    ref_losses, ref_params = reference_run([STEPS, *SGD, *data])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    for r in rows:  # one slot per step: a group of 2 and two ranks alone
        assert (r["sp/llm_groups_2"], r["sp/llm_groups_1"], r["sp/llm_ranks_split"]) == (1.0, 2.0, 0.5), r


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallel.llm.pp=2", "parallel.llm.dp=2"],  # the same groups on both stages of the LLM
    ["parallel.llm.pp=1", "parallel.llm.dp=2", "parallel.llm.tp=2"],  # a group per TP index
    # Blocks recomputed in backward, each under its own microbatch's group, microbatches of both
    # sizes in flight on the two stages.
    ["parallel.llm.pp=2", "parallel.llm.dp=2", "parallel.llm.activation_checkpointing=1"],
])
def test_adaptive_sp_with_pipeline_or_tensor_parallelism_trains_the_reference(tmp_path, reference_run, layout):
    data = ["data.source=local", f"data.path={_documents(tmp_path / 'data')}", "data.max_seq_len=512",
            "model.generator.in_channels=3", "train.global_batch=4"]
    # Two ranks a slot: a group of 2 pays only where the tiny model's fp32 all-to-alls are cheap
    # beside its compute (at 1,000 GB/s they are not, and every slot runs its samples alone).
    auto = ["layout=disaggregated", "parallel.llm.sp=auto", "parallel.sp_bandwidth_gbs=[100000,100000]", *layout]
    rows, params, _ = launch(tmp_path / "job", 6, [STEPS, *SGD, *auto, *data])
    ref_losses, ref_params = reference_run([STEPS, *SGD, *data])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    assert any(r.get("sp/llm_groups_2", 0) for r in rows), rows  # some slot ran a group of 2


@pytest.mark.slow
def test_adaptive_sp_beside_post_balanced_encoder_and_generator_trains_the_reference(tmp_path, reference_run):
    """sp: auto on 4 LLM ranks while the encoder's and the generator's 2 replicas take units by
    cost (``parallel.post_balance``): every unit reaches the lead of the group holding its sample."""
    data = ["data.source=local", f"data.path={_documents(tmp_path / 'data')}", "data.max_seq_len=512",
            "model.generator.in_channels=3", "train.micro_batch=1"]
    auto = [*(o for o in POST_BALANCED if not o.startswith(("parallel.llm.dp", "train.micro_batch"))),
            "parallel.llm.dp=4", "parallel.llm.sp=auto", "parallel.sp_bandwidth_gbs=[1000,1000]"]
    rows, params, _ = launch(tmp_path / "job", 8, [STEPS, *SGD, *auto, *data])
    kept = [o for o in auto if not o.startswith(("layout=", "parallel."))]
    ref_losses, ref_params = reference_run([STEPS, *SGD, *data, *kept])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    assert any(r.get("sp/llm_groups_2", 0) for r in rows) and any(r.get("sp/llm_groups_1", 0) for r in rows), rows
