"""kvlease: tenant-aware KV-cache preemption, leases and usage accounting for one shared
vLLM engine.

The repository keeps one folder per layer (engine/, exporters/, dashboard/, grafana/,
demo/, replay/, server/); installed, each is a subpackage of this one
(`kvlease.engine`, ...), mapped in pyproject.toml, so nothing but `kvlease` lands in
site-packages. Importing this package imports nothing else."""
