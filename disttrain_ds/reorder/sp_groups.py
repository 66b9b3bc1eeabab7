"""Sequence-parallel groups adapted to each microbatch's lengths (FlexSP, Wang et al., ASPLOS '25).

One static SP degree wastes GPUs on long-tailed lengths: short sequences pay all-to-alls they do
not need, while the longest sequence alone decides how far every sequence must be split. Here the
``n`` ranks of a module split, per microbatch, into SP groups of different power-of-two sizes,
aligned (a group of size p starts at a multiple of p, so groups nest like a buddy allocator and
fit inside a node whenever p does), and every sequence runs on one group:

- ``SPCost`` prices a sequence on a group of size p: its training FLOPs (linear per token,
  attention per attended pair) over p GPUs at an achieved rate, plus its all-to-all bytes over the
  group's bandwidth; a group must hold its sequences' tokens in p GPUs' activation memory.
- ``static_groups`` is one degree for everything: n / p groups of size p, sequences by LPT.
- ``adaptive_groups`` searches the makespan T (bisection): for a given T, best-fit decreasing
  puts each sequence (longest first) on the open group where it fits in time and memory leaving
  the least slack, or opens the smallest group that runs it within T; T is feasible if the opened
  groups need at most ``n`` ranks. The best static degree is a candidate too, so the adaptive plan
  is never slower than any static one under the cost model.

Pure and deterministic: every rank of a module computes the same groups from the same lengths.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from disttrain_ds.cost.flops import llm_flops_packed, training_flops

if TYPE_CHECKING:  # annotations only
    from disttrain_ds.families.base import Family

SEARCH_STEPS = 24
"""Bisection steps of ``adaptive_groups`` (the makespan to within 2^-24 of its starting bracket)."""


@dataclass(frozen=True)
class SPCost:
    """What one sequence costs on an SP group of a given size."""

    ms_per_flop: float
    """Milliseconds per training FLOP on one GPU (its achieved rate)."""
    linear_flops: float
    """Training FLOPs per token of everything but attention scores (projections, MLP, LM head)."""
    pair_flops: float
    """Training FLOPs per attended (query, key) pair, summed over layers."""
    a2a_bytes_per_token: float
    """Bytes one token's activations carry through a step's all-to-alls (q, k, v and output, every
    layer, forward and backward) when its sequence is split; each GPU sends (p-1)/p of its share."""
    bandwidth_gbs: Mapping[int, float]
    """All-to-all bandwidth per GPU (GB/s) by group size (sizes above the largest key use its value)."""
    tokens_per_gpu: float
    """Tokens of activations one GPU holds: a group of size p holds p times that."""
    causal: bool = True
    """Attention pairs of a sequence of L tokens: L (L + 1) / 2 under a causal mask (an LLM), L^2
    when every token attends to every other (an encoder's item)."""

    def bandwidth(self, size: int) -> float:
        known = sorted(self.bandwidth_gbs)
        fit = [k for k in known if k >= size]
        return self.bandwidth_gbs[fit[0] if fit else known[-1]]

    def a2a_ms(self, length: int, size: int) -> float:
        """Milliseconds of one sequence's all-to-alls on a group of ``size`` GPUs (each sends (p-1)/p of its share)."""
        if size == 1:
            return 0.0
        sent = self.a2a_bytes_per_token * length / size * (size - 1) / size
        return sent / (self.bandwidth(size) * 1e9) * 1e3

    def seq_ms(self, length: int, size: int) -> float:
        """Milliseconds of one sequence of ``length`` tokens on a group of ``size`` GPUs."""
        pairs = length * (length + 1) / 2 if self.causal else length * length
        compute = (self.linear_flops * length + self.pair_flops * pairs) * self.ms_per_flop / size
        return compute + self.a2a_ms(length, size)

    def min_size(self, length: int) -> int:
        """The smallest power-of-two group whose memory holds ``length`` tokens."""
        p = 1
        while p * self.tokens_per_gpu < length:
            p *= 2
        return p


def transformer_cost(*, layers: int, hidden: int, ffn_hidden: int, heads: int, kv_heads: int, vocab: int,
                     head_dim: int | None = None, tflops: float, bandwidth_gbs: Mapping[int, float],
                     tokens_per_gpu: float, tp: int = 1, bytes_per_value: int = 2) -> SPCost:
    """``SPCost`` of a decoder LLM: training FLOPs per token and per attended pair from
    ``cost/flops.py`` (over ``tp`` GPUs too), all-to-all bytes of q, k, v and the output of every
    layer, forward and backward, per TP rank, at ``tflops`` achieved per GPU."""
    dims = dict(layers=layers, hidden=hidden, ffn_hidden=ffn_hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                head_dim=head_dim)
    one, two = (llm_flops_packed(doc_lens=[n], **dims) for n in (1, 2))
    pair = two - 2 * one  # training FLOPs per attended pair: F(L) = lin L + pair L (L + 1) / 2
    a2a = a2a_bytes_per_token(layers, head_dim or hidden // heads, heads, kv_heads, tp, bytes_per_value)
    return SPCost(ms_per_flop=1e3 / (tflops * 1e12) / tp, linear_flops=one - pair, pair_flops=pair,
                  a2a_bytes_per_token=a2a, bandwidth_gbs=dict(bandwidth_gbs), tokens_per_gpu=tokens_per_gpu)


def a2a_bytes_per_token(layers: int, head_dim: int, heads: int, kv_heads: int, tp: int = 1,
                        bytes_per_value: int = 2) -> float:
    """``SPCost.a2a_bytes_per_token`` of a transformer: q, k, v out and the attention output back,
    in every layer, forward and backward (the backward exchanges their gradients), per TP rank."""
    return 2 * layers * bytes_per_value * head_dim * (2 * heads + 2 * kv_heads) / tp


def module_a2a_bytes(family: Family, cfg: Any, tp: int = 1, bytes_per_value: int = 2) -> float:
    """``a2a_bytes_per_token`` of a module of ``family`` (one with an SP path): the heads SP splits,
    the transformer layers one forward runs, their head width."""
    heads, kv_heads = family.sp_heads(cfg)
    head_dim = getattr(cfg, "head_dim", 0) or cfg.hidden_size // heads
    return a2a_bytes_per_token(family.run_layers(cfg), head_dim, heads, kv_heads, tp, bytes_per_value)


def item_cost(family: Family, cfg: Any, *, tflops: float, bandwidth_gbs: Mapping[int, float],
              tokens_per_gpu: float, tp: int = 1, bytes_per_value: int = 2) -> SPCost:
    """``SPCost`` of an encoder whose sequences are its items (an image, an audio clip), counted in
    the rows its layers run: training FLOPs per row and per attended pair (every row of an item
    attends to every other) from the family's per-item forward FLOPs, whose (constant, per row,
    per squared row) terms three item sizes fix exactly; the item's constant term is left out, as
    an LLM's per-sequence one is."""
    base = 1 << 10  # sizes well above any rounding in ``rows`` (a stride-2 convolution halves an even count)
    sizes = [base, 2 * base, 3 * base]
    rows = np.array([family.rows(cfg, x) for x in sizes], dtype=np.float64)
    flops = [training_flops(family.item_flops(cfg, x)) for x in sizes]
    _, linear, pair = np.linalg.solve(np.vander(rows, 3, increasing=True), flops)
    return SPCost(ms_per_flop=1e3 / (tflops * 1e12) / tp, linear_flops=float(linear), pair_flops=float(pair),
                  a2a_bytes_per_token=module_a2a_bytes(family, cfg, tp, bytes_per_value),
                  bandwidth_gbs=dict(bandwidth_gbs), tokens_per_gpu=tokens_per_gpu, causal=False)


def exchange_cost(a2a_bytes: float, bandwidth_gbs: Mapping[int, float]) -> SPCost:
    """An ``SPCost`` of the all-to-alls alone, ``a2a_bytes`` per token (the compute is priced
    elsewhere; memory is not its concern): what ``SPCost.a2a_ms`` reads."""
    return SPCost(ms_per_flop=0.0, linear_flops=0.0, pair_flops=0.0, a2a_bytes_per_token=a2a_bytes,
                  bandwidth_gbs=dict(bandwidth_gbs), tokens_per_gpu=math.inf)


@dataclass(frozen=True)
class SPGroup:
    """One SP group of a microbatch."""

    first: int
    """Its first rank among the module's ``n`` (a multiple of ``size``)."""
    size: int
    """Ranks in it (a power of two)."""
    seqs: tuple[int, ...]
    """Indices of the sequences it runs."""
    ms: float
    """Its time under the cost model."""


@dataclass(frozen=True)
class SPPlan:
    """A microbatch's groups, covering the ranks ``0 .. n-1`` (a rank of no listed group idles)."""

    groups: tuple[SPGroup, ...]

    @property
    def makespan(self) -> float:
        return max((g.ms for g in self.groups), default=0.0)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(g.size for g in self.groups)


def _aligned(groups: list[tuple[int, list[int], float]]) -> SPPlan:
    """(size, sequences, ms) groups placed largest first: consecutive powers of two, non-increasing,
    each start at a multiple of its size."""
    out, first = [], 0
    for size, seqs, ms in sorted(groups, key=lambda g: (-g[0], g[1])):
        out.append(SPGroup(first, size, tuple(sorted(seqs)), ms))
        first += size
    return SPPlan(tuple(out))


def _check(lengths: Sequence[int], n: int) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(f"the module's ranks must be a power of two to split into aligned groups, got {n}")
    if any(int(x) != x or x < 1 for x in lengths):
        raise ValueError("sequence lengths must be positive integers")


def _lpt(lengths: Sequence[int], sizes: Sequence[int], cost: SPCost) -> list[tuple[int, list[int], float]] | None:
    """Sequences longest first, each on the group of ``sizes`` (large enough, with memory left) where
    it finishes first; None if one fits no group."""
    load, tokens = [0.0] * len(sizes), [0] * len(sizes)
    seqs: list[list[int]] = [[] for _ in sizes]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        x = lengths[i]
        room = [g for g, p in enumerate(sizes) if tokens[g] + x <= p * cost.tokens_per_gpu]
        if not room:
            return None
        g = min(room, key=lambda g: (load[g] + cost.seq_ms(x, sizes[g]), g))
        load[g] += cost.seq_ms(x, sizes[g])
        tokens[g] += x
        seqs[g].append(i)
    return [(p, seqs[g], load[g]) for g, p in enumerate(sizes)]


def static_groups(lengths: Sequence[int], n: int, size: int, cost: SPCost) -> SPPlan | None:
    """``n / size`` groups of ``size``, sequences longest first on the group that finishes first
    among those with memory left (LPT); None if a sequence fits no group's memory."""
    _check(lengths, n)
    if size < 1 or size > n or n % size:
        raise ValueError(f"SP degree {size} does not divide {n} ranks")
    got = _lpt(lengths, [size] * (n // size), cost)
    return None if got is None else _aligned(got)


def _key(plan: SPPlan) -> tuple[float, float, float]:
    """Shorter makespan first; among equal ones (to rounding), less GPU time (fewer all-to-alls),
    then the more even loads (slack for the runtime's noise)."""
    return (round(plan.makespan, 6), round(sum(g.size * g.ms for g in plan.groups), 6),
            sum(g.ms ** 2 for g in plan.groups))


def _fit(lengths: Sequence[int], n: int, cost: SPCost, limit: float) -> list[tuple[int, list[int], float]] | None:
    """Best-fit decreasing under makespan ``limit``: the groups, or None if they need more than n ranks."""
    groups: list[list] = []  # [size, tokens, ms, seqs]
    used = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length, need = lengths[i], cost.min_size(lengths[i])
        best, best_left = None, None
        for g in groups:
            if g[0] < need or g[1] + length > g[0] * cost.tokens_per_gpu:
                continue
            left = limit - g[2] - cost.seq_ms(length, g[0])
            if left >= 0 and (best_left is None or left < best_left):
                best, best_left = g, left
        if best is None:
            size = need
            while size <= n and cost.seq_ms(length, size) > limit:
                size *= 2
            if size > n or used + size > n:
                return None
            best = [size, 0, 0.0, []]
            groups.append(best)
            used += size
        best[1] += length
        best[2] += cost.seq_ms(length, best[0])
        best[3].append(i)
    return [(g[0], g[3], g[2]) for g in groups]


def adaptive_groups(lengths: Sequence[int], n: int, cost: SPCost,
                    degrees: Callable[[int], bool] | None = None, steps: int = SEARCH_STEPS) -> SPPlan | None:
    """The microbatch's groups of mixed sizes with the smallest makespan found (module docstring);
    None if no plan fits memory. ``degrees``: which static degrees to take as candidates (all);
    ``steps``: bisection steps."""
    _check(lengths, n)
    if not lengths:
        return SPPlan(())
    cost = cost if isinstance(cost, _Priced) else _Priced(cost)
    if max(cost.min_size(x) for x in lengths) > n:
        return None  # a sequence more than all n GPUs hold
    sizes = [1 << k for k in range(n.bit_length()) if (1 << k) <= n]
    statics = [p for p in (static_groups(lengths, n, s, cost) for s in sizes if degrees is None or degrees(s))
               if p is not None]
    best = min(statics, key=lambda p: p.makespan, default=None)
    # Bracket: no plan beats the longest sequence on all n ranks, or the whole work spread evenly.
    low = max(max(min(cost.seq_ms(x, s) for s in sizes if s >= cost.min_size(x)) for x in lengths),
              sum(cost.seq_ms(x, 1) for x in lengths) / n)
    high = best.makespan if best is not None else 2 * low
    found = _fit(lengths, n, cost, high)
    if found is None and best is None:  # widen until something fits (memory permitting)
        for _ in range(60):
            found = _fit(lengths, n, cost, high)
            if found is not None:
                break
            high *= 2
        if found is None:
            return None
    for _ in range(steps):
        mid = (low + high) / 2
        got = _fit(lengths, n, cost, mid)
        if got is None:
            low = mid
        else:
            high, found = mid, got
    if found is None:
        return best
    # Ranks the search left free become SP 1 groups, and the sequences are spread again over all groups.
    sizes = [size for size, _, _ in found] + [1] * (n - sum(size for size, _, _ in found))
    spread = _lpt(lengths, sorted(sizes, reverse=True), cost)
    plans = [p for p in (_aligned(found), spread and _aligned(spread), best) if p]
    return min(plans, key=_key)


class _Priced:
    """An ``SPCost`` whose ``seq_ms`` is computed once per (length, size): the group search asks
    for the same few dozen pairs at every bisection step."""

    def __init__(self, cost: SPCost):
        self.tokens_per_gpu, self.min_size, self._cost = cost.tokens_per_gpu, cost.min_size, cost
        self._ms: dict[tuple[int, int], float] = {}

    def seq_ms(self, length: int, size: int) -> float:
        key = (length, size)
        if key not in self._ms:
            self._ms[key] = self._cost.seq_ms(length, size)
        return self._ms[key]


def _buddies(free: int) -> list[int]:
    """Powers of two summing to ``free``, largest first (aligned one after another)."""
    return [1 << k for k in reversed(range(free.bit_length())) if free >> k & 1]


def covering_groups(lengths: Sequence[int], n: int, cost: SPCost, steps: int = SEARCH_STEPS) -> SPPlan | None:
    """What the runtime runs: ``adaptive_groups`` made to cover every one of the ``n`` ranks with a
    group that holds at least one sequence (ranks the plan leaves idle form groups of their own;
    where sequences are fewer than groups, the two smallest groups merge); None if no plan fits."""
    _check(lengths, n)
    if len(lengths) < 1:
        raise ValueError("a microbatch needs at least one sequence")
    cost = _Priced(cost)
    plan = adaptive_groups(lengths, n, cost, steps=steps)
    if plan is None:
        return None
    used = [g.size for g in plan.groups if g.seqs]
    sizes = sorted(used + _buddies(n - sum(used)), reverse=True)
    while len(sizes) > len(lengths):  # the two smallest are buddies (both end the aligned layout)
        sizes[-2:] = [2 * sizes[-1]]
        sizes.sort(reverse=True)
    groups = _lpt(lengths, sizes, cost)
    if groups is None:
        return None
    for g in range(len(groups)):  # an empty group takes the shortest sequence of the fullest one
        if groups[g][1]:
            continue
        donor = max(range(len(groups)), key=lambda h: (len(groups[h][1]), -h))
        i = min(groups[donor][1], key=lambda i: (lengths[i], i))
        if lengths[i] > groups[g][0] * cost.tokens_per_gpu:
            return None
        groups[donor][1].remove(i)
        groups[g][1].append(i)
    return _aligned([(size, seqs, sum(cost.seq_ms(lengths[i], size) for i in seqs)) for size, seqs, _ in groups])
