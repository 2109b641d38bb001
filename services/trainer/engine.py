"""The trainer's compute: co-batched forward/backward for many training runs' adapters, Adam steps,
checkpoints.

Transport-free: it takes and returns the domain objects below (``convert.py`` maps the protobuf
messages onto them, decoding and checking payloads there), so tests and benchmarks drive it
directly. Every public method checks its input before it touches an adapter, gradient or
optimizer state: a rejected call changes nothing. A cycle is checked per run, and a refused run
changes nothing of itself while the other runs' items go on. The passes themselves are ``numerics.py``.

The adapter of a training run lives under the run's id, in the AdapterHost and in the LoraModel.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from temper.common.cycles import ITEMS_PER_RUN_PER_CYCLE
from temper.common.errors import FailedPrecondition, Internal, InvalidArgument, TemperError, shown
from temper.common.optim import AdamParams
from temper.services.lora import deterministic
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models.loading import LoadedModel
from temper.services.trainer import imports, metrics, numerics, snapshots
from temper.services.trainer.adapters import AdapterHost, TrainedAdapter
from temper.services.trainer.step_undo import StepUndo
from temper.services.trainer.checkpoints import CheckpointStore
from temper.services.trainer.items import ForwardBackwardItem, OptimStepItem, Refused, check_forward_backward
from temper.services.trainer.memory import ActivationModel, activation_budget_bytes
from temper.services.trainer.numerics import ForwardBackwardResult, LossGroup, PassOptions, default_logprob_chunk_tokens
from temper.services.trainer.settings import TrainerSettings
from temper.services.trainer.sharded import sharded_no_images, sharded_not_deterministic
from temper.services.trainer.snapshots import SnapshotInfo

# AdamParams is checked where it is built from a request (convert.py, common.validation.validate_adam).
__all__ = ["AdamParams", "ForwardBackwardItem", "ForwardBackwardResult", "OptimStepItem", "Refused", "SnapshotInfo",
           "TrainerEngine"]


log = logging.getLogger("temper.trainer")

# On CPU a pass's cost per token is lowest around 512-1024 padded tokens and grows past it (SmolLM2,
# one thread, process CPU seconds per token of a co-batched pass: 9.4 ms at 512 tokens, 9.6 at 1024,
# 10.0 at 2048; one stored pass of 4096 tokens lost to eight of 512, 0.98: benchmarks/cobatch_sweep.py),
# so bigger passes are split there even when memory allows them; accelerators let memory alone decide.
CPU_MICROBATCH_TOKENS = 1024

ANSWERS_KEPT = ITEMS_PER_RUN_PER_CYCLE  # per run: a re-sent cycle is one cycle's worth of a run's items


class TrainerEngine:
    def __init__(self, loaded: LoadedModel, settings: TrainerSettings):
        self.loaded = loaded
        self.settings = settings
        self.device = torch.device(settings.device)
        self.lora = LoraModel(loaded.model, loaded.name, settings.lora_math_dtype)
        self.base_dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")  # snapshots record it
        offload_to = settings.offload_to if settings.offload_to != "auto" else ("disk" if self.device.type == "cpu" else "host")
        self.host = AdapterHost(self.lora, settings.max_resident_adapters, settings.offload_dir, offload_to)
        self.store = CheckpointStore(settings.checkpoint_dir)
        # (groups, options) -> results: one process's passes; a trainer group's ranks swap in sharded.forward_backward
        # (group.build_engine, which sets ``sharded`` and ``world_size`` too)
        self.passes = lambda groups, options: numerics.forward_backward(self.lora, groups, options, self.device, _observe_pass,
                                                                       loaded.vision)
        self.sharded = None
        self.world_size = 1
        if settings.activation_checkpointing and self.lora.family is not None:  # other models take no adapter
            self.lora.checkpoint_decoder_layers()
        self.logprob_chunk_tokens = settings.logprob_chunk_tokens or default_logprob_chunk_tokens(self.device, loaded.vocab_size)
        dtype = next(loaded.model.parameters()).dtype
        self.activations = ActivationModel.from_config(loaded.model.config, dtype, device=self.device)
        # the budget is taken once, at start: the process keeps freed activation memory for reuse
        # (host_allocator, CUDA's caching allocator), so what is "available" later shrinks by it
        self.auto_activation_budget = activation_budget_bytes(self.device, 0, settings.activation_memory_fraction)
        deterministic.unsupported(self.lora.model)  # the row-invariance check (seconds for a large model) before serving, not in GetModelInfo
        if settings.activation_checkpointing_min_tokens is not None:
            log.warning("TEMPER_TRAINER_ACTIVATION_CHECKPOINTING_MIN_TOKENS is deprecated: passes of %d tokens or more are "
                        "checkpointed whatever memory they need; unset it to let the activation memory budget decide",
                        settings.activation_checkpointing_min_tokens)
        else:
            budget = self.activation_budget
            log.info("activation memory budget %s; a pass stores its activations up to ~%s padded tokens",
                     "unknown" if budget is None else f"{budget >> 20} MiB",
                     "?" if budget is None else self.activations.stored_tokens(budget, 1024, self.logprob_chunk_tokens))

    @property
    def activation_budget(self) -> int | None:
        """Bytes one pass's activations may use: the setting, else the share of memory available at start."""
        mib = self.settings.activation_memory_mib
        return mib << 20 if mib > 0 else self.auto_activation_budget

    @property
    def image_limits(self):
        """What one image of a request may be (the settings' image limits)."""
        return self.settings.image_limits()

    @property
    def deterministic_unsupported(self) -> str:
        """Why this trainer cannot run deterministic items; "" when it can (GetModelInfo says it)."""
        if self.sharded is not None:
            return sharded_not_deterministic(self.world_size)
        return deterministic.unsupported(self.lora.model)

    @property
    def pass_options(self) -> PassOptions:
        """Read from the settings at every call (benchmarks and tests change them on a live engine)."""
        s = self.settings
        if s.activation_checkpointing_min_tokens is not None or self.activation_budget is None:  # the token rule
            min_tokens = s.activation_checkpointing_min_tokens
            return PassOptions(s.max_tokens_per_microbatch or 4096, self.logprob_chunk_tokens,
                               (2048 if min_tokens is None else min_tokens) if s.activation_checkpointing else None)
        cap = s.max_tokens_per_microbatch or (CPU_MICROBATCH_TOKENS if self.device.type == "cpu" else 0)
        return PassOptions(cap, self.logprob_chunk_tokens, activations=self.activations,
                           activation_budget=self.activation_budget, checkpointing=s.activation_checkpointing)

    # ---- adapters -----------------------------------------------------------------------------

    def create_adapter(self, run_id: str, spec: AdapterSpec, seed: int | None = None) -> TrainedAdapter:
        adapter = self.host.create(run_id, spec, seed)
        self._count_adapters()
        return adapter

    def drop_adapter(self, run_id: str) -> None:
        self.host.drop(run_id)
        self._count_adapters()

    def _count_adapters(self) -> None:
        resident = len(self.host.resident())
        metrics.adapters_changed(resident, len(self.host.adapters) - resident)

    # ---- one scheduler cycle ------------------------------------------------------------------

    def run_cycle(
        self, forward_backward: list[ForwardBackwardItem | Refused], optim_step: list[OptimStepItem | Refused]
    ) -> tuple[list[ForwardBackwardResult | TemperError], list[dict[str, float] | TemperError]]:
        """Every item's answer, in order, or the domain error that refused it.

        Runs fail alone. A run with an item that cannot run (refused while decoding, an unknown
        adapter, a bad item, a seq applied so long ago that its answer is gone) or whose loss or
        gradient is not finite has its fresh items answered with that error, and nothing of it
        changes; the other runs' items run together as usual. A failed optim step fails alone (its
        run's passes before it stand) and changes nothing. Items whose seq the adapter already applied
        are answered from memory. A shared pass that raises is run again one run at a time, so a run
        whose own pass raises fails alone (INTERNAL); an error of every run (out of memory, a bug)
        raises with every gradient undone."""
        start = time.perf_counter()
        items = [*forward_backward, *optim_step]
        outcomes: list = [None] * len(items)
        refused: dict[str, TemperError] = {}
        with self.host.pinned([run_id for run_id in dict.fromkeys(i.run_id for i in items) if run_id in self.host.adapters]):
            for k, item in enumerate(items):
                try:
                    outcomes[k] = self._earlier_answer_or_check(item)
                except TemperError as exc:
                    refused.setdefault(item.run_id, exc)
            fresh = [k for k, outcome in enumerate(outcomes) if outcome is None and items[k].run_id not in refused]
            passes = [k for k in fresh if k < len(forward_backward)]
            results, not_finite = self._passes([items[k] for k in passes])
            refused.update(not_finite)
            for k, result in zip(passes, results):
                outcomes[k] = result
            for k in fresh[len(passes):]:
                if items[k].run_id not in refused:
                    outcomes[k] = self._optim_step_or_error(items[k])
            ran = set(fresh)
            for k, item in enumerate(items):
                if item.run_id in refused and (k in ran or outcomes[k] is None):
                    outcomes[k] = refused[item.run_id]
                elif k in ran and item.seq_id and not isinstance(outcomes[k], TemperError):
                    self.host.get(item.run_id).remember(item.seq_id, outcomes[k], ANSWERS_KEPT)
        metrics.CYCLES.inc()
        metrics.CYCLE_SECONDS.observe(time.perf_counter() - start)
        self._count_adapters()
        return outcomes[:len(forward_backward)], outcomes[len(forward_backward):]

    def _earlier_answer_or_check(self, item: ForwardBackwardItem | OptimStepItem | Refused):
        """The answer of an item whose seq the run's adapter already applied; else None, once the item
        is fit to run. Raises the domain error that refuses the item's run."""
        if isinstance(item, Refused):
            raise item.error
        adapter = self.host.get(item.run_id)  # NotFound for a run without an adapter here
        if item.seq_id and item.seq_id <= adapter.applied_seq:
            answer = adapter.answers.get(item.seq_id)
            if answer is None:
                raise FailedPrecondition(f"seq {item.seq_id} of {item.run_id} was already applied and its answer is no "
                                         f"longer held")
            return answer
        if isinstance(item, ForwardBackwardItem):
            check_forward_backward(item)
            if self.sharded is not None and any(getattr(datum, "images", ()) for datum in item.data):
                raise FailedPrecondition(sharded_no_images(self.world_size))
            if item.deterministic and (missing := self.deterministic_unsupported):
                raise FailedPrecondition(f"run {item.run_id} asks for deterministic mode: {missing}")
        return None

    def _optim_step_or_error(self, item: OptimStepItem) -> dict[str, float] | TemperError:
        try:
            return self.optim_step(self.host.get(item.run_id), item.adam)
        except TemperError as exc:  # refused, nothing changed; the run's passes stand
            return exc
        except Exception as exc:  # noqa: BLE001 - optim_step undid it: one run's failure is not the cycle's
            log.exception("the optim step of run %s failed", item.run_id)
            return Internal(f"the optim step of run {item.run_id} failed ({type(exc).__name__}); nothing of the run "
                            f"was changed")

    def _passes(self, items: list[ForwardBackwardItem]) -> tuple[list[ForwardBackwardResult], dict[str, TemperError]]:
        """All items in shared passes; gradients accumulate into each item's own run's adapter. Returns
        the results and the runs refused for a loss or gradient that is not finite, whose gradients
        are restored (rows never mix across adapters, so the other runs' results stand as computed)."""
        adapters = {item.run_id: self.host.get(item.run_id) for item in items}
        training = {run_id: adapters[run_id] for run_id in dict.fromkeys(i.run_id for i in items if not i.forward_only)}
        snapshots = {run_id: adapter.grads_snapshot() for run_id, adapter in training.items()}
        groups = [LossGroup(i.run_id, i.data, i.loss_fn, i.loss_config, i.forward_only, i.deterministic) for i in items]
        failed: dict[str, TemperError] = {}
        try:
            results = self.passes(groups, self.pass_options) if items else []
        except BaseException as exc:
            for run_id, adapter in training.items():
                adapter.restore_grads(snapshots[run_id])  # a failed pass leaves no half gradient
            if not isinstance(exc, Exception) or len(adapters) < 2:
                raise
            # maybe one run's: each run again alone, so the others' results stand
            results, failed = self._passes_per_run(groups, training, snapshots, exc)
        ok = [k for k, item in enumerate(items) if item.run_id not in failed]
        refused = {**failed, **_not_finite([items[k] for k in ok], [results[k] for k in ok],
                                           {r: a for r, a in training.items() if r not in failed})}
        for run_id in refused:
            if run_id in training:
                training[run_id].restore_grads(snapshots[run_id])
        for item, result in zip(items, results):
            if item.run_id in refused:
                continue
            tokens = int(result.metrics["num_tokens:sum"])
            if item.forward_only:
                metrics.TOKENS_FORWARD.inc(tokens)
            else:
                adapters[item.run_id].pending_tokens += tokens
                metrics.TOKENS_TRAINED.inc(tokens)
        return results, refused

    def _passes_per_run(self, groups: list[LossGroup], training: dict, snapshots: dict, error: Exception):
        """After a shared pass raised: each run's items in passes of their own. A run whose pass raises
        again is refused, its gradients restored; when every run's does, ``error`` is no one run's."""
        results, failed = [None] * len(groups), {}
        for run_id in dict.fromkeys(g.adapter for g in groups):
            mine = [k for k, g in enumerate(groups) if g.adapter == run_id]
            try:
                ran = self.passes([groups[k] for k in mine], self.pass_options)
                for k, result in zip(mine, ran):
                    results[k] = result
            except Exception as exc:  # noqa: BLE001
                if run_id in training:
                    training[run_id].restore_grads(snapshots[run_id])
                log.error("the pass of run %s failed: %r", run_id, exc)
                failed[run_id] = Internal(f"the forward/backward pass of run {run_id} failed ({type(exc).__name__}); "
                                          f"nothing of the run was changed")
        if len(failed) == len(set(g.adapter for g in groups)):
            raise error
        return results, failed

    def optim_step(self, adapter: TrainedAdapter, params: AdamParams) -> dict[str, float]:
        """One Adam step, whole or not at all: one that raises, or would leave a weight or moment that
        is not finite, restores the run's weights, Adam state and gradients as they were."""
        grads = [p for p in adapter.params.values() if p.grad is not None]
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf")
        undo = StepUndo(adapter, copy_grads=max_norm < float("inf"))  # clipping scales the gradients in place
        try:
            # error_if_nonfinite raises before any gradient is scaled; passes never accumulate a
            # non-finite gradient (_not_finite), so this only guards what slips past that.
            try:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm, error_if_nonfinite=True)) if grads else 0.0
            except RuntimeError:
                raise FailedPrecondition(f"the accumulated gradient of run {adapter.run_id} is not finite; the step changed "
                                         f"nothing (load a checkpoint to go on)") from None
            for group in adapter.optimizer.param_groups:
                group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                             weight_decay=params.weight_decay)
            adapter.optimizer.step()
            if not undo.all_finite():
                raise InvalidArgument(f"the optim step would make weights or Adam moments of run {adapter.run_id} not finite "
                                      f"(learning rate, eps or gradient too extreme for float32?); nothing was changed")
        except BaseException:
            undo.restore()
            raise
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        tokens, adapter.pending_tokens = adapter.pending_tokens, 0
        metrics.OPTIM_STEPS.inc()
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": params.learning_rate, "step:max": float(adapter.steps),
                "num_tokens:sum": float(tokens)}

    # ---- checkpoints --------------------------------------------------------------------------

    def save(self, run_id: str, key: str, include_optimizer: bool, measure_only: bool = False) -> int:
        """The checkpoint's bytes, written under ``key``; ``measure_only``: the bytes it would take, nothing written."""
        adapter = self.host.get(run_id)
        files = self.host.checkpoint_files(adapter, include_optimizer)
        if measure_only:
            return sum(len(data) for data in files.values())
        staging = self.store.staging_dir(key)
        try:
            for name, data in files.items():
                (staging / name).write_bytes(data)
            return self.store.publish(staging, key)
        except BaseException:
            self.store.discard(staging)
            raise

    def load(self, run_id: str, key: str, with_optimizer: bool) -> None:
        adapter = self.host.get(run_id)
        folder = self.store.existing(key)
        weights = self.host.read_checkpoint(adapter, folder, with_optimizer)
        self.host.load(adapter, folder, weights, with_optimizer)

    def import_checkpoint(self, key: str, files: dict[str, bytes]) -> tuple[int, imports.ImportedLora]:
        """An outside peft adapter (file name -> bytes) written as checkpoint ``key`` once it passes
        ``imports.check_adapter_folder``; its bytes and the LoRA config of a run it fits. A refused
        upload (InvalidArgument) leaves nothing behind."""
        staging = self.store.staging_dir(key)
        try:
            for name, data in files.items():
                if name not in (imports.CONFIG_FILE, imports.WEIGHTS_FILE):
                    raise InvalidArgument(f"unexpected file {shown(name)}: an adapter is {imports.CONFIG_FILE} and {imports.WEIGHTS_FILE}")
                (staging / name).write_bytes(data)
            config = imports.check_adapter_folder(staging, self.lora)
            return self.store.publish(staging, key), config
        except BaseException:
            self.store.discard(staging)
            raise

    # ---- snapshots: a run's whole training state, restorable on any trainer (snapshots.py) ----------

    def snapshot(self, run_id: str, key: str) -> SnapshotInfo:
        """Write the adapter's complete state (weights, Adam moments and steps, pending gradients, applied
        seq and remembered answers) under ``key``. An offloaded adapter stays offloaded."""
        snapshot = snapshots.capture(self.host, run_id)  # NotFound before anything is written
        staging = self.store.staging_dir(key)  # InvalidArgument, AlreadyExists
        try:
            snapshots.write(staging, snapshot, self.lora.base_model_name, self.base_dtype)
            snapshot.size_bytes = self.store.publish(staging, key, sync=True)
        except BaseException:
            self.store.discard(staging)
            raise
        return snapshot.info

    def restore(self, run_id: str, key: str) -> SnapshotInfo:
        """Create the run's adapter from the snapshot under ``key``, replacing the one it has here if
        any. A snapshot of another run, base model or dtype, or one whose files are damaged, is
        refused (FailedPrecondition) with nothing changed."""
        snapshot = snapshots.read(self.store.existing(key), key, run_id, self.lora, self.base_dtype)
        snapshots.install(self.host, snapshot)
        self._count_adapters()
        return snapshot.info


def _observe_pass(grad: bool, tokens: int, seconds: float) -> None:
    metrics.PASS_SECONDS.labels("forward_backward" if grad else "forward").observe(seconds)


def _not_finite(items: list[ForwardBackwardItem], results: list[ForwardBackwardResult], training: dict) -> dict[str, TemperError]:
    """Runs whose loss or accumulated gradient is not finite: the next optim_step would turn their
    adapter into NaN for good, so they are refused instead (the caller restores their grads)."""
    bad = {item.run_id for item, result in zip(items, results) if not math.isfinite(result.metrics["loss:sum"])}
    # Every run's gradients in one fused max-abs norm (NaN and inf survive a max, and nothing can overflow
    # it) and one device sync: an isfinite per tensor cost ~3% of a co-batched cycle of 8 adapters.
    owners, grads = [], []
    for run_id, adapter in training.items():
        for p in adapter.params.values():
            if p.grad is not None and p.grad.numel():
                owners.append(run_id)
                grads.append(p.grad)
    if grads:
        finite = torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(grads, math.inf)])).tolist()
        bad.update(run_id for run_id, ok in zip(owners, finite) if not ok)
    return {run_id: InvalidArgument(f"the loss or gradient of run {run_id} is not finite (inputs too large for "
                                    f"float32?); nothing of the run was changed") for run_id in sorted(bad)}
