"""SLO admission at the front door (``--slo-ttft-ms`` with ``--slo-policy``): decided on the caller's thread from
the last step's forecast (core/step_planner.py), so a shed request hears within milliseconds rather than after
the step in flight. The forecast lags the adds by up to a step: the admissions it does not include yet are
counted here as pending, and dropped once the core's count of added requests passes them."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tokenmill.engine.streams import SLOShedError

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenmill.core.step_planner import SLOAdmission
    from tokenmill.engine.streams import EngineSnapshot

logger = logging.getLogger("tokenmill")


class AdmissionGate:
    """``tell(outcome)``: the observers hear of each shed ("ttft_slo") or predicted miss ("predicted_miss")."""

    def __init__(self, admission: SLOAdmission, tell: Callable[[str], None]) -> None:
        self.admission, self.tell = admission, tell
        # [the core's num_sent once it was added (None before), sequences, prompt tokens] per admission
        self.pending: list[list] = []

    def wants_tokens(self, slo_ttft_ms: float | None) -> bool:
        """Whether the request has a TTFT target to check (then its prompt's length is needed)."""
        return bool(self.admission.ttft_s or slo_ttft_ms)

    def admit(self, snap: EngineSnapshot, num_tokens: int, n: int, priority: int, slo_ttft_ms: float | None,
              request_id: str) -> list:
        """Raise SLOShedError if the request's predicted TTFT misses its SLO under the shed policy; else its
        entry among the pending admissions (``added`` once the core has it, ``forget`` if it never gets there)."""
        verdict = self.admission.check(snap.forecast, num_tokens, priority, slo_ttft_ms,
                                       time.perf_counter() - snap.time, sum(e[1] for e in self.pending),
                                       sum(e[2] for e in self.pending))
        if not verdict.admit:
            self.tell("ttft_slo")
            target = slo_ttft_ms or 1e3 * self.admission.ttft_s
            raise SLOShedError(
                f"the server is at capacity for its latency targets: this request's first token is predicted "
                f"in {verdict.predicted_ttft_s:.1f} s, past its {target:g} ms TTFT SLO; retry after "
                f"{verdict.retry_after_s} s", verdict.retry_after_s)
        if not verdict.meets:
            self.tell("predicted_miss")
        logger.debug("request %s admitted: predicted TTFT %.3f s", request_id, verdict.predicted_ttft_s)
        entry = [None, n, n * verdict.prefill_tokens]
        self.pending.append(entry)
        return entry

    @staticmethod
    def added(entry: list, num_sent: int) -> None:
        """The core took the request as its ``num_sent``-th add."""
        entry[0] = num_sent

    def forget(self, entry: list) -> None:
        """The request never reached the core (refused, cancelled)."""
        if entry in self.pending:
            self.pending.remove(entry)

    def seen(self, num_added: int) -> None:
        """A forecast that includes the core's first ``num_added`` adds: those are no longer pending."""
        self.pending = [e for e in self.pending if e[0] is None or e[0] > num_added]
