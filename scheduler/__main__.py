"""Run the scheduler (the public API): `python -m temper.scheduler` (settings from TEMPER_SCHEDULER_*)."""

from __future__ import annotations

import asyncio
import sys

from temper.common.internal_auth import InternalAuthConfigError
from temper.common.server import configure_logging
from temper.scheduler.app import serve
from temper.scheduler.settings import SchedulerSettings


def main() -> None:
    settings = SchedulerSettings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        sys.exit(asyncio.run(serve(settings)))
    except InternalAuthConfigError as exc:
        sys.exit(f"temper scheduler: {exc}")


if __name__ == "__main__":
    main()
