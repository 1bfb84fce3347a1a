"""`make demo`: the demo model, a seeded multi-tenant trace, its client, and the run that
starts the server, Prometheus and the dashboard together."""
