"""Database outages as retryable errors, for every store class."""

from __future__ import annotations

import functools
from datetime import datetime, timezone

from sqlalchemy import exc as sa_exc

from temper.common.errors import Unavailable

# Errors of a database that is down, restarting or unreachable: the call may be retried.
TRANSIENT_ERRORS = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError)


def database_errors(cls):
    """Every public method answers a database outage as Unavailable (retryable), never driver text
    as INTERNAL. Which statement failed stays in the log, not in the client's message."""

    def wrap(fn):
        @functools.wraps(fn)
        def method(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except TRANSIENT_ERRORS as exc:
                raise Unavailable(f"the database is unavailable ({type(getattr(exc, 'orig', None) or exc).__name__}); retry") from exc
            except sa_exc.DBAPIError as exc:
                if exc.connection_invalidated:
                    raise Unavailable("the database connection was lost; retry") from exc
                raise

        return method

    for name, value in list(vars(cls).items()):
        if callable(value) and not name.startswith("_"):
            setattr(cls, name, wrap(value))
    return cls


def now() -> datetime:
    return datetime.now(timezone.utc)
