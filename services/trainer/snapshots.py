"""Adapter snapshots: one run's complete training state in a checkpoint folder, from which any trainer
of the same base model rebuilds the adapter exactly (issue 11: a trainer's death loses nothing
acknowledged; the run is restored elsewhere from its latest snapshot, then the requests applied
since are replayed, from ``applied_seq + 1``).

A snapshot folder, written staged, flushed to disk and renamed into place (``CheckpointStore``):

    adapter_config.json          the LoRA weights in peft's format, as a save writes them (a snapshot
    adapter_model.safetensors    is also a weights checkpoint: ReadCheckpoint, samplers can take it)
    training_state.safetensors   grad/<name> for every parameter whose gradient is not None (a zero
                                 gradient is stored, a None one is absent); exp_avg/<name>,
                                 exp_avg_sq/<name> and step/<name> (0-d, as Adam keeps it) for every
                                 parameter Adam has stepped
    answers.safetensors          the arrays of the remembered answers: <seq>/logprobs/<i>,
                                 <seq>/elementwise_loss/<i> for datum i of forward_backward <seq>
    snapshot.json                the manifest: format and version, run id, base model name and dtype,
                                 optimizer steps, tokens pending in the gradients, the highest applied
                                 seq, the optimizer's hyperparameters, the remembered answers (seq,
                                 kind, metrics, datum count), and the size and sha256 of every other file

No RNG state: the engine keeps none per adapter. LoRA dropout draws from the process's torch
generator, so a run with dropout > 0 does not draw the same masks after a restore (it never did
across processes); with dropout 0 a restored run continues bit for bit.

``read`` checks everything before anything changes: the format, every file's size and checksum, the
run, the base model's name and dtype, the LoRA targets, and each tensor's name, shape and dtype
against what this trainer's model makes for the spec. A mismatch is FailedPrecondition.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch
from safetensors import SafetensorError

from temper.common.errors import FailedPrecondition
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.trainer.adapters import AdapterHost, OffloadedState, TrainedAdapter
from temper.services.trainer.numerics import ForwardBackwardResult

FORMAT = "temper.adapter_snapshot"
VERSION = 1
MANIFEST = "snapshot.json"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
STATE_FILE = "training_state.safetensors"
ANSWERS_FILE = "answers.safetensors"
DATA_FILES = (CONFIG_FILE, WEIGHTS_FILE, STATE_FILE, ANSWERS_FILE)
ADAM_KINDS = ("exp_avg", "exp_avg_sq", "step")


class SnapshotInfo(NamedTuple):
    size_bytes: int     # of the snapshot's files
    applied_seq: int    # the highest seq the snapshot holds applied: replay from the next one
    steps: int          # optimizer steps taken


@dataclass
class Snapshot:
    """Everything a snapshot holds, in memory (CPU tensors)."""

    run_id: str
    spec: AdapterSpec
    state: OffloadedState       # weight/, grad/, exp_avg/, exp_avg_sq/, step/ tensors and Adam's hyperparameters
    steps: int
    pending_tokens: int         # tokens accumulated into the gradients since the last step
    applied_seq: int
    answers: OrderedDict        # seq -> ForwardBackwardResult | optim_step metrics, oldest first
    size_bytes: int = 0

    @property
    def info(self) -> SnapshotInfo:
        return SnapshotInfo(self.size_bytes, self.applied_seq, self.steps)


def capture(host: AdapterHost, run_id: str) -> Snapshot:
    """The adapter's state, resident or offloaded, which stays where it is (NotFound without one)."""
    adapter, state = host.state_of(run_id)
    return Snapshot(run_id, adapter.spec, state, adapter.steps, adapter.pending_tokens, adapter.applied_seq,
                    OrderedDict(adapter.answers))


def install(host: AdapterHost, snapshot: Snapshot) -> TrainedAdapter:
    """The run's adapter rebuilt from ``snapshot`` (from ``read``: checked), replacing any it had."""
    adapter = host.replace(snapshot.run_id, snapshot.spec, snapshot.state)
    adapter.steps, adapter.pending_tokens, adapter.applied_seq = snapshot.steps, snapshot.pending_tokens, snapshot.applied_seq
    adapter.answers = OrderedDict(snapshot.answers)
    return adapter


# ---- writing ------------------------------------------------------------------------------------

def write(folder: Path, snapshot: Snapshot, base_model: str, base_dtype: str) -> None:
    """The snapshot's files in ``folder`` (a staging folder; the manifest last)."""
    tensors = snapshot.state.tensors
    weights = {key.split("/", 1)[1]: t for key, t in tensors.items() if key.startswith("weight/")}
    (folder / CONFIG_FILE).write_text(json.dumps(snapshot.spec.peft_config(base_model), indent=2, sort_keys=True))
    safetensors.torch.save_file(weights, str(folder / WEIGHTS_FILE))
    safetensors.torch.save_file({k: t for k, t in tensors.items() if not k.startswith("weight/")}, str(folder / STATE_FILE))
    arrays, answers = {}, []
    for seq, answer in snapshot.answers.items():
        if isinstance(answer, ForwardBackwardResult):
            for i, (logprobs, loss) in enumerate(zip(answer.logprobs, answer.elementwise_loss)):
                arrays[f"{seq}/logprobs/{i}"] = np.ascontiguousarray(logprobs)
                arrays[f"{seq}/elementwise_loss/{i}"] = np.ascontiguousarray(loss)
            answers.append({"seq": seq, "kind": "forward_backward", "datums": len(answer.logprobs),
                            "metrics": {k: float(v) for k, v in answer.metrics.items()}})
        else:
            answers.append({"seq": seq, "kind": "optim_step", "metrics": {k: float(v) for k, v in answer.items()}})
    safetensors.numpy.save_file(arrays, str(folder / ANSWERS_FILE))
    manifest = {
        "format": FORMAT, "version": VERSION, "run_id": snapshot.run_id, "base_model": base_model,
        "base_dtype": base_dtype, "steps": snapshot.steps, "pending_tokens": snapshot.pending_tokens,
        "applied_seq": snapshot.applied_seq, "optimizer": {"class": "AdamW", "param_group": snapshot.state.group},
        "answers": answers, "files": {name: _digest((folder / name).read_bytes()) for name in DATA_FILES},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _digest(data: bytes) -> dict:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# ---- reading ------------------------------------------------------------------------------------

def read(folder: Path, key: str, run_id: str, lora: LoraModel, base_dtype: str) -> Snapshot:
    """The snapshot in ``folder``, checked to restore ``run_id`` on a trainer with ``lora`` whose base
    model has ``base_dtype``. Touches nothing; FailedPrecondition for anything that does not fit."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise _refuse(key, f"it is not an adapter snapshot (no {MANIFEST})") from None
    except ValueError:
        raise _refuse(key, f"its {MANIFEST} is not JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _refuse(key, "it is not an adapter snapshot")
    if manifest.get("version") != VERSION:
        raise _refuse(key, f"format version {manifest.get('version')!r}; this trainer reads version {VERSION}")
    try:
        return _read(folder, key, manifest, run_id, lora, base_dtype)
    except (KeyError, TypeError, ValueError, AttributeError, SafetensorError) as exc:
        raise _refuse(key, f"it is malformed ({type(exc).__name__}: {exc})") from None


def _refuse(key: str, why: str) -> FailedPrecondition:
    return FailedPrecondition(f"snapshot {key} cannot be restored on this trainer: {why}; nothing was changed")


def _read(folder: Path, key: str, manifest: dict, run_id: str, lora: LoraModel, base_dtype: str) -> Snapshot:
    if set(manifest["files"]) != set(DATA_FILES):
        raise _refuse(key, f"its manifest lists files {sorted(manifest['files'])}, not {sorted(DATA_FILES)}")
    blobs = {}
    for name in DATA_FILES:
        try:
            blobs[name] = (folder / name).read_bytes()
        except FileNotFoundError:
            raise _refuse(key, f"{name} is missing") from None
        if _digest(blobs[name]) != manifest["files"][name]:
            raise _refuse(key, f"{name} is damaged (its size or sha256 differs from the manifest's)")
    if manifest["run_id"] != run_id:
        raise _refuse(key, f"it holds run {manifest['run_id']!r}, not {run_id!r}")
    if manifest["base_model"] != lora.base_model_name:
        raise _refuse(key, f"it was taken on base model {manifest['base_model']!r}; this trainer serves {lora.base_model_name!r}")
    if manifest["base_dtype"] != base_dtype:
        raise _refuse(key, f"it was taken on a {manifest['base_dtype']} base model; this trainer's is {base_dtype}")
    spec = AdapterSpec.from_peft_config(json.loads(blobs[CONFIG_FILE]))
    missing = set(spec.targets) - lora.available_targets()
    if spec.rank <= 0 or not 0.0 <= spec.dropout < 1.0 or not spec.targets or missing:
        raise _refuse(key, f"its LoRA config {spec} does not fit this base model (no layers {sorted(missing)})")
    shapes = lora.param_shapes(spec)
    weights = safetensors.torch.load(blobs[WEIGHTS_FILE])
    if set(weights) != set(shapes):
        raise _refuse(key, f"its weights are not this base model's adapter layout ({len(weights)} tensors, expected "
                           f"{len(shapes)}; first unexpected {sorted(set(weights) - set(shapes))[:1]})")
    state = safetensors.torch.load(blobs[STATE_FILE])
    for name, tensor in [*((f"weight/{n}", t) for n, t in weights.items()), *state.items()]:
        kind, _, param = name.partition("/")
        if kind not in ("weight", "grad", *ADAM_KINDS) or param not in shapes:
            raise _refuse(key, f"its training state has an unexpected tensor {name!r}")
        want = () if kind == "step" else shapes[param]
        if tuple(tensor.shape) != want or not tensor.dtype.is_floating_point or (kind != "step" and tensor.dtype != torch.float32):
            raise _refuse(key, f"{name} is {tensor.dtype} {tuple(tensor.shape)}; this base model's adapter needs "
                               f"float32 {want} (shapes differ: another base model)")
    for param in shapes:
        if len({f"{kind}/{param}" in state for kind in ADAM_KINDS}) != 1:
            raise _refuse(key, f"its Adam state of {param} is incomplete")
    group = manifest["optimizer"]["param_group"]
    if not isinstance(group, dict) or not all(_scalar(v) or (isinstance(v, list) and all(map(_scalar, v))) for v in group.values()):
        raise _refuse(key, "its optimizer hyperparameters are not plain numbers")
    counters = {name: manifest[name] for name in ("steps", "pending_tokens", "applied_seq")}
    if not all(type(v) is int and v >= 0 for v in counters.values()):
        raise _refuse(key, f"its counters {counters} are not whole numbers >= 0")
    answers = _answers(key, manifest["answers"], safetensors.numpy.load(blobs[ANSWERS_FILE]), counters["applied_seq"])
    tensors = {**{f"weight/{n}": t for n, t in weights.items()}, **state}
    return Snapshot(run_id, spec, OffloadedState(tensors, group), counters["steps"], counters["pending_tokens"],
                    counters["applied_seq"], answers, sum(map(len, blobs.values())) + (folder / MANIFEST).stat().st_size)


def _scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _answers(key: str, entries: list, arrays: dict[str, np.ndarray], applied_seq: int) -> OrderedDict:
    answers, used = OrderedDict(), set()
    for entry in entries:
        seq, kind, metrics = entry["seq"], entry["kind"], entry["metrics"]
        if type(seq) is not int or not 0 < seq <= applied_seq or seq in answers:
            raise _refuse(key, f"it remembers an answer to seq {seq!r} (applied up to {applied_seq})")
        if not isinstance(metrics, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in metrics.values()):
            raise _refuse(key, f"the metrics of its answer to seq {seq} are not numbers")
        metrics = {str(k): float(v) for k, v in metrics.items()}
        if kind == "optim_step":
            answers[seq] = metrics
            continue
        if kind != "forward_backward" or type(entry["datums"]) is not int:
            raise _refuse(key, f"its answer to seq {seq} is of unknown kind {kind!r}")
        names = [(f"{seq}/logprobs/{i}", f"{seq}/elementwise_loss/{i}") for i in range(entry["datums"])]
        used.update(n for pair in names for n in pair)
        answers[seq] = ForwardBackwardResult([arrays[lp] for lp, _ in names], [arrays[loss] for _, loss in names], metrics)
    if set(arrays) != used:
        raise _refuse(key, f"its answers file holds arrays no answer names: {sorted(set(arrays) - used)[:3]}")
    return answers
