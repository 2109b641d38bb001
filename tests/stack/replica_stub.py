"""A stand-in scheduler replica for tests/stack/test_replica_target.py: a gRPC server of the Temper
service that answers GetServerCapabilities with one model named after itself (so a caller can tell
which replica answered) after a short pause (so calls are in flight when a replica is killed).
Run as ``python replica_stub.py NAME``; prints its port, then serves until killed."""

import sys
import time
from concurrent import futures

import grpc

from temper.v1 import service_pb2, service_pb2_grpc


class Replica(service_pb2_grpc.TemperServicer):
    def __init__(self, name: str):
        self.name = name

    def GetServerCapabilities(self, request, context):
        time.sleep(0.01)
        return service_pb2.GetServerCapabilitiesResponse(supported_models=[service_pb2.SupportedModel(model_name=self.name)])


if __name__ == "__main__":
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    service_pb2_grpc.add_TemperServicer_to_server(Replica(sys.argv[1]), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()
