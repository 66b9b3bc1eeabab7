"""Backward work as a multiple of forward work: the one place the ratio is written.

A trained module's backward computes the input gradient and the weight gradient, each about one
forward; a frozen module that still passes gradients to a trained module upstream computes the
input gradient only; a frozen module with nothing trained upstream runs forward only. The cost
model, the emulated compute, the planner's stage times and the FLOPs / MFU figures all take it from
here.
"""

from __future__ import annotations

BACKWARD_FACTOR = 2.0
"""Backward of a trained module, as a multiple of its forward (no recomputation)."""
PASSTHROUGH_BACKWARD_FACTOR = 1.0
"""Backward of a frozen module that passes gradients upstream (input gradient only)."""

MODE_MULTIPLIER: dict[str, float] = {
    "train": 1.0 + BACKWARD_FACTOR,
    "frozen_passthrough": 1.0 + PASSTHROUGH_BACKWARD_FACTOR,
    "frozen": 1.0,
}
"""Work of one training pass over a module, in forwards, by how the module takes part."""
