"""Step-cost calibration for `kvlease replay`: what one real engine step costs here.

    python -m bench.calibrate [--quick]

A real in-process vLLM engine (the demo model, stock scheduler) runs steps of
known shape, each timed with `perf_counter` around `LLMEngine.step()`:
prefill-only steps of 1 to 8 prompts of 32 to 1,024 tokens, and decode-only
steps of 1 to 64 requests. A least-squares fit of
`seconds = base + prefill x prompt tokens + decode x decoding requests`
over the medians (relative error) is `kvlease.replay.clock.StepCost`; the fit, every point and its
error go to bench/results/calibrate.{json,md}. Copy the three numbers into
`kvlease.replay.clock.CPU_DEMO` when the machine or the model changes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

from bench import report
from bench.inprocess import start_engine

POOL = 512  # room for 64 decoding requests without preemption
RESULTS = Path(__file__).parent / "results"


def _timed_step(llm) -> float:
    began = time.perf_counter()
    llm.step()
    return time.perf_counter() - began


def _add(llm, n: int, prompt: int, max_tokens: int) -> None:
    from vllm import SamplingParams

    for _ in range(n):
        salt = uuid.uuid4().hex  # no prefix-cache hit between points
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        llm.add_request(salt, {"prompt_token_ids": [11] * prompt, "cache_salt": salt}, params)


def _drain(llm) -> None:
    while llm.has_unfinished_requests():
        llm.step()


def prefill_point(llm, n: int, prompt: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _add(llm, n, prompt, 1)
        times.append(_timed_step(llm))  # every prompt in one step: n x prompt <= 2,048
        _drain(llm)
    return statistics.median(times)


def decode_point(llm, n: int, repeats: int) -> float:
    _add(llm, n, 32, 4 + repeats)
    llm.step()  # the prefills
    times = [_timed_step(llm) for _ in range(repeats)]
    _drain(llm)
    return statistics.median(times)


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(base, per prompt token, per decoding request) seconds, none negative: a step
    cannot get cheaper with more work, however noisy the timings of a busy machine.
    Least squares over every subset of the three terms (exact non-negative least
    squares for three unknowns), the best fit whose terms are all >= 0."""
    import itertools

    import numpy as np

    # Each row divided by its time: the fit minimises relative error, so a 2 ms step
    # counts as much as a 20 ms one.
    a = np.array([[1.0 / t, p / t, d / t] for p, d, t in points])
    ones = np.ones(len(points))
    best: tuple[float, list[float]] | None = None
    for k in (3, 2, 1):
        for columns in itertools.combinations(range(3), k):
            x, *_ = np.linalg.lstsq(a[:, columns], ones, rcond=None)
            if (x < 0).any():
                continue
            full = [0.0, 0.0, 0.0]
            for column, value in zip(columns, x, strict=True):
                full[column] = float(value)
            residual = float(np.sum((a @ np.array(full) - ones) ** 2))
            if best is None or residual < best[0]:
                best = (residual, full)
    assert best is not None  # one column alone always fits with a positive weight
    base, prefill, decode = best[1]
    return base, prefill, decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points and repeats")
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvlease.demo.model import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    llm = start_engine("calibrate", model, Scheduler, "fcfs", POOL, max_len=2048).llm
    repeats = 3 if args.quick else 9
    _add(llm, 4, 64, 8)  # warm-up
    _drain(llm)
    points: list[tuple[int, int, float]] = []
    shapes = [(1, 32), (1, 256), (2, 512), (4, 256)] if args.quick else [
        (1, 32), (1, 128), (1, 256), (1, 512), (1, 1024), (2, 256), (4, 128), (4, 256),
        (8, 128), (2, 1024), (8, 256),
    ]  # fmt: skip
    for n, prompt in shapes:
        points.append((n * prompt, 0, prefill_point(llm, n, prompt, repeats)))
    for n in (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32, 64):
        points.append((0, n, decode_point(llm, n, repeats)))
    base, prefill, decode = fit(points)
    rows = [
        {"prefill_tokens": p, "decoding": d, "measured_s": t,
         "fitted_s": base + prefill * p + decode * d}
        for p, d, t in points
    ]  # fmt: skip
    errors = [abs(r["fitted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    result = {
        "fit": {"base": base, "prefill_token": prefill, "decode_request": decode},
        "points": rows,
        "mean_abs_error": statistics.mean(errors),
        "max_abs_error": max(errors),
        "repeats": repeats,
        "machine": report.machine(),
    }
    lines = [
        f"Fit: `{base:.3g},{prefill:.3g},{decode:.3g}` (base s, s per prompt token, "
        f"s per decoding request); mean error {result['mean_abs_error']:.0%}, "
        f"worst {result['max_abs_error']:.0%}.",
        "",
        "| prompt tokens | decoding requests | measured ms | fitted ms |",
        "|---|---|---|---|",
        *(
            f"| {r['prefill_tokens']} | {r['decoding']} | {r['measured_s'] * 1e3:.1f} | "
            f"{r['fitted_s'] * 1e3:.1f} |"
            for r in rows
        ),
    ]
    name = "calibrate-quick" if args.quick else "calibrate"
    report.write(args.out, name, result, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
