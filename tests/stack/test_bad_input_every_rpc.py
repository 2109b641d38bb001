"""Bad input for every RPC of the public service, generated from its descriptor rather than listed by
hand, so that a verb added later is covered the day it lands. Each request starts from valid ids (a
real session, run, checkpoint and sampling client of the caller) and has one field made bad: NUL,
control characters, 100,000 characters, a path that climbs out of its folder, negative or huge
integers, NaN and infinities, bytes that are not what they claim.

Every answer is OK or a refusal with a client-side status (never INTERNAL, UNKNOWN, UNAVAILABLE or a
deadline) whose message is short and carries no SQL, driver text or NUL; a NUL or an over-long string
is always refused; and a refused call changes nothing: no row of any table and no file under the
checkpoints folder differs afterwards."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from sqlalchemy import create_engine, inspect, text

from fixtures_stack import raw_stub, sft_datum
from temper.client import AdamParams, ModelInput, convert
from temper.v1 import service_pb2

SERVICE = service_pb2.DESCRIPTOR.services_by_name["Temper"]
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED}
ALWAYS_REFUSED = ("nul", "huge")  # string variants no field may accept
STRINGS = {"nul": "a\x00b", "control": "x\x07\x1by", "huge": "x" * 100_000, "climb": "../../../../etc/passwd"}
INTS = {"negative": -1, "huge int": 2**62 + 5}
FLOATS = {"nan": math.nan, "inf": math.inf, "-huge": -1e300}
BYTES = {"garbage bytes": b"\xff\x00\x13" * 7}
SKIPPED_FIELDS = {"seq_id"}  # a sequenced request's seq is given by the test (a refusal spends it)
# volatile by design: read or touched by any authenticated call, refused or not
VOLATILE_COLUMNS = {("api_keys", "last_used_at"), ("sessions", "last_heartbeat_at")}


def _is_repeated(field) -> bool:
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == F.LABEL_REPEATED


def _set(message, field, value) -> None:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        target = getattr(message, field.name)
        if value_field.type == F.TYPE_MESSAGE:
            target[value if key_field.type == F.TYPE_STRING else 1]  # an empty value under a bad key
        elif key_field.type == F.TYPE_STRING and isinstance(value, str):
            target[value] = "v" if value_field.type == F.TYPE_STRING else 0
            if value_field.type == F.TYPE_STRING:
                target["k"] = value
        return
    if _is_repeated(field):
        getattr(message, field.name).append(value)
    else:
        setattr(message, field.name, value)


def _values(field):
    if field.type == F.TYPE_STRING:
        return STRINGS
    if field.type == F.TYPE_BYTES:
        return BYTES
    if field.type in (F.TYPE_INT32, F.TYPE_INT64, F.TYPE_SINT32, F.TYPE_SINT64, F.TYPE_SFIXED32, F.TYPE_SFIXED64):
        return {k: v for k, v in INTS.items() if field.type not in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32) or abs(v) < 2**31}
    if field.type in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64):
        return {"huge int": 2**31 - 1 if field.type in (F.TYPE_UINT32, F.TYPE_FIXED32) else 2**62 + 5}
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return FLOATS
    if field.type == F.TYPE_ENUM:
        return {"unknown enum": 9999}
    return {}


def variants(base, depth: int = 0):
    """(label, field path, request): ``base`` with one field made bad, nested messages to one level."""
    for field in base.DESCRIPTOR.fields:
        if field.name in SKIPPED_FIELDS:
            continue
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        if field.type == F.TYPE_MESSAGE and not is_map:
            if depth == 0 and not _is_repeated(field):
                nested = type(base)()
                nested.CopyFrom(base)
                for label, path, inner in variants(getattr(nested, field.name), depth + 1):
                    request = type(base)()
                    request.CopyFrom(nested)
                    getattr(request, field.name).CopyFrom(inner)
                    yield label, f"{field.name}.{path}", request
            continue
        if is_map:
            key_type = field.message_type.fields_by_name["key"].type
            values = STRINGS if key_type == F.TYPE_STRING else {}
        else:
            values = _values(field)
        for label, value in values.items():
            request = type(base)()
            request.CopyFrom(base)
            request.ClearField(field.name)
            _set(request, field, value)
            yield label, field.name, request


class Snapshots:
    """Every table's rows (volatile columns left out) and every file under the checkpoints folder; the
    tables' columns are read once (no call changes the schema)."""

    def __init__(self, url: str, checkpoints: Path):
        self.engine, self.checkpoints = create_engine(url), checkpoints
        with self.engine.connect() as conn:
            found = inspect(conn)
            self.queries = {table: "SELECT " + ", ".join(f'"{c["name"]}"' for c in found.get_columns(table)
                                                         if (table, c["name"]) not in VOLATILE_COLUMNS) + f' FROM "{table}"'
                            for table in found.get_table_names()}

    def take(self) -> dict:
        out = {}
        with self.engine.connect() as conn:
            for table, query in self.queries.items():
                out[table] = sorted(tuple(repr(bytes(v) if isinstance(v, memoryview) else v) for v in row)
                                    for row in conn.execute(text(query)))
        out["files"] = sorted((str(p.relative_to(self.checkpoints)), p.stat().st_size)
                              for p in self.checkpoints.rglob("*") if p.is_file())
        return out


def call(stub, method, request, timeout: float = 30):
    rpc = getattr(stub, method.name)
    if method.client_streaming:
        return rpc(iter([request]), timeout=timeout)
    if method.server_streaming:
        return list(rpc(request, timeout=timeout))
    return rpc(request, timeout=timeout)


@pytest.fixture(scope="module")
def world(stack, tiny_model_dir):
    """The caller's valid ids: a session, a run with a step, a sampler checkpoint and an in-flight version, a
    sampling client."""
    client = stack.client()
    run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=3)
    run.forward_backward([sft_datum([5, 9, 17, 33, 2])], "cross_entropy").result()
    run.optim_step(AdamParams(learning_rate=1e-3)).result()
    path = run.save_weights_for_sampler("corpus").result().path
    run.save_weights_inflight().result()  # the run has an in-flight target (docs/async_rl.md): no bad input may move it
    sampler = client.create_sampling_client(model_path=path)
    yield {"session_id": client.session_id, "training_run_id": run.model_id, "path": path, "base_model": tiny_model_dir,
           "sampler_id": sampler.sampler_id}
    client.close()


def base_request(method, world: dict, seq: int):
    """A valid request of ``method`` as far as the caller's ids and a small payload make it one."""
    request = method.input_type._concrete_class()
    fields = request.DESCRIPTOR.fields_by_name
    for name in ("session_id", "training_run_id", "path", "model_path", "base_model", "sampler_id"):
        if name in fields and fields[name].type == F.TYPE_STRING and not _is_repeated(fields[name]):
            setattr(request, name, world[name if name != "model_path" else "path"])
    if "seq_id" in fields:
        request.seq_id = seq
    if method.name == "ForwardBackward":
        request.data.append(convert.datum_to_proto(sft_datum([5, 9, 17, 33, 2])))
        request.loss_fn = "cross_entropy"
    if method.name == "OptimStep":
        request.adam_params.learning_rate = 1e-4
    if method.name in ("Sample", "SampleStream", "ComputeLogprobs"):
        request.prompt.CopyFrom(convert.model_input_to_proto(ModelInput.from_ints([5, 9, 17])))
        if "num_samples" in fields:
            request.num_samples = 1
            request.sampling_params.max_tokens = 2
    return request


def test_every_rpc_refuses_bad_input_cleanly_and_changes_nothing(stack, world, postgres_url):
    stub = raw_stub(stack)
    checkpoints = Path(stack.data_dir) / "checkpoints"
    problems, calls = [], 0
    snapshots, before = Snapshots(postgres_url, checkpoints), None
    for method in SERVICE.methods:
        sequenced = "seq_id" in method.input_type.fields_by_name
        for label, field, request in variants(base_request(method, world, 0)):
            if sequenced:
                request.seq_id = _next_seq(stub, world)
            before = before or snapshots.take()  # a refusal changes nothing, so its "after" is the next "before"
            calls += 1
            try:
                call(stub, method, request)
                outcome = None
            except grpc.RpcError as err:
                outcome = err
            what = f"{method.name}({field}={label})"
            if outcome is None:
                before = None  # an accepted call may change things
                if label in ALWAYS_REFUSED and method.input_type.fields_by_name.get(field.split(".")[0]) is not None:
                    problems.append(f"{what}: accepted")
                continue
            details = outcome.details() or ""
            if outcome.code() not in CLIENT_CODES:
                problems.append(f"{what}: {outcome.code().name} {details[:200]!r}")
            if len(details) >= 400 or any(word in details for word in ("SELECT", "INSERT", "UPDATE ", "psycopg2", "sqlalchemy", "\x00",
                                                                        "Traceback")):
                problems.append(f"{what}: message {details[:200]!r}")
            after = snapshots.take()
            changed = [key for key in before if before[key] != after.get(key)]
            if changed:
                diff = {key: (sorted(set(before[key]) - set(after[key]))[:1], sorted(set(after[key]) - set(before[key]))[:1]) for key in changed}
                problems.append(f"{what}: refused ({outcome.code().name}) but changed {diff}")
            before = after
    assert calls > 250, calls  # every RPC, every field
    assert not problems, f"{len(problems)} of {calls} calls:\n" + "\n".join(problems)


def _next_seq(stub, world) -> int:
    """The run's next expected seq, as the scheduler tells it (GetInfo), so a refusal spends only its own."""
    info = stub.GetInfo(service_pb2.GetInfoRequest(training_run_id=world["training_run_id"]), timeout=30)
    return info.next_seq_id
