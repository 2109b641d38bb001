"""The durable floor: ``grpc_floor.py``'s bare server plus the least durable work a sequenced verb
needs before it is answered, and nothing else: no auth, no validation, no scheduler, no trainer.

Each ForwardBackward / OptimStep is serialized (the request log's payload) and queued; one writer
takes what is queued and, on a thread, commits it to PostgreSQL as one multi-row INSERT (admission:
acknowledged work is durable), then commits the rows' results as one UPDATE (the outcome recorded
before the answer, for exactly-once resends), then answers them. Two transactions per group, as
Temper's scheduler has (its group commit and its cycle's finish). ``scaleout.py --durable-floor``
drives it beside the bare server and the scheduler: what one Python process can answer here when
every verb is written twice to Postgres, an upper bound for any scheduler of this design.

    python benchmarks/durable_floor.py --bind 127.0.0.1:0 --database-url postgresql://...
"""

from __future__ import annotations

import argparse
import asyncio
import os

import grpc
import psycopg2
from psycopg2.extras import execute_values

from grpc_floor import InstantTemper  # this script's folder is first on sys.path
from temper.common.server_options import CHANNEL_OPTIONS
from temper.v1 import service_pb2, service_pb2_grpc, types_pb2

SCHEMA = ("CREATE TABLE IF NOT EXISTS floor_requests (run text, seq bigint, kind text, payload bytea, result bytea, "
          "PRIMARY KEY (run, seq))")
INSERT = "INSERT INTO floor_requests (run, seq, kind, payload) VALUES %s"
FINISH = ("UPDATE floor_requests AS r SET result = v.result FROM (VALUES %s) AS v(run, seq, result) "
          "WHERE r.run = v.run AND r.seq = v.seq")


class GroupWriter:
    """Requests queued while a write is under way go together in the next one."""

    def __init__(self, url: str):
        self.connection = psycopg2.connect(url.replace("postgresql+psycopg2://", "postgresql://"))
        with self.connection, self.connection.cursor() as cursor:
            cursor.execute(SCHEMA)
        self.pending: list[tuple[tuple, asyncio.Future]] = []
        self.wake = asyncio.Event()

    async def write(self, run: str, seq: int, kind: str, payload: bytes) -> None:
        future = asyncio.get_running_loop().create_future()
        self.pending.append(((run, seq, kind, payload), future))
        self.wake.set()
        await future

    async def run_forever(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            group, self.pending = self.pending, []
            try:
                await asyncio.to_thread(self._commit, [row for row, _ in group])
            except Exception as exc:  # noqa: BLE001 - each caller gets the database's error
                for _, future in group:
                    future.set_exception(exc)
                continue
            for _, future in group:
                future.set_result(None)

    def _commit(self, rows: list[tuple]) -> None:
        with self.connection, self.connection.cursor() as cursor:
            execute_values(cursor, INSERT, rows, page_size=len(rows))
        with self.connection, self.connection.cursor() as cursor:
            execute_values(cursor, FINISH, [(run, seq, b"") for run, seq, _, _ in rows], page_size=len(rows))


class DurableTemper(InstantTemper):
    def __init__(self, writer: GroupWriter):
        self.writer = writer

    async def ForwardBackward(self, request, context):
        await self.writer.write(request.training_run_id, request.seq_id, "forward_backward",
                                request.SerializeToString(deterministic=True))
        return types_pb2.ForwardBackwardOutput()

    async def OptimStep(self, request, context):
        await self.writer.write(request.training_run_id, request.seq_id, "optim_step", request.SerializeToString(deterministic=True))
        return service_pb2.OptimStepResponse()


async def serve(bind: str, database_url: str) -> None:
    writer = GroupWriter(database_url)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    service_pb2_grpc.add_TemperServicer_to_server(DurableTemper(writer), server)
    port = server.add_insecure_port(bind)
    await server.start()
    task = asyncio.create_task(writer.run_forever())
    print(f"TEMPER_READY durable_floor port={port} pid={os.getpid()}", flush=True)
    try:
        await server.wait_for_termination()
    finally:
        task.cancel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bind", default="127.0.0.1:0")
    parser.add_argument("--database-url", required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.bind, args.database_url))


if __name__ == "__main__":
    main()
