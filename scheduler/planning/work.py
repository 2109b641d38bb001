"""Units of sequenced training work and the per-run queues that keep them in seq_id order."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class WorkKind(str, enum.Enum):
    FORWARD_BACKWARD = "forward_backward"
    FORWARD = "forward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    LOAD_WEIGHTS = "load_weights"

    @property
    def is_pass(self) -> bool:
        """Work that runs in a cycle's forward/backward pass over the base model."""
        return self in (WorkKind.FORWARD_BACKWARD, WorkKind.FORWARD)

    @property
    def is_barrier(self) -> bool:
        """Work that runs alone for its run (between cycles): weights are read or replaced."""
        return self in (WorkKind.SAVE_WEIGHTS, WorkKind.LOAD_WEIGHTS)


class Dispatch(NamedTuple):
    """Where and when work went to a trainer (kept in its run_metrics row: planning/records.py)."""
    trainer: str         # the trainer's address
    cycle: int           # the loop's cycle number
    cobatched_with: int  # other runs in that cycle
    started_ms: int      # unix ms it was sent


class WorkState(str, enum.Enum):
    CLAIMED = "claimed"      # holds its (run, seq) while admission checks and records it; not ready yet
    QUEUED = "queued"        # admitted: runs when its seq comes
    REJECTED = "rejected"    # failed admission: answered at once, its seq is spent (skipped when it comes)


@dataclass(eq=False)
class Work:
    run_id: str
    seq_id: int
    kind: WorkKind
    request: Any = None
    payload_sha256: str = ""
    num_tokens: int = 0
    tenant: str = ""
    state: WorkState = WorkState.QUEUED
    submitted_at: float = 0.0        # monotonic time of arrival (oldest heads are served first)
    resent: bool = False             # held and sent again after its trainer was lost (recovery.py): it may have run there
    dispatch: Dispatch | None = None # the latest time it went to a trainer (None: never)
    marked: bool = False             # its row says "running" already (marked ahead with its run's previous cycle: loop.py)
    deterministic: bool = False      # its run's deterministic mode (docs/deterministic.md): sent with its cycle item
    key_prefix: str = ""              # the submitting key's prefix, for the audit log ("": resent after a restart)
    future: asyncio.Future | None = field(default=None, repr=False)

    @property
    def rejected(self) -> bool:
        return self.state is WorkState.REJECTED

    def resolve(self, result: Any) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(result)

    def fail(self, exc: BaseException) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(exc)
            self.future.exception()  # retrieved here: callers that await it re-raise it; no "never retrieved" noise


class RunQueue:
    """Pending work of one training run, keyed by seq_id; releases it strictly in order."""

    def __init__(self, run_id: str, next_seq_id: int, lookup_upto: int = 0, tenant: str = "?", skipped: tuple[int, ...] = ()):
        self.run_id = run_id
        self.tenant = tenant
        self.next_seq_id = next_seq_id
        # A seq above this has no request row, or its work is still in Admission.recent: the database is
        # asked about seqs up to it only (rows of earlier processes; work this process forgot, see Admission.forgot)
        self.lookup_upto = lookup_upto
        self.pending: dict[int, Work] = {}
        # seqs given up on: by the scheduler (skip_gap) or by their client (skip; ``skipped``: the ones
        # an earlier process recorded)
        self.skipped: list[range] = [range(seq, seq + 1) for seq in skipped]

    def add(self, work: Work) -> None:
        self.pending[work.seq_id] = work

    def remove(self, work: Work) -> None:
        """Forget claimed work that was neither admitted nor rejected (its seq stays free)."""
        if self.pending.get(work.seq_id) is work:
            del self.pending[work.seq_id]

    def ready(self) -> list[Work]:
        """The contiguous run of queued work starting at next_seq_id (rejected and skipped heads are dropped)."""
        while True:
            if (head := self.pending.get(self.next_seq_id)) is not None and head.rejected:
                del self.pending[self.next_seq_id]
            elif head is not None or not self.was_skipped(self.next_seq_id):
                break
            self.next_seq_id += 1
        out, seq = [], self.next_seq_id
        while (work := self.pending.get(seq)) is not None and work.state is WorkState.QUEUED:
            out.append(work)
            seq += 1
        return out

    def take(self, work: Work) -> None:
        """Remove work that a cycle is about to execute; it must be the head."""
        assert work.seq_id == self.next_seq_id, (work.seq_id, self.next_seq_id)
        del self.pending[work.seq_id]
        self.next_seq_id += 1

    def rewind(self, seq_id: int) -> None:
        """Taken work did not complete (its outcome is unknown): its seq is expected again."""
        self.next_seq_id = min(self.next_seq_id, seq_id)

    def unparked(self) -> int:
        """Held work that is not parked behind a missing seq: the chain from next_seq_id."""
        count, seq = 0, self.next_seq_id
        while seq in self.pending:
            count, seq = count + 1, seq + 1
        return count

    def extends_chain(self, seq_id: int) -> bool:
        """Whether work at ``seq_id`` would join the unparked chain (not wait behind a gap)."""
        return self.next_seq_id <= seq_id <= self.next_seq_id + self.unparked()

    def gap_since(self) -> float | None:
        """When the oldest work waiting behind a missing next seq arrived; None without such a gap."""
        if not self.pending or self.next_seq_id in self.pending or self.was_skipped(self.next_seq_id):
            return None
        return min(work.submitted_at for work in self.pending.values())

    def skip_gap(self) -> range:
        """Give up on the missing seqs before the first pending one, so the work behind them runs."""
        gap = range(self.next_seq_id, min(self.pending))
        self.skipped.append(gap)
        self.next_seq_id = gap.stop
        return gap

    def skip(self, seq_id: int) -> None:
        """Its client gave up on ``seq_id`` before it was recorded: passed over when it comes (also
        after a rewind to below it)."""
        self.skipped.append(range(seq_id, seq_id + 1))

    def was_skipped(self, seq_id: int) -> bool:
        return any(seq_id in gap for gap in self.skipped)

    def __len__(self) -> int:
        return len(self.pending)
