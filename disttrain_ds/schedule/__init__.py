"""The 1F1B schedule as the engines run it (``onef1b.py``) and as it is simulated (``simulate.py``,
``sweep.py``), emulated runs replayed in the simulator (``replay.py``), and the one trace format
(``timeline.py``: Chrome trace, Gantt)."""
