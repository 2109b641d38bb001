"""Temper: an open post-training service (the Tinker verbs over gRPC).

Import roots: ``temper.client`` (researcher side, no torch), ``temper.v1`` (generated
protobuf stubs), ``temper.scheduler`` and ``temper.services`` (server side), ``temper.localstack``
(the three processes on loopback, for development and tests).
"""

__version__ = "0.1.0"
