"""A trainer group (issue 20): N processes that are one trainer to the scheduler.

Every rank loads the model, joins the torch.distributed group (``sharded.init_group``) and builds a
TrainerEngine whose base model is sharded over the ranks (``sharded.shard_base_model``) and whose
passes are ``sharded.forward_backward``. Rank 0 alone serves gRPC and registers; its servicer drives a
``GroupEngine``, which sends every call that changes adapters or computes (``COMMANDS``) to the
other ranks (``broadcast_object_list`` of the method name and its domain-object arguments) before it
runs the call itself; the other ranks run the same calls in the same order (``follow``). Adapters
are replicated, so rank 0's state is the group's: checkpoints, snapshots and imports are written by
rank 0 alone, to the checkpoint folder every rank reads (``load`` and ``restore`` read it on every
rank: one shared folder or volume).

After every command the ranks compare outcomes (ok, or the domain error's class). A rank that dies,
a collective that fails or times out (``group_timeout_seconds``), outcomes that differ, or an error
that is not a domain error fail the whole group: every rank exits with ``GROUP_FAILED`` (rank 0 logs
why), its supervisor starts the group again, and the scheduler restores the runs from their
snapshots and replays what came after (a new incarnation). While idle, rank 0 sends a heartbeat
every quarter of the timeout, so an idle follower does not time out and a dead one is noticed. A
frozen or cut-off peer is noticed too: gloo's send completes only when the receiver has taken the data
(tests/engine/test_group_edges.py: rank 1 SIGSTOPped, the ping fails "Timed out waiting ...ms for send
operation to complete"), so rank 0 exits within about 1.25 timeouts, idle or inside a command (every
collective has the timeout).

Bad input refused before the model loads (``check_layout``): a world size the model's layout cannot
take (``catalogue.check_divides`` with ``ranks_per_trainer`` = world size, and, when
TEMPER_MODEL_CATALOGUE lists the model, its ``ranks_per_trainer`` must be the world size).
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from temper.common.errors import TemperError
from temper.services.models.loading import LoadedModel
from temper.services.trainer import sharded
from temper.services.trainer.memory import device_memory_bytes
from temper.services.trainer.settings import TrainerSettings

log = logging.getLogger("temper.trainer.group")

COMMANDS = ("create_adapter", "drop_adapter", "run_cycle", "load", "restore")
PING, STOP = "ping", "stop"
GROUP_FAILED = 3  # exit status of a rank whose group failed


class GroupDiverged(RuntimeError):
    """The ranks' outcomes of one command differ: their adapters may no longer be the same."""


@dataclass
class Group:
    rank: int
    world: int
    timeout: float
    control: object     # gloo group for commands and outcomes (objects), whatever the compute backend
    mesh: object        # 1-D DeviceMesh the base model is sharded over
    devices: list[str]  # every rank's device, by rank
    memory: list[int]   # every rank's device memory in bytes, by rank


def group_settings(settings: TrainerSettings) -> TrainerSettings:
    """A rank's own settings: its own accelerator and offload folder (activation checkpointing as set:
    the ranks agree on it pass by pass, ``sharded._agreed``)."""
    if not 0 <= settings.rank < settings.world_size:
        raise ValueError(f"TEMPER_TRAINER_RANK={settings.rank} is not below TEMPER_TRAINER_WORLD_SIZE={settings.world_size}")
    update = {"offload_dir": settings.offload_dir / f"rank{settings.rank}"}
    if settings.device == "cuda" and torch.cuda.is_available():
        update["device"] = f"cuda:{settings.rank % torch.cuda.device_count()}"
    return settings.model_copy(update=update)


def check_layout(settings: TrainerSettings, config=None) -> None:
    """Refuses (ValueError naming the numbers) a world size this model cannot be laid out over, before
    any weights load: the layout ``ModelLayout(ranks_per_trainer=world_size)`` (``experts_per_rank`` as
    TEMPER_MODEL_CATALOGUE says for this model) must pass ``catalogue.check_divides``, and a model the
    catalogue lists must be given its ``ranks_per_trainer`` ranks. FSDP2 alone accepts any N >= 1 (it
    shards every parameter on dim 0 and pads the last shard; a rank may even hold an empty shard of a
    small tensor), so without expert placement a world size is refused only by the catalogue."""
    from temper.services.models.catalogue import Catalogue, ModelLayout, check_divides

    name = settings.base_model
    catalogue = Catalogue.from_env()  # ValueError naming the bad field
    listed = catalogue.layout(name) if name in catalogue else None
    if listed is not None and listed.ranks_per_trainer != settings.world_size:
        raise ValueError(f"{name}: TEMPER_TRAINER_WORLD_SIZE={settings.world_size} but the model catalogue lays this "
                         f"model out over ranks_per_trainer={listed.ranks_per_trainer}")
    if config is None:
        from transformers import AutoConfig

        from temper.services.models.loading import resolve_model_path

        # the folder load_model will read: a name such as the embedded SmolLM2's is no hub id to fetch
        # (a compose trainer has no route out; docker-compose.yml's sharded profile)
        config = AutoConfig.from_pretrained(resolve_model_path(name))
    layout = ModelLayout(ranks_per_trainer=settings.world_size,
                         experts_per_rank=listed.experts_per_rank if listed is not None else False)
    check_divides(config, layout, name)


def join(settings: TrainerSettings) -> Group:
    """Join the group at ``group_addr`` (GroupJoinTimeout after ``group_timeout_seconds``)."""
    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # on CUDA: NCCL for the CUDA tensors, gloo for the few CPU ones (sharded.forward_backward's pass counts)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    sharded.init_group(settings.rank, settings.world_size, f"tcp://{settings.group_addr}", settings.group_timeout_seconds,
                       backend)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=settings.group_timeout_seconds))
    mesh = sharded.make_mesh(settings.world_size, device.type)
    found: list = [None] * settings.world_size
    dist.all_gather_object(found, (str(device), device_memory_bytes(device)), group=control)
    devices, memory = [d for d, _ in found], [m for _, m in found]
    log.info("rank %d of %d joined the trainer group at %s (%s; devices %s)", settings.rank, settings.world_size,
             settings.group_addr, backend, devices)
    return Group(settings.rank, settings.world_size, settings.group_timeout_seconds, control, mesh, devices, memory)


def build_engine(loaded, settings: TrainerSettings, group: Group):
    """This rank's TrainerEngine: base model sharded over the group, passes through sharded.forward_backward."""
    from temper.services.trainer.engine import TrainerEngine

    engine = TrainerEngine(_Unsharded(loaded.name, loaded.path, loaded.model, loaded.tokenizer, vision=loaded.vision,
                                      vocab=loaded.vocab_size), settings)
    model = sharded.shard_base_model(engine.lora, group.mesh)
    engine.sharded, engine.world_size = model, group.world  # deterministic items refused (engine.deterministic_unsupported)
    engine.passes = lambda groups, options: sharded.forward_backward(model, groups, options, engine.device)
    return engine


@dataclass
class _Unsharded(LoadedModel):
    """The loaded model, its shapes read before sharding (a rank keeps only a slice of the embedding)."""

    vocab: int = 0

    @property
    def vocab_size(self) -> int:
        return self.vocab


def fail(reason: str) -> NoReturn:
    """The group has failed: log why and leave at once (``GROUP_FAILED``), whatever thread this is."""
    log.critical("trainer group failed, exiting (the group must be started again): %s", reason)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(GROUP_FAILED)


def _send(group: Group, message: tuple) -> None:
    dist.broadcast_object_list([message], src=0, group=group.control)


def _receive(group: Group) -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group.control)
    return box[0]


def _agree(group: Group, outcome: str) -> None:
    everyone: list = [None] * group.world
    dist.all_gather_object(everyone, outcome, group=group.control)
    if len(set(everyone)) > 1:
        raise GroupDiverged(f"the ranks' outcomes differ: {everyone}")


def _outcome(exc: BaseException | None) -> str:
    return "ok" if exc is None else type(exc).__name__


class GroupEngine:
    """Rank 0's engine: the TrainerEngine's interface (attributes pass through), with the calls of
    ``COMMANDS`` run on every rank, in the same order. Calls are serialized (one lock): the servicer's
    compute thread and the heartbeat never interleave their collectives."""

    def __init__(self, engine, group: Group, heartbeat: bool = True):
        self._engine = engine
        self.group = group
        self.world_size = group.world
        self.devices = group.devices
        self.device_memory = group.memory
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = threading.Event()
        if heartbeat:
            threading.Thread(target=self._heartbeat, name="trainer-group-heartbeat", daemon=True).start()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def create_adapter(self, run_id, spec, seed=None):
        # every rank must draw the same initial weights: an unseeded adapter gets one seed for all
        return self._everywhere("create_adapter", run_id, spec, secrets.randbits(63) if seed is None else seed)

    def drop_adapter(self, run_id):
        return self._everywhere("drop_adapter", run_id)

    def run_cycle(self, forward_backward, optim_step):
        return self._everywhere("run_cycle", forward_backward, optim_step)

    def load(self, run_id, key, with_optimizer):
        return self._everywhere("load", run_id, key, with_optimizer)

    def restore(self, run_id, key):
        return self._everywhere("restore", run_id, key)

    def _everywhere(self, name: str, *args):
        with self._lock:
            try:
                _send(self.group, (name, args))
            except Exception as exc:  # noqa: BLE001 - a follower is gone or hung
                fail(f"could not send {name} to the other ranks: {type(exc).__name__}: {exc}")
            error = None
            try:
                result = getattr(self._engine, name)(*args)
            except TemperError as exc:  # refused the same way on every rank (checked below)
                error = exc
            except Exception as exc:  # noqa: BLE001 - a collective failed, or an error the ranks may not share
                log.exception("%s failed on rank 0", name)
                fail(f"{name} raised {type(exc).__name__}: {exc}")
            try:
                _agree(self.group, _outcome(error))
            except Exception as exc:  # noqa: BLE001
                fail(f"after {name}: {type(exc).__name__}: {exc}")
            self._last = time.monotonic()
        if error is not None:
            raise error
        return result

    def _heartbeat(self) -> None:
        every = max(self.group.timeout / 4, 0.05)
        while not self._stopped.wait(every / 2):
            if time.monotonic() - self._last < every or not self._lock.acquire(blocking=False):
                continue
            try:
                _send(self.group, (PING, ()))
                self._last = time.monotonic()
            except Exception as exc:  # noqa: BLE001
                fail(f"heartbeat to the other ranks failed: {type(exc).__name__}: {exc}")
            finally:
                self._lock.release()

    def stop(self) -> None:
        """Tell the followers to exit 0 (a clean shutdown of the group)."""
        self._stopped.set()
        with self._lock:
            try:
                _send(self.group, (STOP, ()))
            except Exception:  # noqa: BLE001 - they are gone already
                pass


def follow(engine, group: Group) -> NoReturn:
    """A follower rank's life: run rank 0's commands until it says stop (exit 0) or is gone (exit
    GROUP_FAILED)."""
    while True:
        try:
            name, args = _receive(group)
        except Exception as exc:  # noqa: BLE001
            fail(f"rank {group.rank}: rank 0 is gone ({type(exc).__name__}: {exc})")
        if name == PING:
            continue
        if name == STOP:
            log.info("rank %d: rank 0 stopped the group", group.rank)
            sys.exit(0)
        if name not in COMMANDS:
            fail(f"rank {group.rank}: unknown command {name!r}")
        error = None
        try:
            getattr(engine, name)(*args)
        except TemperError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001
            log.exception("rank %d: %s failed", group.rank, name)
            fail(f"rank {group.rank}: {name} raised {type(exc).__name__}: {exc}")
        try:
            _agree(group, _outcome(error))
        except Exception as exc:  # noqa: BLE001
            fail(f"rank {group.rank}: after {name}: {type(exc).__name__}: {exc}")
