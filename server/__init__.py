"""The top layer: the HTTP front door and the command line.

`middleware` (TenantMiddleware, for vLLM's `--middleware`), `admin` (the
`kvlease_admin` endpoint plugin), `serve` (the `kvlease serve` launcher, which
runs vLLM's own OpenAI server) and `cli` (the `kvlease` command).
"""
