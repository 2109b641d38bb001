"""The Tinker gateway: the official ``tinker`` SDK's HTTP protocol in front of the scheduler's gRPC API.

Holds no training state, only in-flight futures (futures.py) and two small lookups the gRPC API does
not offer yet (app.py: samplers' base models, the seq offset of runs made from a checkpoint).
"""
