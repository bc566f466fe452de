"""``tokenmill simulate``: what serving costs and how many users given hardware supports, answered by
the real scheduler (``core/``: Scheduler, KVCacheManager) driven by a clock that a cost model advances.

The step-time models it runs on (a roofline from the model config and a hardware profile, a calibrated
model fitted to step times measured on this machine) are the engine's own, in ``perf/``.

- ``profile.py``: ``tokenmill profile``: step times over a grid (engine/calibration.py) or from a server's
  step logs, fitted to a calibrated cost model.
- ``spec.py``: speculative decoding: the drafter the real scheduler drives, and the acceptance model.
- ``simulator.py``: the discrete-event loop, over one engine or, disaggregated, prefill and decode
  instances with the KV transfer between them; it emits the benchmark's own per-request results, so
  ``tokenmill bench``'s metrics, reports and plots come out of it unchanged.
- ``cli.py``: ``tokenmill simulate`` and ``tokenmill profile``.
"""
