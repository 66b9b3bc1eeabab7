"""The assembled multimodal model: its spec, microbatch tensors, losses and the single-process
reference (``model.py``), pretrained weights read through a family's key map (``weights.py``), and
the flex-attention warm-up (``flex_warmup.py``)."""
