"""One callback per concern of the training loop (``runtime/trainer.py`` calls them in list order):
``metrics`` (step figures, MFU, metrics.jsonl / wandb), ``balance``, ``checkpoint``, ``trace``,
``emulation``, ``preemption``, ``guard`` (non-finite loss), ``evaluation``, ``health``.

Import them from their modules: the pipeline-only ones import DeepSpeed, the reference layout does not.
"""
