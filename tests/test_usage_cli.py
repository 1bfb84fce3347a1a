"""`kvlease usage export`: a month or a window, three formats, an empty export that says
so (exit 1); it refuses what it cannot read in one line (exit 2), and a reader never
creates a ledger."""

from __future__ import annotations

import csv
import io

import pytest
from records import NOV
from servers import free_port

from kvlease.exporters.billing import RAW_COLUMNS
from kvlease.exporters.ledger import LedgerError, UsageLedger, redact
from kvlease.server.cli import main


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
        ("postgresql://kv:s3cret@127.0.0.1:{port}/usage", "usage ledger"),  # nobody listens
    ],
)
def test_a_ledger_that_cannot_be_opened_is_one_line(capsys, url, message):
    # The port is picked when the test runs: every collection (one per xdist worker)
    # must see the same test ids.
    code, err = _export(capsys, "--usage-db", url.format(port=free_port()))
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


@pytest.mark.parametrize("command", ["export", "import"])
def test_a_url_of_another_database_is_one_line(tmp_path, capsys, command):
    raw = tmp_path / "in.csv"
    raw.write_text(",".join(RAW_COLUMNS) + "\n")
    args = ["usage", "import", str(raw)] if command == "import" else ["usage", "export"]
    assert main([*args, "--usage-db", "mysql://x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a ledger URL" in err


def test_a_sqlite_url_with_a_driver_creates_nothing_for_a_reader(tmp_path, capsys):
    missing = tmp_path / "typo" / "usage.db"
    code, err = _export(capsys, "--usage-db", f"sqlite+pysqlite:///{missing}")
    assert code == 2 and "no usage ledger" in err
    assert not missing.exists() and not missing.parent.exists()


def test_import_into_a_ledger_that_does_not_exist_needs_create(tmp_path, capsys):

    raw = tmp_path / "in.csv"
    times = "2026-11-02T10:00:00Z,2026-11-02T10:00:05Z"
    raw.write_text(
        ",".join(RAW_COLUMNS)
        + f"\nkvl-1,acme,premium,,m,{times},10,5,3,0,0,1.5,completed,False,,0,0,0,\n"
    )
    typo = tmp_path / "tpyo" / "usage.db"
    assert main(["usage", "import", str(raw), "--usage-db", f"sqlite:///{typo}"]) == 2
    assert "no usage ledger" in capsys.readouterr().err
    assert not typo.parent.exists()
    assert main(["usage", "import", str(raw), "--usage-db", f"sqlite:///{typo}", "--create"]) == 0
    assert UsageLedger(f"sqlite:///{typo}", create=False).count() == 1


def test_prune_takes_any_date(november_ledger, capsys):
    assert (
        main(["usage", "prune", "--before", "9999-01-01", "--usage-db", november_ledger.url]) == 0
    )
    assert "deleted" in capsys.readouterr().out
    assert november_ledger.count() == 0


def test_a_month_is_that_calendar_month(november_ledger, tmp_path, capsys):
    by_month, by_dates = tmp_path / "month.csv", tmp_path / "dates.csv"
    ledger = ["--usage-db", november_ledger.url]
    assert main(["usage", "export", "--month", "2026-11", *ledger, "-o", str(by_month)]) == 0
    assert _export(capsys, *ledger, "-o", str(by_dates))[0] == 0
    assert by_month.read_bytes() == by_dates.read_bytes() and by_month.read_text().count("\n") > 1
    assert main(["usage", "export", "--month", "11/2026", *ledger]) == 2
    assert "YYYY-MM" in capsys.readouterr().err
    assert main(["usage", "export", "--month", "2026-11", "--to", "2026-12-01", *ledger]) == 2


@pytest.mark.parametrize("fmt", ["focus", "raw", "summary"])
def test_an_empty_export_says_so_on_stderr_and_exits_1(november_ledger, tmp_path, capsys, fmt):
    """A scheduled job must notice a month with no usage (it exited 0 with a header)."""
    out = tmp_path / "empty.csv"
    ledger = ["--usage-db", november_ledger.url, "--format", fmt, "-o", str(out)]
    assert main(["usage", "export", "--month", "2026-10", *ledger]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no usage from 2026-10-01T00:00:00Z" in err
    assert out.read_text().count("\n") == 1  # the header, for a reader that needs one
    assert main(["usage", "export", "--month", "2026-11", "--tenant", "nobody", *ledger]) == 1
    assert "for nobody" in capsys.readouterr().err


def test_the_summary_has_a_row_per_tenant_with_its_statements_total(november_ledger, tiers, capsys):
    from kvlease.exporters.statement import statement

    assert main(["usage", "export", "--month", "2026-11", "--format", "summary",
                 "--usage-db", november_ledger.url]) == 0  # fmt: skip
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["tenant_id"] for r in rows] == ["acme", "bob", "cy"]
    window = (NOV, NOV + 30 * 86400)
    for row in rows:
        s = statement(
            row["tenant_id"], *window, november_ledger.rollups(*window, [row["tenant_id"]]), tiers
        )
        assert (row["amount"], row["statement_number"]) == (str(s.total), s.number)
        assert row["period"] == "November 2026" and row["currency"] == "USD"
    acme = rows[0]
    assert (acme["requests"], acme["input_tokens"], acme["cached_input_tokens"]) == (
        "2",
        "2001",
        "800",
    )


def test_recomputed_tokens_by_cause_are_imported_only_when_they_add_up(tmp_path, capsys):

    times = "2026-11-02T10:00:00Z,2026-11-02T10:00:05Z"
    row = "kvl-{},acme,free,,m," + times + ",10,5,3,120,1,1.5,completed,False,,0,0,0,{}"
    raw = tmp_path / "in.csv"
    lines = [
        row.format(1, '"{""premium"":100,""free"":20}"'),  # adds up
        row.format(2, '"{""premium"":90}"'),  # does not
        row.format(3, "not-json"),
        row.format(4, ""),  # unknown: an earlier kvlease's record
    ]
    raw.write_text(",".join(RAW_COLUMNS) + "\n" + "\n".join(lines) + "\n")
    db = f"sqlite:///{tmp_path / 'u.db'}"
    assert main(["usage", "import", str(raw), "--usage-db", db, "--create"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"{raw}:3: recomputed_by does not add up to recomputed_tokens",
        f"{raw}:4: recomputed_by is not JSON: 'not-json'",
    ]
    stored = {r.request_id: r.recomputed_by for r in UsageLedger(db).read(0, 4e9)}
    assert stored == {"kvl-1": '{"free":20,"premium":100}', "kvl-4": None}
