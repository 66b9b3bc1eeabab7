"""``disttrain-report``'s pieces: run directories read (``runs``), figures drawn (``figures``), summary
table and HTML page (``summary``). The command itself is ``cli/report.py``."""
