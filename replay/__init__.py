"""`kvlease replay`: recorded traffic through vLLM's scheduler with kvlease's, offline, on a
step clock, under the tier table in force and a proposed one. `kvlease.replay.command` runs the
two sides; `kvlease.replay.synthetic` is the model-free engine (the one module here that imports
vLLM)."""
