"""Measuring each module's costs for the planner (``measure.py``) and tensor-parallel costs with
torchrun workers (``tp.py``)."""
