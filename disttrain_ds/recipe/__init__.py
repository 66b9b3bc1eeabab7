"""The recipe: its dataclasses and loader (``schema.py``), the module graph it describes
(``graph.py``), cross-section checks (``checks.py``) and the DeepSpeed config each engine gets
(``deepspeed.py``)."""
