"""`python -m kvlease ...` is the `kvlease` command (for machines where the script is not
on PATH, and for child processes that must run this interpreter's kvlease)."""

import sys

from kvlease.server.cli import main

sys.exit(main())
