"""When each request is sent: Poisson or gamma arrivals, all at once, or a trace's recorded times.

Gaps between requests are gamma distributed with shape ``burstiness`` and mean ``1 / rate``, as in
vLLM's serving benchmark: burstiness 1 is a Poisson process (exponential gaps), below 1 is burstier,
above 1 is more regular, and the coefficient of variation of the gaps is ``1 / sqrt(burstiness)``.
As vLLM does, the cumulative times are then rescaled so the last request goes out at ``n / rate``,
which makes the offered rate exactly ``rate`` whatever the seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.trace import mean_rate


def gamma_arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times (seconds after the start) of n requests at mean ``rate`` per second (inf: all at 0)."""
    if n < 1:
        raise ValueError("at least one request is needed")
    if not rate > 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        rng = np.random.default_rng((seed, 0xA5))  # its own stream: the dataset's draws don't shift it
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return times * ((n / rate) / times[-1])


def schedule(requests: Sequence[SampleRequest], rate: float | None, burstiness: float = 1.0, seed: int = 0,
             time_scale: float = 1.0) -> np.ndarray:
    """Send times for ``requests``. A trace (every request has ``arrival_s``) keeps its recorded shape:
    its clock is slowed by ``time_scale`` (2 = every gap doubled), or, when ``rate`` is given, rescaled
    so the mean rate is ``rate``. Anything else gets gamma arrivals at ``rate`` (None = inf)."""
    if not time_scale > 0 or math.isinf(time_scale):
        raise ValueError(f"--time-scale must be a positive number, got {time_scale}")
    recorded = [r.arrival_s for r in requests]
    if requests and all(a is not None for a in recorded):
        times = np.asarray(recorded, dtype=float)
        times = times - times.min()
        if rate is None:
            return times * time_scale
        if not rate > 0:
            raise ValueError(f"--request-rate must be positive (or inf), got {rate}")
        native = mean_rate(list(times))
        if math.isinf(rate) or math.isinf(native):
            return np.zeros(len(times)) if math.isinf(rate) else times
        return times * (native / rate)
    return gamma_arrivals(len(requests), math.inf if rate is None else rate, burstiness, seed)
