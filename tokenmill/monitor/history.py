"""The last minutes of a server's metrics, read every second from the same registry ``/metrics`` renders:
what the dashboard charts."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable

from tokenmill.monitor.scrape import Scrape, frame

INTERVAL_S = 1.0  # one reading a second
KEEP_S = 600.0  # ten minutes of them
RATE_WINDOW_S = 5.0  # rates (tokens/s, busy share) over the last 5 s: steadier than one second's
WINDOW_S = 60.0  # percentiles and hit rates over the last minute, unless asked otherwise


class MetricsHistory:
    """Readings of ``collect()`` (metric families), kept for ``keep`` seconds."""

    def __init__(self, collect: Callable[[], Iterable], interval: float = INTERVAL_S, keep: float = KEEP_S) -> None:
        self.collect, self.interval, self.keep = collect, interval, keep
        self._scrapes: deque[Scrape] = deque(maxlen=int(keep / interval) + 2)

    def sample(self, now: float | None = None) -> Scrape:
        scrape = Scrape.from_families(self.collect(), time.time() if now is None else now)
        self._scrapes.append(scrape)
        return scrape

    @property
    def latest(self) -> Scrape | None:
        return self._scrapes[-1] if self._scrapes else None

    def frames(self, since: float = 0.0, window: float = WINDOW_S, rate_window: float = RATE_WINDOW_S) -> list[dict]:
        """The figures of every reading after ``since`` (wall-clock seconds), oldest first: rates over
        ``rate_window`` seconds before each, percentiles over ``window`` (or as far back as the readings go)."""
        scrapes = list(self._scrapes)
        times = [s.time for s in scrapes]

        def before(i: int, span: float) -> Scrape | None:
            j = bisect.bisect_right(times, times[i] - span) - 1
            return scrapes[max(j, 0)] if i > 0 else None

        return [frame(scrapes[i], before(i, rate_window), before(i, window))
                for i in range(bisect.bisect_right(times, since), len(scrapes))]
