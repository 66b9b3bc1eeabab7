"""What ``disttrain-launch`` checks before it starts the ``deepspeed`` launcher: the hostfile and the
slots it picks (``hostfile``), whether the recipe's layout fits them (``layout_fit``), and whether the
remote hosts answer (``reachability``)."""
