"""The FOCUS export against the FinOps Foundation's own validator, `focus-validator`.

Its 2.x needs Python >= 3.12 (not on these machines); 1.0.0 runs on 3.11 (beside
`multimethod<1.11`) and checks FOCUS 1.0 rules, so it is installed into a throwaway
venv of its own (cached between runs) and the only failures accepted are the columns
FOCUS renamed between 1.0 and 1.2, listed here with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from records import NOV, rec

from kvlease.exporters.ledger import UsageLedger
from kvlease.server.cli import main

VALIDATOR = ("focus-validator==1.0.0", "multimethod<1.11")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlease-tests"
# FOCUS 1.0 name -> the FOCUS 1.2 column kvlease writes instead.
RENAMED_SINCE_1_0 = {
    "InvoiceIssuer_Required": "InvoiceIssuerName (1.1 renamed InvoiceIssuer)",
    "Provider_Required": "ProviderName (1.1 renamed Provider)",
    "Publisher_Required": "PublisherName (1.1 renamed Publisher)",
    "ResourceID_Required": "ResourceId (the validator's 1.0 rules spell it ResourceID)",
    "SkuPriceId_Nullable": "reads 1.0's ChargeType, which 1.1 replaced with ChargeCategory",
}


@pytest.fixture(scope="session")
def validator() -> tuple[Path, Path]:
    """(the focus-validator command, its site-packages: it reads its currency list from a
    path relative to the working directory)."""
    venv = CACHE / "focus-validator-1.0.0"
    done = venv / ".complete"
    if not done.exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "--quiet", *VALIDATOR],
            check=True,
            timeout=900,
        )
        done.touch()
    [site] = (venv / "lib").glob("python3.*/site-packages")
    return venv / "bin" / "focus-validator", site


def test_a_month_of_usage_passes_the_finops_validator_but_for_the_renames(validator, tmp_path):
    command, site = validator
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'usage.db'}")
    tiers = ["premium", "standard", "free", None]  # None: unclassified traffic, priced 0
    ledger.write(
        [rec(i, tenant=f"tenant-{i % 5}", tier=tiers[i % 4], at=NOV + 3600 * i) for i in range(120)]
    )
    out = tmp_path / "focus.csv"
    window = ["--from", "2026-11-01", "--to", "2026-12-01", "--granularity", "day"]
    assert main(["usage", "export", "--usage-db", ledger.url, *window, "-o", str(out)]) == 0
    rules = ["--validate-version", "1.0", "--column-namespace", "x"]
    done = subprocess.run(
        [str(command), "--data-file", str(out), *rules],
        cwd=site,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = done.stdout + done.stderr
    failed = set(re.findall(r"^(\w+) failed:", report, flags=re.MULTILINE))
    # Exactly the renames: the 1.0 names are absent from a 1.2 file, so the validator must
    # name them (which also shows it ran its rules), and nothing else.
    assert failed == set(RENAMED_SINCE_1_0), report[-4000:]
