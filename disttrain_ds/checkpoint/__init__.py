"""Every checkpoint file kind: step directories and resume checks (``steps.py``), pickle-free
files (``files.py``), DeepSpeed's safe loader (``engine.py``), checksummed manifests
(``manifest.py``), resuming under another layout (``reshard.py``, ``reshard_shards.py``), reading a
step directory of any layout as whole tensors (``read.py``) and exporting it to Hugging Face /
diffusers directories (``export.py``)."""
