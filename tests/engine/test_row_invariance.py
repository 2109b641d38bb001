"""The start-up check behind deterministic mode (services/lora/row_invariance.py): this machine's
matmuls for the model's shapes must give a row the same bits whatever rows share the matmul, from
``MIN_ROWS`` rows on. On the machine this was written on they do at 8; a BLAS that needs more rows
raises the floor; one that is never row-invariant turns deterministic mode off with a reason
(refused, never a best effort); stacked adapter products that differ send decode to the per-adapter path."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from temper.services.lora import deterministic as det
from temper.services.lora import deterministic_lora, row_invariance


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.fixture
def fresh(monkeypatch):
    """A process that has checked nothing yet, its floor restored afterwards."""
    monkeypatch.setattr(row_invariance, "_checked", {})
    monkeypatch.setattr(det, "_calibrated", weakref.WeakKeyDictionary())
    monkeypatch.setattr(det, "MIN_ROWS", 8)
    monkeypatch.setattr(deterministic_lora, "STACKING", True)


def linear_reducing_otherwise(when):
    """F.linear as a BLAS whose matmuls of ``when(rows)`` rows reduce in another order: the same
    product, summed in float64."""
    real = F.linear

    def linear(x, weight, bias=None):
        if when(x.reshape(-1, x.shape[-1]).shape[0]):
            return real(x.double(), weight.double()).to(x.dtype)
        return real(x, weight, bias)

    return linear


def test_this_machine_is_row_invariant_from_a_floor_and_uses_it(model, fresh):
    """8 rows on the machine this was written on; another CPU may need more (then MIN_ROWS says so)."""
    floor = row_invariance.row_floor(model, det.KEY_BLOCK)
    assert floor in row_invariance.FLOORS  # the deterministic tests of this suite rely on it
    assert det.unsupported(model) == "" and det.MIN_ROWS == floor


def test_a_blas_that_needs_more_rows_raises_the_floor(model, fresh, monkeypatch):
    monkeypatch.setattr(row_invariance.F, "linear", linear_reducing_otherwise(lambda rows: rows < 16))
    assert det.unsupported(model) == ""
    assert det.MIN_ROWS >= 16  # every deterministic matmul is now padded to at least 16 rows


def test_a_blas_that_is_never_row_invariant_turns_deterministic_mode_off(model, fresh, monkeypatch):
    monkeypatch.setattr(row_invariance.F, "linear", linear_reducing_otherwise(lambda rows: rows > 64))
    reason = det.unsupported(model)
    assert "different bits depending on the rows beside it" in reason and det.MIN_ROWS == 8


def test_stacked_products_that_differ_send_decode_back_to_one_adapter_at_a_time(model, fresh, monkeypatch):
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: real(a.double(), b.double()).to(a.dtype))
    assert det.unsupported(model) == ""  # deterministic mode stays on ...
    assert not deterministic_lora.STACKING  # ... with the trainer's per-adapter path in decode too
