"""The operator command (python -m temper.scheduler.admin) checks its inputs as the API does: a clear
message, a non-zero exit, and nothing changed — the database is not even opened."""

from __future__ import annotations

import pytest

from temper.scheduler import admin


def run(tmp_path, capsys, *argv: str) -> tuple[int, str, bool]:
    """(exit status, stderr, whether the database file exists afterwards)."""
    db = tmp_path / "admin.db"
    try:
        status = admin.main(["--database-url", f"sqlite:///{db}", *argv])
    except SystemExit as exc:  # argparse's refusals
        status = exc.code
    return status, capsys.readouterr().err, db.exists()


@pytest.mark.parametrize("argv, says", [
    (["create-key", "--tenant", ""], "--tenant must not be empty"),
    (["create-key", "--tenant", "   "], "--tenant must not be empty"),
    (["create-key", "--tenant", "ali\x07ce"], "--tenant contains control characters"),
    (["create-key", "--tenant", "ali\nce"], "--tenant contains control characters"),
    (["create-key", "--tenant", "a" * 129], "--tenant is 129 characters long (at most 128)"),
    (["create-key", "--tenant", "alice", "--label", "l" * 129], "--label is 129 characters long"),
    (["create-key", "--tenant", "alice", "--label", "lap\x00top"], "--label contains a NUL character"),
    (["set-quota", "--tenant", "", "--max-training-runs", "1"], "--tenant must not be empty"),
    (["show-quota", "--tenant", "a" * 500], "--tenant is 500 characters long"),
    (["list-keys", "--tenant", "x\x1b[2J"], "--tenant contains control characters"),
    (["revoke-key", "tml-\x00"], "the key contains a NUL character"),
    (["set-quota", "--tenant", "alice", "--max-training-runs", "-1"], "-1 is outside [0, 9223372036854775807]"),
    (["set-quota", "--tenant", "alice", "--max-storage-bytes", str(2**63)], "is outside [0, 9223372036854775807]"),
    (["set-quota", "--tenant", "alice", "--train-tokens-per-minute", "lots"], "is not a whole number or 'default'"),
])
def test_bad_operator_input_is_refused_by_name_and_changes_nothing(tmp_path, capsys, argv, says):
    status, err, created = run(tmp_path, capsys, *argv)
    assert status == 2 and says in err, (status, err)
    assert "Traceback" not in err and "sqlalchemy" not in err.lower()
    assert not created  # refused before the database was opened


def test_good_operator_input_still_works(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'admin.db'}"
    assert admin.main(["--database-url", url, "create-key", "--tenant", "alice", "--label", "laptop"]) == 0
    assert capsys.readouterr().out.startswith("tml-")  # the new key, alone on stdout
    status, _, _ = run(tmp_path, capsys, "set-quota", "--tenant", "alice", "--max-training-runs", "4",
                       "--max-storage-bytes", str(2**63 - 1), "--train-tokens-per-minute", "default")
    assert status == 0
    status = admin.main(["--database-url", url, "show-quota", "--tenant", "alice"])
    out = capsys.readouterr().out
    assert status == 0 and "max_training_runs = 4" in out and f"max_storage_bytes = {2**63 - 1}" in out
    assert "train_tokens_per_minute = default" in out
