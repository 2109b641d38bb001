"""Numbers the scheduler's cycles and the trainer's RunCycle agree on (no protobuf, no torch)."""

# A trainer keeps its last answers per run so that a cycle re-sent after a lost answer is answered
# from memory instead of applied twice; the scheduler never puts more of one run's items in a cycle.
ITEMS_PER_RUN_PER_CYCLE = 16
