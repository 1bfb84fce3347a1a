"""Everything kvlease does in vLLM's API process with what the engine tells it: the request
join, the engine view and its history, metrics, tracing, the usage ledger and its writer,
billing, and the stat-logger plugin. `kvlease.exporters.telemetry` starts and stops them all."""
