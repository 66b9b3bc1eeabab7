"""Reading training step directories as whole tensors (any DP / TP / PP layout) and exporting them
to the Hugging Face / diffusers formats: ``read.py`` (step directory -> ``layer/param`` tensors),
``hf.py`` (a family's whole transformers / diffusers model and its key map), ``export.py``
(``disttrain-export``)."""
