"""ImportCheckpoint's steps (scheduler/api/import_verbs.py) against a fake trainer and store: a failure at
any step removes what the steps before it made (the adapter, every file that may have been
written) and adds no row; a caller that goes away mid-way leaves the import whole."""

import asyncio
import json

import pytest

from fakes_scheduler import VerbAdmission
from temper.common.errors import InvalidArgument, NotFound, Unavailable
from temper.common.uploads import file_chunks
from temper.scheduler.tenancy.auth import reset_caller, set_caller
from temper.scheduler.api.import_verbs import ImportVerbs
from temper.scheduler.db.catalog import RunNumber
from temper.v1 import service_pb2, trainer_pb2, types_pb2

MODEL = "tiny"
FILES = {"adapter_config.json": json.dumps({"base_model_name_or_path": MODEL}).encode(), "adapter_model.safetensors": b"w" * 10}


class Trainer:
    """Records the calls; ``fail_at``: that call fails (ImportAdapter refused with nothing written; the
    others UNAVAILABLE after their effect, an answer lost)."""

    address = "trainer:1"

    def __init__(self, fail_at: str | None = None, gate: asyncio.Event | None = None):
        self.fail_at, self.gate = fail_at, gate
        self.calls, self.files, self.adapters, self.call_fails = [], set(), set(), set()

    async def import_adapter(self, key, files):
        self.calls.append("ImportAdapter")
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_at == "ImportAdapter":
            raise InvalidArgument("bad adapter")
        self.files.add(key)
        return trainer_pb2.ImportAdapterResponse(size_bytes=10, lora_config=types_pb2.LoraConfig(rank=4, alpha=8, train_attn=True))

    async def call(self, method, request):
        self.calls.append(method)
        if method == "CreateAdapter":
            self.adapters.add(request.training_run_id)
        elif method == "DropAdapter":
            self.adapters.discard(request.training_run_id)
        elif method == "SaveAdapter":
            self.files.add(request.checkpoint_key)
        elif method == "DeleteCheckpoint":
            self.files.discard(request.checkpoint_key)
        if method == self.fail_at or method in self.call_fails:
            raise Unavailable(f"{method}: connection reset")
        return trainer_pb2.SaveAdapterResponse(size_bytes=12) if method == "SaveAdapter" else None

    async def snapshot(self, run_id, key):
        self.calls.append("SnapshotAdapter")
        self.files.add(key)
        if self.fail_at == "SnapshotAdapter":
            raise Unavailable("SnapshotAdapter: connection reset")


class Store:
    def __init__(self, fail: bool = False):
        self.fail, self.added, self.next_run = fail, [], 0

    def open_session(self, session_id, tenant):
        if (session_id, tenant) != ("s", "alice"):
            raise NotFound(f"session {session_id!r} not found")

    def reserve_run(self, session_id, index=None):
        self.next_run += 1
        return RunNumber(f"{session_id}:train:{self.next_run - 1}", self.next_run - 1, self.next_run - 1)

    def give_back_run(self, session_id, number):
        assert self.next_run == number.number + 1
        self.next_run = number.previous
        return True

    def open_training_runs(self, tenant):
        return 0

    def storage_bytes(self, tenant):
        return 0

    def add_imported_run(self, row, checkpoints, tenant="", actor=None):
        if self.fail:
            raise Unavailable("the database did not answer")
        self.added.append((row, checkpoints))
        return checkpoints


class Backends:
    def __init__(self, trainer):
        self.trainer, self.placed = trainer, {}

    async def wait_ready(self):
        return None

    def place(self, base_model):
        if base_model != MODEL:
            raise NotFound(f"no trainer serves base model {base_model!r}")
        return self.trainer

    def model_names(self):
        return [MODEL]

    def remember_placement(self, run_id, address):
        self.placed[run_id] = address


class Runs:
    def __init__(self):
        self.added = []

    def add(self, row, tenant):
        self.added.append((row.id, tenant))
        return row


class Importer(ImportVerbs):
    def __init__(self, trainer, store):
        self.backends, self.store, self.admission, self.runs = Backends(trainer), store, VerbAdmission(), Runs()
        self._creating_runs = {"alice": asyncio.Lock()}

    def _run_info(self, row):
        return service_pb2.TrainingRunInfo(training_run_id=row.id)


async def messages(session_id="s", name="mine", save_state=True, files=FILES):
    yield service_pb2.ImportCheckpointChunk(header=service_pb2.ImportCheckpointHeader(session_id=session_id, name=name,
                                                                                      save_state=save_state))
    for chunk in file_chunks(files):
        yield service_pb2.ImportCheckpointChunk(file=chunk)


def run_as(tenant, coro):
    async def main():
        token = set_caller(tenant)
        try:
            return await coro()
        finally:
            reset_caller(token)

    return asyncio.run(main())


def test_an_import_makes_the_run_its_adapter_and_its_checkpoints():
    trainer, store = Trainer(), Store()
    api = Importer(trainer, store)
    response = run_as("alice", lambda: api.ImportCheckpoint(messages(), None))
    assert response.checkpoint.path == "tinker://s:train:0/sampler_weights/mine"
    assert response.state_checkpoint.path == "tinker://s:train:0/weights/mine"
    assert trainer.calls == ["ImportAdapter", "CreateAdapter", "LoadAdapter", "SaveAdapter", "SnapshotAdapter"]
    assert trainer.files == {"s:train:0/sampler_weights/mine", "s:train:0/weights/mine", "s:train:0/snapshots/0-t"}
    (row, checkpoints), = store.added
    assert (row.lora_rank, row.lora_alpha, row.train_attn, row.train_mlp, row.seed, row.snapshot_key) == (4, 8, True, False, None,
                                                                                                         "s:train:0/snapshots/0-t")
    assert [(c.kind, c.size_bytes) for c in checkpoints] == [("sampler", 10), ("training", 12)]
    assert api.runs.added == [("s:train:0", "alice")] and api.backends.placed == {"s:train:0": "trainer:1"}


@pytest.mark.parametrize("fail_at", ["ImportAdapter", "CreateAdapter", "LoadAdapter", "SaveAdapter", "SnapshotAdapter", "database"])
def test_a_failure_at_any_step_undoes_the_steps_before_it(fail_at):
    trainer, store = Trainer(fail_at=fail_at if fail_at != "database" else None), Store(fail=fail_at == "database")
    api = Importer(trainer, store)
    with pytest.raises(InvalidArgument if fail_at == "ImportAdapter" else Unavailable):
        run_as("alice", lambda: api.ImportCheckpoint(messages(), None))
    assert trainer.files == set() and trainer.adapters == set()
    assert store.added == [] and api.runs.added == [] and api.backends.placed == {}
    assert store.next_run == 0  # the run number is given back: the session's counter as before
    assert ("DropAdapter" in trainer.calls) == (fail_at != "ImportAdapter")  # no adapter was asked for before it


def test_a_number_whose_leftovers_could_not_be_removed_stays_skipped():
    trainer, store = Trainer(fail_at="SnapshotAdapter"), Store()
    trainer.call_fails = {"DeleteCheckpoint"}
    api = Importer(trainer, store)
    with pytest.raises(Unavailable):
        run_as("alice", lambda: api.ImportCheckpoint(messages(), None))
    assert store.next_run == 1  # a later run of this number could meet the files still on the trainer


@pytest.mark.parametrize("case", ["not your session", "bad name", "no header", "unknown model"])
def test_refusals_before_the_trainer_is_called(case):
    trainer, store = Trainer(), Store()
    api = Importer(trainer, store)
    stream = {
        "not your session": lambda: messages(session_id="bobs"),
        "bad name": lambda: messages(name="a/b"),
        "no header": lambda: (m async for m in messages() if m.WhichOneof("payload") == "file"),
        "unknown model": lambda: messages(files={**FILES, "adapter_config.json": b'{"base_model_name_or_path": "other"}'}),
    }[case]
    with pytest.raises(NotFound if case == "not your session" else InvalidArgument):
        run_as("alice", lambda: api.ImportCheckpoint(stream(), None))
    assert trainer.calls == [] and store.next_run == 0 and store.added == []


def test_a_caller_that_goes_away_leaves_the_import_whole():
    gate = asyncio.Event()
    trainer, store = Trainer(gate=gate), Store()
    api = Importer(trainer, store)

    async def main():
        call = asyncio.ensure_future(api.ImportCheckpoint(messages(), None))
        while not trainer.calls:
            await asyncio.sleep(0.01)
        call.cancel()  # the client hung up while the trainer checks the files
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(100):
            if store.added:
                break
            await asyncio.sleep(0.01)

    run_as("alice", main)
    assert len(store.added) == 1 and trainer.adapters == {"s:train:0"}
