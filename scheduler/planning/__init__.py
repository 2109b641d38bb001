"""Admission and planning: durable admission in seq order, the batching policy, one lane per trainer, the cycle
loop and recovery. Builds on workers, tenancy and db; knows nothing of the servicer."""
