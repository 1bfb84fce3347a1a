"""`kvlease usage export` refuses what it cannot read in one line (exit 2), and a reader
never creates a ledger."""

from __future__ import annotations

import pytest
from servers import free_port

from exporters.ledger import LedgerError, UsageLedger, redact
from server.cli import main


def _export(capsys, *args: str) -> tuple[int, str]:
    code = main(["usage", "export", "--from", "2026-11-01", "--to", "2026-12-01", *args])
    err = capsys.readouterr().err
    return code, err


def test_a_wrong_path_is_an_error_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "typo" / "usage.db"
    code, err = _export(capsys, "--usage-db", f"sqlite:///{missing}")
    assert code == 2 and err.count("\n") == 1 and "no usage ledger" in err
    assert not missing.exists() and not missing.parent.exists()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "not a ledger URL"),
        ("mysql+nodriver://x@h/db", "not a ledger URL"),
        (f"postgresql://kv:s3cret@127.0.0.1:{free_port()}/usage", "usage ledger"),
    ],
)
def test_a_ledger_that_cannot_be_opened_is_one_line(capsys, url, message):
    code, err = _export(capsys, "--usage-db", url)
    assert code == 2 and err.count("\n") == 1 and message in err
    assert "s3cret" not in err


def test_a_file_that_is_not_a_database_is_one_line(tmp_path, capsys):
    junk = tmp_path / "notes.txt"
    junk.write_text("not a database\n" * 100)
    code, err = _export(capsys, "--usage-db", f"sqlite:///{junk}")
    assert code == 2 and err.count("\n") == 1 and "usage ledger" in err
    assert junk.read_text() == "not a database\n" * 100


def test_a_missing_output_directory_is_one_line(november_ledger, tmp_path, capsys):
    out = tmp_path / "no" / "such" / "dir" / "nov.csv"
    code, err = _export(capsys, "--usage-db", november_ledger.url, "-o", str(out))
    assert code == 2 and err.count("\n") == 1 and "cannot write" in err


def test_postgres_urls_are_accepted_under_either_scheme(postgres_url):
    UsageLedger(postgres_url)  # the writer's side makes it
    alias = postgres_url.replace("postgresql://", "postgres://", 1)
    assert UsageLedger(alias, create=False).count() >= 0


def test_a_database_without_a_ledger_is_not_read_as_one(tmp_path):
    import sqlite3

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    with pytest.raises(LedgerError, match="holds no kvlease usage ledger"):
        UsageLedger(f"sqlite:///{other}", create=False)


def test_passwords_are_hidden_in_ledger_urls():
    assert redact("postgresql://kv:pw@db:5432/usage") == "postgresql://kv:***@db:5432/usage"
    assert "pw" not in redact("postgres ql://kv:pw@db/usage")
