"""The trainer engine's cycle items, as convert.py decodes them from a RunCycle request: a run's
forward_backward (checked datums), its optim step, or an item that could not be decoded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from temper.common.errors import InvalidArgument, TemperError
from temper.common.optim import AdamParams
from temper.services.trainer.losses import LOSS_FNS

if TYPE_CHECKING:
    from temper.services.trainer.numerics import TokenDatum


@dataclass
class ForwardBackwardItem:
    """One forward_backward request of a run: decoded, checked datums (``convert.py``)."""

    run_id: str
    data: list[TokenDatum]
    loss_fn: str = "cross_entropy"
    loss_config: dict[str, float] = field(default_factory=dict)   # every key the loss reads, defaults filled in
    forward_only: bool = False
    seq_id: int = 0   # the run's seq id; 0: none (never answered from memory)
    deterministic: bool = False   # the run's deterministic mode (docs/deterministic.md)


@dataclass
class OptimStepItem:
    run_id: str
    adam: AdamParams
    seq_id: int = 0


@dataclass
class Refused:
    """A cycle item that could not be decoded (``convert.py``): its run is refused with ``error``."""

    run_id: str
    error: TemperError
    seq_id: int = 0



def check_forward_backward(item: ForwardBackwardItem) -> None:
    """What a domain item must hold; the payload itself was checked where it was decoded."""
    if item.loss_fn not in LOSS_FNS:
        raise InvalidArgument(f"unknown loss_fn {item.loss_fn!r}; supported: {sorted(LOSS_FNS)}")
    if not item.data:
        raise InvalidArgument("forward_backward needs at least one datum")

