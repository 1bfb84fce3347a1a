"""The usage ledger: one durable record per finished request, for billing.

Beside them, one record per *retention episode*: a leased session's cached blocks
between two of its turns (kvlease.engine.retention), outcome `retention`, keyed
`<request id>:retention` by the request whose end opened it, with no tokens and its
reserved and retained block-seconds; billed as the "KV retention" SKU.

SQLAlchemy Core over SQLite (WAL; the embedded default) or PostgreSQL (one
ledger for many replicas: the same code, a `postgresql://` URL). The request
id is the primary key and the idempotency key: writing a record twice, or
replaying records after a crash, changes nothing. Beside the records it keeps
their hourly sums (`kvlease.exporters.rollups`) in the same transaction, which exports,
the usage page and budgets read; the records stay the source of truth
(`rebuild_rollups`), and `prune` drops old ones while keeping their sums. The
schema is versioned; `migrate()` applies what a database lacks, in order, in one
transaction.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    Boolean,
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError

from kvlease.engine.paths import kvlease_home, private_file
from kvlease.exporters import rollups
from kvlease.exporters.rollups import HOUR, Rollup, block_us, hour_of

DB_ENV = "KVLEASE_USAGE_DB"


@dataclass(frozen=True)
class UsageRecord:
    """One finished request. Times are UTC epoch seconds."""

    request_id: str
    tenant_id: str
    tier: str | None
    session_id: str | None
    model: str
    started_at: float
    ended_at: float
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    recomputed_tokens: int
    preemptions: int
    kv_block_seconds: float
    outcome: str
    partial: bool = False  # delivered before every half arrived: figures may be low
    price_basis: str | None = None  # the tier's prices when written (kvlease.engine.tenancy.Prices)
    lease_covered_tokens: int = 0  # prefix tokens its session's running lease was to keep
    kv_reserved_block_seconds: float = 0.0  # retention records: blocks kept from lower tiers
    kv_retained_block_seconds: float = 0.0  # retention records: blocks evicted last
    # its recomputed tokens by the tier whose allocation preempted it, as JSON
    # (`{"premium": 120}`; "none": a prefix-cache reset); None before schema version 8
    recomputed_by: str | None = None


Row = tuple[Any, ...]  # a record as the table's columns, in order (what a SQLAlchemy Row is)
RETENTION = "retention"  # the outcome of a retention record (every other record: a request)
MODEL_LENGTH = 200  # the longest model name a record keeps


def causes_text(causes: dict[str, int]) -> str | None:
    """`recomputed_by` as stored: compact JSON, keys sorted; None when nothing was."""
    return json.dumps(dict(sorted(causes.items())), separators=(",", ":")) if causes else None


def retention_key(request_id: str) -> str:
    """The retention record's idempotency key, from the request whose end opened it."""
    return f"{request_id}:{RETENTION}"


metadata = MetaData()
records = Table(
    "usage_records",
    metadata,
    Column("request_id", String(200), primary_key=True),
    Column("tenant_id", String(128), nullable=False),
    Column("tier", String(32)),
    Column("session_id", String(128)),
    Column("model", String(MODEL_LENGTH), nullable=False),
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float, nullable=False),
    Column("input_tokens", Integer, nullable=False),
    Column("cached_input_tokens", Integer, nullable=False),
    Column("output_tokens", Integer, nullable=False),
    Column("recomputed_tokens", Integer, nullable=False),
    Column("preemptions", Integer, nullable=False),
    Column("kv_block_seconds", Float, nullable=False),
    Column("outcome", String(16), nullable=False),
    Column("partial", Boolean, nullable=False, default=False),
    Column("price_basis", Text),
    Column("lease_covered_tokens", Integer, nullable=False, default=0),
    Column("kv_reserved_block_seconds", Float, nullable=False, default=0.0),
    Column("kv_retained_block_seconds", Float, nullable=False, default=0.0),
    Column("recomputed_by", Text),
)
# Version -> statements, or a function of the dialect's name giving them. Append, never
# edit: a database at version N runs N+1.. only.
MIGRATIONS: dict[int, Sequence[str] | Callable[[str], Sequence[str]]] = {
    1: (
        "CREATE TABLE IF NOT EXISTS usage_records ("
        " request_id VARCHAR(200) PRIMARY KEY, tenant_id VARCHAR(128) NOT NULL,"
        " tier VARCHAR(32), session_id VARCHAR(128), model VARCHAR(200) NOT NULL,"
        " started_at FLOAT NOT NULL, ended_at FLOAT NOT NULL, input_tokens INTEGER NOT NULL,"
        " cached_input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,"
        " recomputed_tokens INTEGER NOT NULL, preemptions INTEGER NOT NULL,"
        " kv_block_seconds FLOAT NOT NULL, outcome VARCHAR(16) NOT NULL)",
        "CREATE INDEX IF NOT EXISTS usage_records_tenant_end ON usage_records"
        " (tenant_id, ended_at)",
        "CREATE INDEX IF NOT EXISTS usage_records_end ON usage_records (ended_at)",
    ),
    2: ("ALTER TABLE usage_records ADD COLUMN partial BOOLEAN NOT NULL DEFAULT FALSE",),
    3: ("ALTER TABLE usage_records ADD COLUMN price_basis TEXT",),
    4: ("ALTER TABLE usage_records ADD COLUMN lease_covered_tokens INTEGER NOT NULL DEFAULT 0",),
    5: lambda dialect: (
        *rollups.create(dialect, rollups.SUMS_V5),
        rollups.insert_rollups(dialect, "usage_records", sums=rollups.SUMS_V5),  # its own sums
    ),
    6: (
        # Requests still streaming, refreshed by their server every few seconds
        # (kvlease.exporters.open_records): what a crash would otherwise leave unbilled.
        "CREATE TABLE IF NOT EXISTS usage_open ("
        " request_id VARCHAR(200) PRIMARY KEY, tenant_id VARCHAR(128) NOT NULL,"
        " tier VARCHAR(32), session_id VARCHAR(128), model VARCHAR(200) NOT NULL,"
        " started_at FLOAT NOT NULL, updated_at FLOAT NOT NULL,"
        " output_tokens INTEGER NOT NULL, price_basis TEXT, owner VARCHAR(64) NOT NULL)",
        "CREATE INDEX IF NOT EXISTS usage_open_updated ON usage_open (updated_at)",
    ),
    7: (
        # KV retention (issue 30): a lease's blocks between turns, reserved or retained.
        "ALTER TABLE usage_records ADD COLUMN kv_reserved_block_seconds FLOAT NOT NULL DEFAULT 0",
        "ALTER TABLE usage_records ADD COLUMN kv_retained_block_seconds FLOAT NOT NULL DEFAULT 0",
        "ALTER TABLE usage_rollups ADD COLUMN kv_reserved_us BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE usage_rollups ADD COLUMN kv_retained_us BIGINT NOT NULL DEFAULT 0",
    ),
    # Who took the cache: a request's recomputed tokens by the tier that preempted it.
    8: ("ALTER TABLE usage_records ADD COLUMN recomputed_by TEXT",),
}
SCHEMA_VERSION = max(MIGRATIONS)
MIGRATION_LOCK = 0x6B766C65617365  # "kvlease": the advisory lock key migrations take
COLUMNS = tuple(c.name for c in records.columns)
assert list(COLUMNS) == [f.name for f in fields(UsageRecord)]
_row = attrgetter(*COLUMNS)  # a record as the tuple a driver binds, without asdict's copies


class OpenRecord(NamedTuple):
    """A request still in flight, as its server last journaled it."""

    request_id: str
    tenant_id: str
    tier: str | None
    session_id: str | None
    model: str
    started_at: float
    updated_at: float
    output_tokens: int
    price_basis: str | None
    owner: str  # the journaling process: it never recovers its own rows

    def record(self) -> UsageRecord:
        """The partial record of a request whose server stopped journaling it: what it
        had streamed. Its input is not known in the API process before the end."""
        return UsageRecord(
            request_id=self.request_id,
            tenant_id=self.tenant_id,
            tier=self.tier,
            session_id=self.session_id,
            model=self.model,
            started_at=self.started_at,
            ended_at=max(self.updated_at, self.started_at),
            input_tokens=0,
            cached_input_tokens=0,
            output_tokens=self.output_tokens,
            recomputed_tokens=0,
            preemptions=0,
            kv_block_seconds=0.0,
            outcome="aborted",
            partial=True,
            price_basis=self.price_basis,
        )


_OPEN_LIST = ", ".join(OpenRecord._fields)
_OPEN_MARKS = ", ".join(f":{name}" for name in OpenRecord._fields)


def rollup_of(r: UsageRecord) -> Rollup:
    """One record as a rollup of one: for windows that the stored hours cannot cut."""
    return Rollup(
        r.tenant_id,
        r.model,
        hour_of(r.ended_at),
        r.tier,
        r.price_basis,
        0 if r.outcome == RETENTION else 1,
        r.input_tokens,
        r.cached_input_tokens,
        r.output_tokens,
        r.recomputed_tokens,
        r.preemptions,
        r.lease_covered_tokens,
        min(r.lease_covered_tokens, r.cached_input_tokens),
        block_us(r.kv_block_seconds),
        block_us(r.kv_reserved_block_seconds),
        block_us(r.kv_retained_block_seconds),
    )


def default_url() -> str:
    return os.environ.get(DB_ENV) or f"sqlite:///{kvlease_home() / 'usage.db'}"


class LedgerError(ValueError):
    """The ledger cannot be used; the message is one line, with any password hidden."""


def redact(url: str) -> str:
    """`url` with its password replaced by ***, for logs and error messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else url


class UsageLedger:
    """A ledger database. Thread-safe (SQLAlchemy pools connections); writes are
    batched by the caller (`kvlease.exporters.writer`).

    `create=False` is for readers (exports, the dashboard): a ledger that does not exist
    is a `LedgerError`, never an empty database made where a typo pointed. Every failure
    to open (not a URL, an unknown scheme, an unreachable server, a file that is not a
    database) is a `LedgerError` with one line to show."""

    def __init__(self, url: str | None = None, create: bool = True) -> None:
        given = url or default_url()
        self.url = given
        for alias in ("postgresql://", "postgres://"):  # psycopg 3, under either spelling
            if given.startswith(alias):
                self.url = "postgresql+psycopg://" + given.removeprefix(alias)
        not_a_ledger = (
            f"{redact(given)!r} is not a ledger URL (sqlite:///PATH or "
            "postgresql://USER:PASSWORD@HOST/DB)"
        )
        try:
            parsed = make_url(self.url)
        except (ArgumentError, ValueError) as exc:
            raise LedgerError(f"{not_a_ledger}: {one_line(exc)}") from None
        if parsed.get_backend_name() not in ("sqlite", "postgresql"):
            raise LedgerError(not_a_ledger)  # mysql://...: SQLAlchemy knows it, kvlease does not
        sqlite_path = parsed.database if parsed.get_backend_name() == "sqlite" else None
        if sqlite_path and sqlite_path != ":memory:" and not sqlite_path.startswith("file:"):
            if not create and not os.path.isfile(sqlite_path):
                raise LedgerError(f"no usage ledger at {sqlite_path}")
            private_file(Path(sqlite_path).absolute())  # SQLite's -wal and -shm follow its mode
        try:
            self.engine: Engine = create_engine(self.url, pool_pre_ping=True)
        except (ArgumentError, NoSuchModuleError, ImportError, ValueError) as exc:
            raise LedgerError(f"{not_a_ledger}: {one_line(exc)}") from None
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        try:
            if not create:
                self._require_ledger(given)
            self.migrate()
        except SQLAlchemyError as exc:
            raise LedgerError(f"usage ledger {redact(given)!r}: {one_line(exc)}") from None

    def _require_ledger(self, given: str) -> None:
        with self.engine.connect() as conn:
            if not conn.dialect.has_table(conn, "kvlease_schema"):
                raise LedgerError(f"{redact(given)!r} holds no kvlease usage ledger")

    def migrate(self) -> int:
        """Bring the schema to SCHEMA_VERSION; returns the version it found.

        Replicas of a fleet may start together on one fresh PostgreSQL ledger: the first
        to take a transaction-scoped advisory lock migrates, the others wait for it and
        find nothing left to do (two concurrent CREATE TABLEs would fail one of them).
        SQLite serialises writers by itself."""
        with self.engine.begin() as conn:
            if self.dialect == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
            conn.execute(text("CREATE TABLE IF NOT EXISTS kvlease_schema (version INTEGER)"))
            found = conn.execute(text("SELECT max(version) FROM kvlease_schema")).scalar() or 0
            for version in sorted(v for v in MIGRATIONS if v > found):
                statements = MIGRATIONS[version]
                if callable(statements):
                    statements = statements(self.dialect)
                for statement in statements:
                    conn.execute(text(statement))
                conn.execute(
                    text("INSERT INTO kvlease_schema (version) VALUES (:v)"), {"v": version}
                )
        return found

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def write(self, batch: Iterable[UsageRecord]) -> int:
        """Insert records, skipping request ids already present (or repeated in the batch),
        and add the new ones to the rollups, in one transaction: a crash keeps both or
        neither. Returns how many records were new.

        The batch is staged in a temporary table (SQLite: one executemany; PostgreSQL:
        COPY), then moved with set statements: drop ids already present, add the rest to
        the rollups, insert them (bench/ledger.py: about a quarter of the rate of a plain
        load with no rollups and one transaction)."""
        unique: dict[str, Row] = {}
        for record in batch:
            unique.setdefault(record.request_id, _row(record))
        if not unique:
            return 0
        with self.engine.begin() as conn:
            try:
                if self.dialect == "postgresql":
                    return _write_postgresql(conn, list(unique.values()))
                return _write_sqlite(conn, list(unique.values()))
            except self.engine.dialect.loaded_dbapi.Error as exc:  # raw cursors: not wrapped
                raise DBAPIError.instance(
                    "write usage records", None, exc, self.engine.dialect.loaded_dbapi.Error
                ) from None

    def read(
        self, start: float, end: float, tenants: Sequence[str] = (), batch: int = 5000
    ) -> Iterator[UsageRecord]:
        """Records ended in [start, end), by tenant, model, end time; streamed."""
        query = select(records).where(records.c.ended_at >= start, records.c.ended_at < end)
        if tenants:
            query = query.where(records.c.tenant_id.in_(list(tenants)))
        query = query.order_by(records.c.tenant_id, records.c.model, records.c.ended_at)
        with self.engine.connect().execution_options(stream_results=True) as conn:
            for chunk in conn.execute(query).partitions(batch):
                for row in chunk:  # the table's columns are the record's fields
                    yield UsageRecord(*cast(Row, row))

    def latest(self, tenant: str, start: float, end: float, limit: int) -> list[UsageRecord]:
        """A tenant's last `limit` records ended in [start, end), newest first: the usage
        page's drill-down from a tenant to its requests."""
        query = (
            select(records)
            .where(
                records.c.tenant_id == tenant,
                records.c.ended_at >= start,
                records.c.ended_at < end,
            )
            .order_by(records.c.ended_at.desc())
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [UsageRecord(*cast(Row, row)) for row in conn.execute(query)]

    def rollups(
        self, start: float, end: float, tenants: Sequence[str] = (), bucket: int = HOUR
    ) -> Iterator[Rollup]:
        """Usage ended in [start, end) summed per (tenant, model, bucket, tier, price
        basis), sorted by (tenant, model, bucket); `bucket` is HOUR or DAY (seconds).

        From the rollups when the window starts and ends on whole hours (any date does);
        a window that cuts an hour is summed from its records instead, so it is exact
        too, but only where records were not pruned."""
        if start % HOUR or end % HOUR:
            for r in self.read(start, end, tenants):
                rollup = rollup_of(r)
                yield replace(rollup, at=rollup.at - rollup.at % bucket)
            return
        tenants = list(dict.fromkeys(tenants))
        query = text(rollups.select_rollups(bucket, len(tenants)))
        params = {"start": start, "end": end, **{f"t{i}": t for i, t in enumerate(tenants)}}
        with self.engine.connect().execution_options(stream_results=True) as conn:
            for chunk in conn.execute(query, params).partitions(5000):
                for row in chunk:
                    yield rollups.from_row(row)

    def journal(self, rows: Sequence[OpenRecord]) -> None:
        """Write (or refresh) the open records of requests still in flight. A request whose
        final record is already in `usage_records` is not journaled again."""
        if not rows:
            return
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    f"INSERT INTO usage_open ({_OPEN_LIST}) VALUES ({_OPEN_MARKS})"
                    " ON CONFLICT (request_id) DO UPDATE SET updated_at = excluded.updated_at,"
                    " output_tokens = excluded.output_tokens, owner = excluded.owner"
                ),
                [r._asdict() for r in rows],
            )
            conn.execute(  # a tick that raced the request's end: its record is in
                text(
                    "DELETE FROM usage_open WHERE EXISTS (SELECT 1 FROM usage_records AS r"
                    " WHERE r.request_id = usage_open.request_id)"
                )
            )

    def recover_open(self, before: float, owner: str = "") -> int:
        """Turn the open records of other owners not refreshed since `before` (their server
        is gone) into partial usage records, outcome aborted: the output streamed until
        then is billed. Idempotent, and safe with several replicas (a request already
        recorded is skipped; `write` deletes the open rows it covers). Returns how many
        records were new."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(f"SELECT {_OPEN_LIST} FROM usage_open WHERE updated_at < :b AND owner <> :o"),
                {"b": before, "o": owner},
            ).all()
        return self.write(OpenRecord(*cast(Row, row)).record() for row in rows) if rows else 0

    def rebuild_rollups(self) -> int:
        """Recompute the rollups from the records for every hour since the prune horizon
        (earlier hours have no records left to sum), in one transaction, with the
        statement `write` maintains them with. Returns the number of rollups."""
        with self.engine.begin() as conn:
            horizon = self._horizon(conn)
            conn.execute(text("DELETE FROM usage_rollups WHERE hour >= :h"), {"h": horizon})
            insert = rollups.insert_rollups(self.dialect, "usage_records", "ended_at >= :h")
            conn.execute(text(insert), {"h": horizon})
            count = "SELECT count(*) FROM usage_rollups WHERE hour >= :h"
            return conn.execute(text(count), {"h": horizon}).scalar() or 0

    def prune(self, before: float) -> int:
        """Delete the records that ended before `before` (a whole UTC hour), keeping
        their rollups, so exports by hour, day or month still add up. Returns how many
        records were deleted; `horizon()` is then `before`, or the later horizon of an
        earlier prune."""
        if before % HOUR:
            raise LedgerError("prune --before must be a whole hour (a date is)")
        with self.engine.begin() as conn:
            query = text("DELETE FROM usage_records WHERE ended_at < :b")
            deleted = conn.execute(query, {"b": before}).rowcount
            horizon = max(self._horizon(conn), int(before))
            conn.execute(text("DELETE FROM usage_retention"))
            conn.execute(text("INSERT INTO usage_retention VALUES (:h)"), {"h": horizon})
        return deleted

    def horizon(self) -> int:
        """Records ended before this epoch second were pruned (0: never pruned)."""
        with self.engine.connect() as conn:
            return self._horizon(conn)

    @staticmethod
    def _horizon(conn: Connection) -> int:
        horizon = conn.execute(text("SELECT max(pruned_before) FROM usage_retention")).scalar()
        return int(horizon or 0)

    def last_ended(self) -> float | None:
        """When the newest record ended (epoch seconds), None for an empty ledger."""
        with self.engine.connect() as conn:
            return conn.execute(text("SELECT max(ended_at) FROM usage_records")).scalar()

    def count(self, requests_only: bool = False) -> int:
        """Records in the ledger; `requests_only`: leave out the KV retention records."""
        where = f" WHERE outcome <> '{RETENTION}'" if requests_only else ""
        with self.engine.connect() as conn:
            return int(
                conn.execute(text(f"SELECT count(*) FROM usage_records{where}")).scalar() or 0
            )


_COLUMN_LIST = ", ".join(COLUMNS)
# A final record closes its request's open record, in the same transaction.
_CLOSE_OPEN = "DELETE FROM usage_open WHERE request_id IN (SELECT request_id FROM usage_incoming)"
_NEW_ONLY = (
    "DELETE FROM usage_incoming WHERE EXISTS"
    " (SELECT 1 FROM usage_records AS r WHERE r.request_id = usage_incoming.request_id)"
)


def _write_sqlite(conn: Connection, rows: list[Row]) -> int:
    cursor = conn.connection.cursor()  # the driver's own: executemany binds tuples fastest
    # A write first, so this transaction holds SQLite's one write lock from here on: no
    # other process can add one of these ids between the check and the insert below.
    cursor.execute("DELETE FROM usage_rollups WHERE 0")
    cursor.execute(
        "CREATE TEMP TABLE IF NOT EXISTS usage_incoming AS SELECT * FROM usage_records WHERE 0"
    )
    marks = ", ".join("?" * len(COLUMNS))
    cursor.executemany(f"INSERT INTO usage_incoming ({_COLUMN_LIST}) VALUES ({marks})", rows)
    cursor.execute(_CLOSE_OPEN)
    cursor.execute(_NEW_ONLY)
    cursor.execute(rollups.insert_rollups("sqlite", "usage_incoming"))
    cursor.execute(
        f"INSERT INTO usage_records ({_COLUMN_LIST}) SELECT {_COLUMN_LIST} FROM usage_incoming"
    )
    new = cursor.rowcount
    cursor.execute("DELETE FROM usage_incoming")
    return new


def _write_postgresql(conn: Connection, rows: list[Row]) -> int:
    cursor = conn.connection.cursor()
    cursor.execute(
        "CREATE TEMP TABLE IF NOT EXISTS usage_incoming (LIKE usage_records) ON COMMIT DELETE ROWS"
    )
    with cursor.copy(f"COPY usage_incoming ({_COLUMN_LIST}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)
    cursor.execute(_CLOSE_OPEN)
    # ON CONFLICT DO NOTHING under concurrency: an id another replica commits first is
    # waited for, then skipped, and only what this statement inserted is rolled up.
    cursor.execute(
        f"WITH new AS (INSERT INTO usage_records ({_COLUMN_LIST})"
        f" SELECT {_COLUMN_LIST} FROM usage_incoming"
        " ON CONFLICT (request_id) DO NOTHING RETURNING *),"
        f" rolled AS ({rollups.insert_rollups('postgresql', 'new')} RETURNING 1)"
        " SELECT count(*) FROM new"
    )
    (new,) = cursor.fetchone() or (0,)  # count(*): always one row
    return int(new)


def one_line(exc: BaseException) -> str:
    """A driver error's first line, without SQLAlchemy's background link."""
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")  # a committed record survives a crash
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA cache_size=-65536")  # 64 MiB: a 10M-record index stays warm
    cursor.close()
