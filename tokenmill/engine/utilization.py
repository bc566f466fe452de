"""How busy the hardware is: where the engine's wall time goes, and what fraction of the machine's roofline
its steps use.

- The engine core times each step's phases (schedule, draft, forward, sample, the rest) and counts its
  model FLOPs and bytes by the roofline formulas (perf/cost.py); StepStats carries them, CoreInfo the
  device's roofline (perf/roofline.py).
- ``UtilizationMeter`` (in the front end, fed each step by the server's metrics) sums the phases, FLOPs and bytes, and reads
  the engine process's CPU time (psutil) and, on NVIDIA GPUs, NVML's utilization and memory
  (nvidia-ml-py, where installed). ``/metrics`` exports them as counters; fractions over a window are
  gauges.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass

from tokenmill.engine.messages import StepStats
from tokenmill.perf.roofline import Roofline

PHASES = ("schedule", "draft", "forward", "sample", "other")
DEVICE_PHASES = ("draft", "forward")  # the phases that run the model: the device is busy
WINDOW_S = 10.0  # the gauges' window


# ---- the front end's meters -----------------------------------------------------------------


class ProcessCpu:
    """CPU seconds of the engine core's process (``pid()``: it changes when the core restarts) and the CPUs
    it may use."""

    def __init__(self, pid=os.getpid) -> None:
        self.pid = pid
        self._process = None
        self.num_cpus = 1

    @property
    def process(self):
        import psutil

        pid = self.pid()
        if self._process is None or self._process.pid != pid:
            self._process = psutil.Process(pid)
            try:
                self.num_cpus = len(self._process.cpu_affinity()) or os.cpu_count() or 1
            except (AttributeError, OSError):  # no affinity on this platform
                self.num_cpus = os.cpu_count() or 1
        return self._process

    def seconds(self) -> float:
        try:
            t = self.process.cpu_times()
        except Exception:  # noqa: BLE001 - the process is gone: its time stopped
            return float("nan")
        return t.user + t.system


class Nvml:
    """NVML's view of one GPU (nvidia-ml-py). ``available`` False with ``why`` where it cannot say: no
    NVIDIA GPU, the library missing, or NVML failing."""

    def __init__(self, device: str, uuid: str | None) -> None:
        self.available, self.why, self._handle = False, "", None
        if not device.startswith("cuda"):
            self.why = f"the engine runs on the {device.split(':')[0]}, not an NVIDIA GPU"
            return
        try:
            import pynvml
        except ImportError:
            self.why = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            return
        try:
            pynvml.nvmlInit()
            if uuid:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            else:
                index = int(device.split(":")[1]) if ":" in device else 0
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml, self.available = pynvml, True
        except Exception as e:  # noqa: BLE001 - NVML's errors are many; say which one
            self.why = f"NVML failed: {e}"

    def read(self) -> tuple[float, float, float] | None:
        """(utilization 0-1 over NVML's last sample period, memory used, memory total in bytes), or None."""
        if not self.available:
            return None
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception as e:  # noqa: BLE001
            self.available, self.why = False, f"NVML failed: {e}"
            return None
        return util.gpu / 100.0, float(mem.used), float(mem.total)


@dataclass
class Window:
    """The engine over the meter's window of wall time."""

    fractions: dict[str, float]  # phase (and "idle") -> fraction of the wall time
    device_busy: float  # the model-running phases' fraction
    achieved_flops: float  # FLOP/s over the model-running time
    achieved_bandwidth: float  # bytes/s over the model-running time
    cpu_utilization: float  # the engine process's CPU time over (wall time x its CPUs)


class UtilizationMeter:
    """Sums of the engine's step phases, FLOPs and bytes (for counters) and their recent steps (for the
    windowed gauges). ``on_step`` runs on the engine thread, ``recent`` on the server's."""

    def __init__(self, roofline: Roofline | None, cpu: ProcessCpu | None = None, window: float = WINDOW_S) -> None:
        self.roofline, self.cpu, self.window = roofline, cpu, window
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self.flops = self.bytes = 0.0
        self._steps: deque[StepStats] = deque()
        self._cpu_samples: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()
        self.start = time.perf_counter()

    def on_step(self, stats: StepStats) -> None:
        phases = step_phases(stats)
        with self._lock:
            for k, v in phases.items():
                self.phase_seconds[k] += v
            self.flops += stats.flops
            self.bytes += stats.bytes
            self._steps.append(stats)
            self._prune(stats.start_time + stats.duration)

    def _prune(self, now: float) -> None:
        while self._steps and self._steps[0].start_time + self._steps[0].duration < now - self.window:
            self._steps.popleft()

    def cpu_seconds(self) -> float | None:
        return None if self.cpu is None else self.cpu.seconds()

    def recent(self, now: float | None = None) -> Window:
        """The last ``window`` seconds (or since the meter started, if that is shorter): each phase's share
        of the wall time (a step straddling the window's start counts pro rata), the work done over the
        model-running time, and the engine process's CPU use."""
        now = time.perf_counter() if now is None else now
        begin = max(now - self.window, self.start)
        wall = max(now - begin, 1e-9)
        sums = dict.fromkeys(PHASES, 0.0)
        flops = nbytes = 0.0
        with self._lock:
            self._prune(now)
            steps = list(self._steps)
        for s in steps:
            share = 1.0 if s.start_time >= begin else max(0.0, s.start_time + s.duration - begin) / s.duration
            for k, v in step_phases(s).items():
                sums[k] += share * v
            flops += share * s.flops
            nbytes += share * s.bytes
        fractions = {k: min(1.0, v / wall) for k, v in sums.items()}
        fractions["idle"] = max(0.0, 1.0 - sum(fractions.values()))
        device_s = sum(sums[p] for p in DEVICE_PHASES)
        return Window(fractions, min(1.0, device_s / wall), flops / device_s if device_s else 0.0,
                      nbytes / device_s if device_s else 0.0, self._cpu_utilization(now))

    def _cpu_utilization(self, now: float) -> float:
        if self.cpu is None:
            return float("nan")
        used = self.cpu.seconds()
        if used != used:  # the process is gone
            return float("nan")
        with self._lock:
            samples = self._cpu_samples
            if samples and used < samples[-1][1]:  # a restarted core: a new process, a new count
                samples.clear()
            samples.append((now, used))
            while len(samples) > 2 and samples[1][0] <= now - self.window:
                samples.popleft()
            t0, c0 = samples[0]
        if now - t0 < 0.05:  # the first reading: since the process started
            return used / max(time.time() - self.cpu.process.create_time(), 1e-9) / self.cpu.num_cpus
        return (used - c0) / (now - t0) / self.cpu.num_cpus


def step_phases(s: StepStats) -> dict[str, float]:
    """A step's seconds by phase; "other" is what its phases leave of its duration (applying the outputs)."""
    timed = s.schedule_s + s.draft_s + s.forward_s + s.sample_s
    return {"schedule": s.schedule_s, "draft": s.draft_s, "forward": s.forward_s, "sample": s.sample_s,
            "other": max(0.0, s.duration - timed)}
