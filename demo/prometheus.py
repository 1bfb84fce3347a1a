"""A Prometheus configuration for scraping kvlease servers, with kvlease's alert rules.

Used by `kvlease demo` and the tests that start Debian's `prometheus`; an
operator's Prometheus needs the same two things: a scrape job for each
server's `/metrics` and `rule_files: [grafana/alerts.yml]`.
"""

from __future__ import annotations

import json
from pathlib import Path

ALERT_RULES = Path(__file__).resolve().parent.parent / "grafana" / "alerts.yml"


def config_text(
    targets: list[str],
    interval: str = "15s",
    rules: Path | None = ALERT_RULES,
    bearer_file: Path | None = None,
) -> str:
    """prometheus.yml (YAML is a superset of JSON: lists and strings are JSON-quoted).
    `bearer_file` holds a token with the `metrics` role, for servers run with
    `--metrics-auth` (Prometheus sends it as `Authorization: Bearer`)."""
    lines = [f"global: {{scrape_interval: {interval}, evaluation_interval: {interval}}}"]
    if rules is not None:
        lines.append(f"rule_files: [{json.dumps(str(rules))}]")
    lines += [
        "scrape_configs:",
        "  - job_name: kvlease",
        f"    static_configs: [{{targets: {json.dumps(targets)}}}]",
    ]
    if bearer_file is not None:
        lines.append(
            f"    authorization: {{type: Bearer, credentials_file: {json.dumps(str(bearer_file))}}}"
        )
    return "\n".join(lines) + "\n"


def write_config(folder: Path, targets: list[str], interval: str = "15s") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "prometheus.yml"
    path.write_text(config_text(targets, interval))
    return path
