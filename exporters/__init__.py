"""Everything that leaves the engine process: metrics, traces, the usage ledger."""
