"""Reordering samples for balance: inside a microbatch over DP replicas (``intra.py``), across
microbatches to hide stragglers (``inter.py``), per module (``module_balance.py``), keeping samples
on the host that read them (``host.py``, ``host_order.py``), and the balance figures (``balance.py``)."""
