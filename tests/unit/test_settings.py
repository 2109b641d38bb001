"""Settings: the scheduler's TEMPER_SCHEDULER_ prefix, its deprecated names, the shared base."""

from __future__ import annotations

import pytest

from temper.common.settings import ModelServiceSettings, ProcessSettings
from temper.scheduler.settings import SchedulerSettings
from temper.services.sampler.settings import SamplerSettings
from temper.services.trainer.settings import TrainerSettings


def test_the_scheduler_reads_its_prefix_and_still_its_old_names_with_a_warning(monkeypatch):
    monkeypatch.setenv("TEMPER_SCHEDULER_BIND", "127.0.0.1:1")
    monkeypatch.setenv("TEMPER_TRAINER_ADDRESSES", "a:1, b:2")       # the old name of trainer_addresses
    monkeypatch.setenv("TEMPER_TENANT_WEIGHTS", '{"alice": 2}')
    monkeypatch.setenv("TEMPER_BIND", "127.0.0.1:2")                 # the new name wins over the old one
    with pytest.warns(DeprecationWarning) as caught:
        settings = SchedulerSettings()
    assert {str(w.message) for w in caught} == {
        "TEMPER_TRAINER_ADDRESSES is deprecated; use TEMPER_SCHEDULER_TRAINER_ADDRESSES",
        "TEMPER_TENANT_WEIGHTS is deprecated; use TEMPER_SCHEDULER_TENANT_WEIGHTS"}
    assert (settings.bind, settings.trainer_addresses, settings.tenant_weights) == ("127.0.0.1:1", ["a:1", "b:2"], {"alice": 2.0})


def test_every_process_shares_the_base_fields_and_checks_enum_like_ones(monkeypatch):
    assert issubclass(SchedulerSettings, ProcessSettings)
    assert issubclass(TrainerSettings, ModelServiceSettings) and issubclass(SamplerSettings, ModelServiceSettings)
    monkeypatch.setenv("TEMPER_TRAINER_LOG_FORMAT", "json")
    monkeypatch.setenv("TEMPER_TRAINER_METRICS_BIND", "127.0.0.1:0")
    trainer = TrainerSettings()
    assert (trainer.log_format, trainer.metrics_bind) == ("json", "127.0.0.1:0")
    monkeypatch.setenv("TEMPER_SAMPLER_DTYPE", "float64")
    with pytest.raises(ValueError, match="dtype"):
        SamplerSettings()
