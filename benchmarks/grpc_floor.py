"""The transport's floor: Temper's public gRPC service answered by a process that does nothing else.

A grpc.aio server (same options as every Temper server, ``common/server_options.py``) registers
``temper.v1.Temper`` with a servicer whose CreateSession, CreateTrainingRun, ForwardBackward and
OptimStep answer at once with an empty response: no interceptor, no auth, no admission, no
database, no trainer. ``scaleout.py`` drives it with the same clients, requests and window as the
scheduler's ceiling, side by side in one run, so the ceiling reads as a fraction of what one
Python gRPC server process can answer on the same machine at the same moment; an absolute
verbs/s depends on the machine and on what else it runs.

    python benchmarks/grpc_floor.py --bind 127.0.0.1:0    # prints TEMPER_READY grpc_floor port=...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid

import grpc

from temper.common.server_options import CHANNEL_OPTIONS
from temper.v1 import service_pb2, service_pb2_grpc, types_pb2


class InstantTemper(service_pb2_grpc.TemperServicer):
    """Every verb the ceiling sends, answered with an empty response (ids made up)."""

    async def CreateSession(self, request, context):
        return service_pb2.Session(session_id=str(uuid.uuid4()))

    async def CreateTrainingRun(self, request, context):
        return service_pb2.TrainingRunInfo(training_run_id=str(uuid.uuid4()), next_seq_id=1)

    async def ForwardBackward(self, request, context):
        return types_pb2.ForwardBackwardOutput()

    async def OptimStep(self, request, context):
        return service_pb2.OptimStepResponse()


async def serve(bind: str) -> None:
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    service_pb2_grpc.add_TemperServicer_to_server(InstantTemper(), server)
    port = server.add_insecure_port(bind)
    await server.start()
    print(f"TEMPER_READY grpc_floor port={port} pid={os.getpid()}", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bind", default="127.0.0.1:0")
    asyncio.run(serve(parser.parse_args(argv).bind))


if __name__ == "__main__":
    main()
