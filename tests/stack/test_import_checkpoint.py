"""Bringing your own adapter (ImportCheckpoint) on the real three-process stack: the files of a run
trained here, downloaded by one tenant and imported by another, sample and load exactly as the
original; bad files, someone else's session and a full quota are refused with nothing left behind
(no run row, checkpoint row, run number, folder or file)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import load, load_file, save
from sqlalchemy import create_engine, text

from fixtures_stack import adapter_weights, assert_same_weights, raw_stub, sft_datum
from temper.client import AdamParams, InvalidArgument, ModelInput, SamplingParams
from temper.common.checkpoints import WEIGHT_FILES
from temper.common.uploads import file_chunks
from temper.scheduler.db.store import Store
from temper.v1 import service_pb2

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
ADAM = AdamParams(learning_rate=2e-2)
CONFIG, WEIGHTS = WEIGHT_FILES


@pytest.fixture(scope="module")
def exported(stack, tiny_model_dir, tmp_path_factory):
    """alice's run trained a few steps, its sampler checkpoint, and that checkpoint's files."""
    with stack.client("imp-alice") as alice:
        run = alice.create_lora_training_client(tiny_model_dir, rank=4, seed=3, train_mlp=False)
        for _ in range(3):
            run.forward_backward([sft_datum(PATTERN)]).result()
            run.optim_step(ADAM).result()
        path = run.save_weights_for_sampler("trained").result().path
        folder = alice.download_checkpoint(path, tmp_path_factory.mktemp("alice") / "adapter")
        yield alice, path, folder


def test_an_imported_adapter_samples_and_loads_like_the_original(stack, exported, tiny_model_dir, tmp_path):
    alice, alice_path, folder = exported
    with stack.client("imp-bob") as bob:
        imported = bob.import_checkpoint(folder, "mine", save_state=True, user_metadata={"from": "alice"})
        run_id = imported.training_run_id
        assert imported.path == f"tinker://{run_id}/sampler_weights/mine"
        assert imported.state_path == f"tinker://{run_id}/weights/mine"
        assert imported.checkpoint.size_bytes == sum((folder / n).stat().st_size for n in WEIGHT_FILES)
        assert imported.checkpoint.user_metadata == {"from": "alice"}
        assert sorted(c.tinker_path for c in bob.list_checkpoints(run_id)) == sorted([imported.path, imported.state_path])
        info = bob.training_client(run_id).get_info()
        assert (info.lora_config.rank, info.lora_config.train_attn, info.lora_config.train_mlp,
                info.lora_config.train_unembed) == (4, True, False, True)
        # the imported files are the uploaded ones, byte for byte
        copy = bob.download_checkpoint(imported.path, tmp_path / "copy")
        assert all((copy / n).read_bytes() == (folder / n).read_bytes() for n in WEIGHT_FILES)

        # sampling: the same seed on alice's path and bob's import gives the same tokens and logprobs
        params = SamplingParams(max_tokens=8, seed=11, temperature=1.0, stop=[])
        prompt = ModelInput.from_ints(PATTERN[:5])
        want = alice.create_sampling_client(model_path=alice_path).sample(prompt, 2, params).result()
        got = bob.create_sampling_client(model_path=imported.path).sample(prompt, 2, params).result()
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
        assert [s.logprobs for s in got.sequences] == [s.logprobs for s in want.sequences]

        # load_state: into a new run (from state) and into a fresh run of the same shape: the weights exactly
        original = load_file(str(folder / WEIGHTS))
        restored = bob.create_training_client_from_state(imported.state_path).result()
        assert_same_weights(adapter_weights(bob, restored.save_weights_for_sampler("restored").result().path, tmp_path), original)
        fresh = bob.create_lora_training_client(tiny_model_dir, rank=4, seed=9, train_mlp=False)
        fresh.load_state(imported.state_path).result()
        assert_same_weights(adapter_weights(bob, fresh.save_weights_for_sampler("loaded").result().path, tmp_path), original)
        # and the imported run itself trains on
        trained = bob.training_client(run_id)
        trained.forward_backward([sft_datum(PATTERN)]).result()
        trained.optim_step(ADAM).result()


def _edit_config(files: dict[str, bytes], **changes) -> dict[str, bytes]:
    config = json.loads(files[CONFIG])
    config.update(changes)
    return {**files, CONFIG: json.dumps(config).encode()}


def _import(stub, session_id: str, files: dict[str, bytes], name: str = "imp") -> tuple[grpc.StatusCode, str]:
    header = service_pb2.ImportCheckpointHeader(session_id=session_id, name=name, save_state=True)
    messages = [service_pb2.ImportCheckpointChunk(header=header),
                *(service_pb2.ImportCheckpointChunk(file=chunk) for chunk in file_chunks(files))]
    try:
        stub.ImportCheckpoint(iter(messages), timeout=120)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def _everything(stack) -> dict:
    """Every run and checkpoint row, every session's run counter, and every folder and file (with its
    bytes) on the trainers' shared checkpoint folder."""
    engine = create_engine(stack.database_url)
    with engine.connect() as conn:
        runs = sorted(r[0] for r in conn.execute(text("select id from training_runs")))
        checkpoints = sorted(r[0] for r in conn.execute(text("select path from checkpoints")))
        counters = sorted(tuple(r) for r in conn.execute(text("select id, num_training_runs from sessions")))
    engine.dispose()
    root = Path(stack.data_dir) / "checkpoints"
    tree = {str(p): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}
    return {"runs": runs, "checkpoints": checkpoints, "run counters": counters, "tree": tree}


def _edit_weights(files: dict[str, bytes], edit) -> dict[str, bytes]:
    tensors = load(files[WEIGHTS])
    name = next(k for k in sorted(tensors) if k.endswith("lora_A.weight"))
    tensors[name] = edit(tensors[name])
    return {**files, WEIGHTS: save(tensors)}


def test_refused_imports_leave_nothing_behind(stack, exported, tiny_model_dir):
    alice, _, folder = exported
    files = {n: (folder / n).read_bytes() for n in WEIGHT_FILES}
    refused = {
        "corrupted weights": ({**files, WEIGHTS: files[WEIGHTS][: len(files[WEIGHTS]) // 2]}, "imp"),
        "flipped header": ({**files, WEIGHTS: b"\xff" * 8 + files[WEIGHTS][8:]}, "imp"),
        "other base model": (_edit_config(files, base_model_name_or_path="meta-llama/Llama-3-8B"), "imp"),
        "wrong rank": (_edit_config(files, r=8), "imp"),
        "not JSON": ({**files, CONFIG: b"{nope"}, "imp"),
        "missing weights": ({CONFIG: files[CONFIG]}, "imp"),
        "bad name": (files, "a/b"),
        # refused by the trainer, after the scheduler reserved the run's number: it is given back
        "NaN": (_edit_weights(files, lambda a: np.full_like(a, np.nan)), "imp"),
        "inf": (_edit_weights(files, lambda a: np.full_like(a, np.inf)), "imp"),
        "float64": (_edit_weights(files, lambda a: a.astype(np.float64)), "imp"),
        "wrong shape": (_edit_weights(files, lambda a: a[:-1]), "imp"),
        "DoRA": (_edit_config(files, use_dora=True), "imp"),
        "modules_to_save": (_edit_config(files, modules_to_save=["lm_head"]), "imp"),
        "rank 0": (_edit_config(files, r=0), "imp"),
        "huge rank": (_edit_config(files, r=1 << 20), "imp"),
        "garbage weights": ({**files, WEIGHTS: bytes(range(256)) * 8}, "imp"),
    }
    with stack.client("imp-carol") as carol:
        stub = raw_stub(stack, "imp-carol")
        before = _everything(stack)
        for case, (upload, name) in refused.items():
            code, details = _import(stub, carol.session_id, upload, name)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (case, code, details)
            assert _everything(stack) == before, case
        assert "expected (8, " in _import(stub, carol.session_id, refused["wrong rank"][0])[1]
        assert "Llama-3-8B" in _import(stub, carol.session_id, refused["other base model"][0])[1]
        # someone else's session: as absent as one that never existed
        assert _import(stub, alice.session_id, files)[0] == grpc.StatusCode.NOT_FOUND
        # the client refuses the same way
        with pytest.raises(InvalidArgument):
            carol.import_checkpoint(refused["wrong rank"][0], "imp")
        listed = stub.ListTrainingRuns(service_pb2.ListTrainingRunsRequest())
        assert listed.total_count == 0 and not stub.ListCheckpoints(service_pb2.ListCheckpointsRequest()).checkpoints
        assert _everything(stack) == before
        # and the same session still imports good files, under the number the refused ones gave back
        assert carol.import_checkpoint(files, "good").path == f"tinker://{carol.session_id}:train:0/sampler_weights/good"


def test_imports_count_against_the_tenants_hard_limits(stack, exported):
    _, _, folder = exported
    files = {n: (folder / n).read_bytes() for n in WEIGHT_FILES}
    store = Store(stack.database_url)
    store.set_limits("imp-dave", {"max_storage_bytes": 1})
    store.set_limits("imp-erin", {"max_training_runs": 1})
    store.engine.dispose()
    with stack.client("imp-dave") as dave:
        before = _everything(stack)
        code, details = _import(raw_stub(stack, "imp-dave"), dave.session_id, files)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_storage_bytes = 1" in details, (code, details)
        assert _everything(stack) == before
    with stack.client("imp-erin") as erin:
        erin.import_checkpoint(files, "first")  # its one run
        before = _everything(stack)
        code, details = _import(raw_stub(stack, "imp-erin"), erin.session_id, files)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_training_runs = 1" in details, (code, details)
        assert _everything(stack) == before


def test_an_import_that_would_cross_the_storage_limit_is_refused_by_its_written_size(stack, exported):
    """Issue 21, edge 7: the state checkpoint is written in the trainer's format (with its optimizer
    files); it is measured before it is written, not guessed as twice the upload."""
    _, _, folder = exported
    files = {n: (folder / n).read_bytes() for n in WEIGHT_FILES}
    with stack.client("imp-fay") as fay:
        imported = fay.import_checkpoint(files, "size", save_state=True)
    total = imported.checkpoint.size_bytes + imported.state_checkpoint.size_bytes
    assert total > 2 * sum(map(len, files.values()))  # a limit checked with the guess would be crossed
    store = Store(stack.database_url)
    store.set_limits("imp-gus", {"max_storage_bytes": total - 1})
    store.set_limits("imp-hana", {"max_storage_bytes": total})
    store.engine.dispose()
    with stack.client("imp-gus") as gus:
        before = _everything(stack)
        code, details = _import(raw_stub(stack, "imp-gus"), gus.session_id, files)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"max_storage_bytes = {total - 1} reached (in use: 0)" in details
        assert _everything(stack) == before
    with stack.client("imp-hana") as hana:  # exactly at the limit: admitted
        assert _import(raw_stub(stack, "imp-hana"), hana.session_id, files) == (grpc.StatusCode.OK, "")
        assert hana.get_usage()["storage_bytes"] == total
