"""A recipe's per-rank memory before anything runs: parameters, gradients, optimizer states and
activations (``memory.py``, ``activations.py``), the CUDA allowance (``gpu_allowance.py``), and the
check against the device (``memory_check.py``)."""
