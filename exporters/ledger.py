"""The usage ledger: one durable record per finished request, for billing.

SQLAlchemy Core over SQLite (WAL; the embedded default) or PostgreSQL (one
ledger for many replicas: the same code, a `postgresql://` URL). The request
id is the primary key and the idempotency key: writing a record twice, or
replaying records after a crash, changes nothing. The schema is versioned;
`migrate()` applies what a database lacks, in order, in one transaction.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields

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
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

from engine.paths import kvlease_home

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
    price_basis: str | None = None  # the tier's prices when written (engine.tenancy.Prices)
    lease_covered_tokens: int = 0  # prefix tokens its session's running lease was to keep


metadata = MetaData()
records = Table(
    "usage_records",
    metadata,
    Column("request_id", String(200), primary_key=True),
    Column("tenant_id", String(128), nullable=False),
    Column("tier", String(32)),
    Column("session_id", String(128)),
    Column("model", String(200), nullable=False),
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
)
# Version -> statements. Append, never edit: a database at version N runs N+1.. only.
MIGRATIONS: dict[int, Sequence[str]] = {
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
}
SCHEMA_VERSION = max(MIGRATIONS)
assert [c.name for c in records.columns] == [f.name for f in fields(UsageRecord)]


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
    batched by the caller (`exporters.writer`).

    `create=False` is for readers (exports, the dashboard): a ledger that does not exist
    is a `LedgerError`, never an empty database made where a typo pointed. Every failure
    to open (not a URL, an unknown scheme, an unreachable server, a file that is not a
    database) is a `LedgerError` with one line to show."""

    def __init__(self, url: str | None = None, create: bool = True) -> None:
        given = url or default_url()
        self.url = given
        sqlite_path = given.removeprefix("sqlite:///") if given.startswith("sqlite:///") else None
        if sqlite_path and sqlite_path != ":memory:":
            if not create and not os.path.isfile(sqlite_path):
                raise LedgerError(f"no usage ledger at {sqlite_path}")
            os.makedirs(os.path.dirname(os.path.abspath(sqlite_path)), exist_ok=True)
        for alias in ("postgresql://", "postgres://"):  # psycopg 3, under either spelling
            if given.startswith(alias):
                self.url = "postgresql+psycopg://" + given.removeprefix(alias)
        try:
            self.engine: Engine = create_engine(self.url, pool_pre_ping=True)
        except (ArgumentError, NoSuchModuleError, ValueError) as exc:
            raise LedgerError(
                f"{redact(given)!r} is not a ledger URL (sqlite:///PATH or "
                f"postgresql://USER:PASSWORD@HOST/DB): {one_line(exc)}"
            ) from None
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
        """Bring the schema to SCHEMA_VERSION; returns the version it found."""
        with self.engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS kvlease_schema (version INTEGER)"))
            found = conn.execute(text("SELECT max(version) FROM kvlease_schema")).scalar() or 0
            for version in sorted(v for v in MIGRATIONS if v > found):
                for statement in MIGRATIONS[version]:
                    conn.execute(text(statement))
                conn.execute(
                    text("INSERT INTO kvlease_schema (version) VALUES (:v)"), {"v": version}
                )
        return found

    def write(self, batch: Iterable[UsageRecord]) -> int:
        """Insert records, skipping request ids already present. One transaction."""
        rows = [asdict(r) for r in batch]
        if not rows:
            return 0
        dialect = self.engine.dialect.name
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        statement = (
            insert(records)
            .on_conflict_do_nothing(index_elements=["request_id"])
            .returning(records.c.request_id)
        )
        with self.engine.begin() as conn:
            return len(conn.execute(statement, rows).all())  # the rows actually inserted

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
                for row in chunk:
                    yield UsageRecord(*row)  # the table's columns are the record's fields

    def count(self) -> int:
        with self.engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM usage_records")).scalar() or 0


def one_line(exc: BaseException) -> str:
    """A driver error's first line, without SQLAlchemy's background link."""
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")  # a committed record survives a crash
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()
