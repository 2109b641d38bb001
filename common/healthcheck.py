"""Container health probe: exit 0 when a Temper gRPC server reports SERVING.

Usage: ``python -m temper.common.healthcheck 127.0.0.1:50061 [service] [--timeout SECONDS]``.
The service name defaults to "" (the server as a whole), which ``common.server.mark_serving`` sets.
A server with TLS: ``--ca FILE`` (and ``--cert FILE --key FILE`` where it requires client
certificates; ``--server-name NAME`` when its certificate does not name the address's host).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from temper.common.tls import channel_credentials


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the gRPC server")
    parser.add_argument("service", nargs="?", default="", help="service name to check (default: whole server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--ca", help="PEM CA of a TLS server (TLS when set)")
    parser.add_argument("--cert", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--key", help="PEM private key of --cert")
    parser.add_argument("--server-name", default="", help="host name the server's certificate is checked against")
    args = parser.parse_args(argv)
    try:
        with _channel(args) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _channel(args) -> grpc.Channel:
    if args.ca is None:
        return grpc.insecure_channel(args.address)
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(args.address, channel_credentials(args.ca, args.cert, args.key), options=options)


if __name__ == "__main__":
    sys.exit(main())
