"""What a step costs, in one place: the cost and performance models the engine plans with, the utilization
meter reports against and the simulator runs on. Imports nothing of tokenmill but the config and the platform
probe, so that the engine, the scheduler and the simulator all sit above it.

- ``step_cost.py``: a step's shape (``StepShape``: tokens, sampled rows, attention context), the calibrated
  model fitted to measured step times (``CalibratedCost``) and the observed-time tracker.
- ``cost.py``: the roofline step-time model from a model config and a hardware profile, and its formulas:
  FLOPs and bytes of a step, ``kv_bytes_per_token``, KV transfer, pipeline and speculative-decoding shapes.
- ``hardware.py``: datasheet profiles (peak FLOP/s, memory bandwidth and size, interconnect, the NIC).
- ``roofline.py``: this machine's roofline (a known device's datasheet, else measured once per process) and
  the bytes of weights a step reads.

Timing steps on a live engine (startup calibration, ``tokenmill profile``) runs the engine's runner, so it
lives above, in ``engine/calibration.py``.
"""
