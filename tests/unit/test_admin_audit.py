"""The admin command's audit log and admin keys (SQLite, migrated as the scheduler does): create-key
--admin makes an admin key, every change it makes is logged as the admin command's, audit-log prints
them newest first with its filters, and its inputs are refused by name before the database opens."""

from __future__ import annotations

import pytest

from temper.scheduler import admin


def run(url: str, capsys, *argv: str) -> tuple[int, str, str]:
    try:
        status = admin.main(["--database-url", url, *argv])
    except SystemExit as exc:  # argparse's refusals
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_admin_keys_and_the_audit_log(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'admin.db'}"
    status, key, _ = run(url, capsys, "create-key", "--tenant", "ops", "--admin", "--label", "oncall")
    assert status == 0 and key.startswith("tml-")
    assert run(url, capsys, "create-key", "--tenant", "alice")[0] == 0
    assert run(url, capsys, "set-quota", "--tenant", "alice", "--max-storage-bytes", "1000")[0] == 0
    assert run(url, capsys, "revoke-key", key.strip()[:12])[0] == 0

    status, listing, _ = run(url, capsys, "list-keys")
    rows = [line.split() for line in listing.splitlines()[1:]]
    assert status == 0 and [(r[2], r[3]) for r in rows] == [("ops", "admin"), ("alice", "tenant")]

    status, out, _ = run(url, capsys, "audit-log")
    lines = out.splitlines()
    assert status == 0 and lines[0].split()[:3] == ["id", "at", "(UTC)"]
    actions = [(line.split()[3], line.split()[4], line.split()[5]) for line in lines[1:]]  # tenant, who, action
    assert actions == [("ops", "admin-command", "api_key.revoke"), ("alice", "admin-command", "quota.set"),
                       ("alice", "admin-command", "api_key.create"), ("ops", "admin-command", "api_key.create")]
    assert "max_storage_bytes=1000" in lines[2] and "is_admin=true" in lines[4] and "label=oncall" in lines[4]

    status, out, _ = run(url, capsys, "audit-log", "--tenant", "alice", "--action", "quota.set")
    assert status == 0 and len(out.splitlines()) == 2 and "quota.set" in out
    status, out, err = run(url, capsys, "audit-log", "--limit", "1")
    assert status == 0 and len(out.splitlines()) == 2 and "api_key.revoke" in out and "older entries remain" in err
    status, out, _ = run(url, capsys, "audit-log", "--since", "2999-01-01T00:00")
    assert status == 0 and out.splitlines()[1:] == []
    assert len(run(url, capsys, "audit-log", "--since", "10m")[1].splitlines()) == 5


@pytest.mark.parametrize("argv, says", [
    (["audit-log", "--tenant", ""], "--tenant must not be empty"),
    (["audit-log", "--tenant", "a\x1bb"], "--tenant contains control characters"),
    (["audit-log", "--tenant", "a" * 129], "--tenant is 129 characters long"),
    (["audit-log", "--since", "yesterday"], "is neither an age (30m, 2h, 7d) nor an ISO time"),
    (["audit-log", "--since", "999999d"], "reaches back before the year 1"),
    (["audit-log", "--limit", "0"], "0 is outside [1, 1000]"),
    (["audit-log", "--limit", "lots"], "is not a whole number"),
    (["audit-log", "--action", "drop_table"], "invalid choice"),
    (["create-key", "--tenant", "ops", "--admin", "--label", "x\x00"], "--label contains a NUL character"),
])
def test_bad_audit_log_input_is_refused_before_the_database_opens(tmp_path, capsys, argv, says):
    db = tmp_path / "admin.db"
    status, _, err = run(f"sqlite:///{db}", capsys, *argv)
    assert status == 2 and says in err, (status, err)
    assert "Traceback" not in err and not db.exists()
