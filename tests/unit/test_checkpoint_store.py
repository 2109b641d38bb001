"""The trainer's checkpoint folders (services/trainer/checkpoints.py): delete reports the bytes it
freed, deleting twice is fine, a bad key is refused before any file is touched."""

import pytest

from temper.common.errors import InvalidArgument, NotFound
from temper.services.trainer.checkpoints import CheckpointStore

KEY = "run-1/sampler_weights/step-3"


def save(store: CheckpointStore, key: str, files: dict[str, bytes]) -> int:
    staging = store.staging_dir(key)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    return store.publish(staging, key)


def test_delete_frees_the_folder_and_is_idempotent(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    files = {"adapter_config.json": b"{}" * 7, "adapter_model.safetensors": b"\x01" * 4096}
    assert save(store, KEY, files) == 14 + 4096
    save(store, "run-1/weights/step-3", {"adapter_model.safetensors": b"x"})
    assert store.delete(KEY) == 14 + 4096
    assert not store.exists(KEY)
    with pytest.raises(NotFound):
        list(store.read_chunks(KEY))
    assert store.delete(KEY) == 0
    assert store.delete("run-2/sampler_weights/never") == 0
    # nothing else touched, and nothing left behind (no hidden sibling either)
    assert store.exists("run-1/weights/step-3")
    assert not (tmp_path / "ckpt" / "run-1" / "sampler_weights").exists()  # its emptied kind folder goes too
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run-1").iterdir()) == ["weights"]
    # the key can be saved again
    assert save(store, KEY, {"adapter_model.safetensors": b"yy"}) == 2


@pytest.mark.parametrize("key", ["../x/y", "run-1/sampler_weights", "run-1/sampler_weights/..", "a/b/c/d", "run 1/w/x", ""])
def test_delete_refuses_a_bad_key(tmp_path, key):
    store = CheckpointStore(tmp_path / "ckpt")
    save(store, KEY, {"adapter_model.safetensors": b"z"})
    (tmp_path / "x").mkdir()
    with pytest.raises(InvalidArgument, match="bad checkpoint key"):
        store.delete(key)
    assert store.exists(KEY) and (tmp_path / "x").is_dir()
