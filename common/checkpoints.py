"""Checkpoint naming shared by client, scheduler and services.

Public paths follow Tinker: ``tinker://<training_run_id>/<kind_dir>/<name>``. Inside Temper a
checkpoint's storage key is ``<training_run_id>/<kind_dir>/<name>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from temper.common.errors import InvalidArgument
from temper.common.strings import shown
from temper.v1 import types_pb2

SCHEME = "tinker://"
WEIGHT_FILES = ("adapter_config.json", "adapter_model.safetensors")
# external_weights: a peft adapter folder saved for download (save_weights_external), same files as a sampler checkpoint
KIND_DIRS = {types_pb2.CHECKPOINT_KIND_SAMPLER: "sampler_weights", types_pb2.CHECKPOINT_KIND_TRAINING: "weights",
             types_pb2.CHECKPOINT_KIND_EXTERNAL: "external_weights"}
DIR_KINDS = {v: k for k, v in KIND_DIRS.items()}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class CheckpointPath:
    training_run_id: str
    kind: int
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{KIND_DIRS[self.kind]}/{self.name}"

    @property
    def key(self) -> str:
        return f"{self.training_run_id}/{self.checkpoint_id}"

    def __str__(self) -> str:
        return f"{SCHEME}{self.key}"


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidArgument(f"checkpoint name {shown(name)} must match {_NAME.pattern} (no '/')")
    return name


def parse_path(path: str) -> CheckpointPath:
    if not path.startswith(SCHEME):
        raise InvalidArgument(f"checkpoint path {shown(path)} must start with {SCHEME}")
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or parts[1] not in DIR_KINDS or not parts[0]:
        raise InvalidArgument(f"checkpoint path {shown(path)} must look like tinker://<run>/(weights|sampler_weights|external_weights)/<name>")
    return CheckpointPath(parts[0], DIR_KINDS[parts[1]], check_name(parts[2]))
