"""Operator commands on the scheduler's database: tenants' API keys and limits.

    python -m temper.scheduler.admin create-key --tenant alice     # prints the new key alone on stdout
    python -m temper.scheduler.admin create-key --tenant ops --admin   # an operator's key (cluster status, every audit entry)
    python -m temper.scheduler.admin list-keys [--tenant alice]
    python -m temper.scheduler.admin revoke-key tml-AbCdEfGh         # by prefix, id or whole key
    python -m temper.scheduler.admin set-quota --tenant alice --max-training-runs 4 --train-tokens-per-minute 200000
    python -m temper.scheduler.admin show-quota --tenant alice
    python -m temper.scheduler.admin audit-log [--tenant alice] [--since 2h | 2026-12-01T09:00] [--action A] [--limit 50]
    python -m temper.scheduler.admin replicas        # scheduler replicas and their lanes' leases (PostgreSQL)
    python -m temper.scheduler.admin create-project --tenant alice --name nightly   # prints the project's id
    python -m temper.scheduler.admin list-projects --tenant alice

The database is the scheduler's (TEMPER_SCHEDULER_DATABASE_URL, or --database-url). A running
scheduler sees a revoked key within its key cache time and new limits within seconds. Every change
made here is in the audit log as the admin command's (actor "admin-command").
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import datetime, timedelta, timezone

from temper.common.errors import InvalidArgument
from temper.common.strings import check_text, shown
from temper.scheduler.cluster.directory import ReplicaDirectory
from temper.scheduler.db.audit import AUDIT_ACTIONS, MAX_PAGE, Actor, AuditQuery
from temper.scheduler.db.store import Store, upgrade_schema
from temper.scheduler.db.tenancy import LIMIT_COLUMNS
from temper.scheduler.settings import SchedulerSettings


def open_store(database_url: str | None = None) -> Store:
    settings = SchedulerSettings()
    url = database_url or settings.database_url
    if settings.auto_migrate:
        upgrade_schema(url)
    return Store(url)


def create_key(database_url: str, tenant: str, label: str = "", is_admin: bool = False) -> str:
    """A new API key for ``tenant`` (LocalStack and tests use this; people use the command)."""
    store = open_store(database_url)
    try:
        return store.create_api_key(tenant, label, is_admin, Actor.admin_command())[0]
    finally:
        store.engine.dispose()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m temper.scheduler.admin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", help="default: TEMPER_SCHEDULER_DATABASE_URL")
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("create-key", help="create an API key; prints it (shown only this once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--label", default="", help="a note to tell keys apart")
    create.add_argument("--admin", action="store_true", help="an operator's key: cluster status and every tenant's audit log")
    listing = commands.add_parser("list-keys", help="keys with prefix, tenant, created, last used, revoked")
    listing.add_argument("--tenant")
    revoke = commands.add_parser("revoke-key", help="revoke a key by its prefix, id or the whole key")
    revoke.add_argument("key")
    quota = commands.add_parser("set-quota", help="set a tenant's limits (0: unlimited; 'default': the scheduler's default)")
    quota.add_argument("--tenant", required=True)
    for name in LIMIT_COLUMNS:
        quota.add_argument(f"--{name.replace('_', '-')}", dest=name, type=_limit, default=argparse.SUPPRESS)
    show = commands.add_parser("show-quota", help="a tenant's own limits (unset: the scheduler's default)")
    show.add_argument("--tenant", required=True)
    audit = commands.add_parser("audit-log", help="audit entries, newest first (who, what, when)")
    audit.add_argument("--tenant", help="only this tenant's entries (default: every tenant's)")
    audit.add_argument("--since", type=_since, help="entries at or after this: an ISO time (UTC unless it says) or an age: 30m, 2h, 7d")
    audit.add_argument("--action", choices=AUDIT_ACTIONS, help="only this action")
    audit.add_argument("--limit", type=_page, default=100, help=f"at most this many entries (1 to {MAX_PAGE}; default 100)")
    project = commands.add_parser("create-project", help="create a project of a tenant (sessions join it by its id); prints the id")
    project.add_argument("--tenant", required=True)
    project.add_argument("--name", required=True, help="unique within the tenant; at most 256 characters")
    commands.add_parser("list-projects", help="a tenant's projects: id, created, name").add_argument("--tenant", required=True)
    commands.add_parser("replicas", help="scheduler replicas (live or silent, last heard) and every lane's lease "
                                         "(holder, token, age, time left); docs/replicas.md")
    return parser


# What the database holds: tenants.name and api_keys.label are String(128), limits BIGINT.
MAX_NAME_CHARS = 128
MAX_LIMIT = 2**63 - 1


def _limit(text: str) -> int | None:
    """A limit: 'default', or a whole number in [0, 2**63 - 1] (0: unlimited)."""
    if text == "default":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text, 40)} is not a whole number or 'default'") from None
    if not 0 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is outside [0, {MAX_LIMIT}] (0: unlimited)")
    return value


AGE = re.compile(r"(\d{1,6})([smhd])")
AGE_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def _since(text: str) -> datetime:
    """An age (30m, 2h, 7d: that long ago) or an ISO 8601 time (UTC unless it names a zone)."""
    age = AGE.fullmatch(text)
    if age:
        try:
            return datetime.now(timezone.utc) - timedelta(**{AGE_UNITS[age.group(2)]: int(age.group(1))})
        except OverflowError:
            raise argparse.ArgumentTypeError(f"{text} reaches back before the year 1") from None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text, 40)} is neither an age (30m, 2h, 7d) nor an ISO time "
                                         "(2026-12-01T09:00)") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def _page(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text, 40)} is not a whole number") from None
    if not 1 <= value <= MAX_PAGE:
        raise argparse.ArgumentTypeError(f"{value} is outside [1, {MAX_PAGE}]")
    return value


def check_arguments(args: argparse.Namespace) -> None:
    """The checks the API makes on names, for operators too (InvalidArgument naming the option): a tenant
    name is 1 to 128 characters without control characters, a label at most 128 without them."""
    tenant = getattr(args, "tenant", None)
    if tenant is not None or args.command in ("create-key", "set-quota", "show-quota", "create-project", "list-projects"):
        if not tenant or not tenant.strip():
            raise InvalidArgument("--tenant must not be empty")
        if len(tenant) > MAX_NAME_CHARS:
            raise InvalidArgument(f"--tenant is {len(tenant)} characters long (at most {MAX_NAME_CHARS})")
        check_text(tenant, "--tenant", identifier=True)
    label = getattr(args, "label", "")
    if len(label) > MAX_NAME_CHARS:
        raise InvalidArgument(f"--label is {len(label)} characters long (at most {MAX_NAME_CHARS})")
    check_text(label, "--label", identifier=True)
    key = getattr(args, "key", None)
    if key is not None:
        check_text(key, "the key", identifier=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:  # before the database is opened: a refused command changes nothing
        check_arguments(args)
    except InvalidArgument as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    store = open_store(args.database_url)
    try:
        operator = Actor.admin_command()
        if args.command == "create-key":
            print(store.create_api_key(args.tenant, args.label, args.admin, operator)[0])
        elif args.command == "list-keys":
            print(f"{'id':>4}  {'prefix':<13} {'tenant':<20} {'role':<6} {'created':<20} {'last used':<20} {'revoked':<20} label")
            for row, tenant in store.list_api_keys(args.tenant):
                times = [_when(t) for t in (row.created_at, row.last_used_at, row.revoked_at)]
                role = "admin" if row.is_admin else "tenant"
                print(f"{row.id:>4}  {row.prefix:<13} {tenant:<20} {role:<6} {times[0]:<20} {times[1]:<20} {times[2]:<20} {row.label}")
        elif args.command == "revoke-key":
            row = store.revoke_api_key(args.key, actor=operator)
            print(f"revoked {row.prefix}… (id {row.id})", file=sys.stderr)
        elif args.command == "set-quota":
            limits = {n: getattr(args, n) for n in LIMIT_COLUMNS if hasattr(args, n)}
            _print_limits(store.set_limits(args.tenant, limits, operator))
        elif args.command == "show-quota":
            _print_limits(store.tenant_limits(args.tenant))
        elif args.command == "audit-log":
            rows, more = store.audit_entries(AuditQuery(tenant=args.tenant, since=args.since, action=args.action or "",
                                                        limit=args.limit))
            _print_audit(rows, more)
        elif args.command == "replicas":
            _print_replicas(store)
        elif args.command == "create-project":
            print(store.create_project(args.tenant, args.name, operator).id)
        elif args.command == "list-projects":
            for row in store.tenant_projects(args.tenant):
                print(f"{row.id:<22} {_when(row.created_at):<20} {row.name}")
    except Exception as exc:  # noqa: BLE001 - a command-line tool answers with a message and a status
        message = getattr(exc, "message", None) or str(exc)
        print(f"error: {message}", file=sys.stderr)
        return 1
    finally:
        store.engine.dispose()
    return 0


def _print_replicas(store: Store) -> None:
    if store.engine.dialect.name != "postgresql":
        raise InvalidArgument("scheduler replicas need PostgreSQL; this database is one scheduler's")
    view = ReplicaDirectory(store.sessions).view(SchedulerSettings().lease_seconds)
    addresses = {r.owner: r.address for r in view.replicas}
    print(f"{'replica':<28} {'address':<24} {'state':<7} {'heard':>9}  lanes")
    for r in view.replicas:
        lanes = sum(1 for h in view.lanes if h.owner == r.owner and h.live)
        print(f"{r.owner:<28} {r.address:<24} {'live' if r.live else 'silent':<7} {r.silent_for:>8.1f}s  {lanes}")
    print(f"\n{'lane (trainer)':<24} {'holder':<24} {'token':>6} {'age':>8} {'left':>8}")
    for h in view.lanes:
        holder = addresses.get(h.owner, h.owner) if h.owner and h.live else "-"
        print(f"{h.lane:<24} {holder:<24} {h.token:>6} {h.age:>7.1f}s {h.left_for:>7.1f}s")


def _print_limits(limits: dict[str, int | None]) -> None:
    for name, value in limits.items():
        print(f"{name} = {'default' if value is None else value}")


def _print_audit(rows, more: bool) -> None:
    print(f"{'id':>6}  {'at (UTC)':<20} {'tenant':<20} {'who':<14} {'action':<22} {'target':<40} details")
    for row in rows:
        who = row.key_prefix or row.actor
        details = " ".join(f"{k}={v}" for k, v in sorted((row.details or {}).items()))
        print(f"{row.id:>6}  {_when(row.at):<20} {row.tenant:<20} {who:<14} {row.action:<22} {row.target:<40} {details}")
    if more:
        print("(older entries remain: raise --limit or narrow --since)", file=sys.stderr)


def _when(value) -> str:
    if value is None:
        return "-"
    return (value.astimezone(timezone.utc) if value.tzinfo is not None else value).strftime("%Y-%m-%d %H:%M:%S")


if __name__ == "__main__":
    raise SystemExit(main())
