"""Build and load tokenmill's CPU kernels (``csrc/cpu_kernels.cpp``) as ``torch.ops.tokenmill.*``.

The source is compiled once per (source, torch version, compiler flags) with the system C++
compiler against torch's own headers and libraries (no ninja needed), and cached under
``$TOKENMILL_CACHE_DIR`` (default ``~/.cache/tokenmill``). ``cpu_kernels()`` returns the op
namespace, or None where they cannot run: not x86-64 with AVX2/FMA/F16C, no compiler, or a
failed build (the reason is logged once and kept in ``unavailable_reason()``). Callers then
use the pure-torch paths in ``tokenmill/layers/quant.py``.

Set ``TOKENMILL_DISABLE_CPU_KERNELS=1`` to force the torch paths. The many-token GEMM picks its
instruction set at run time (AVX512-VNNI where the CPU has it, else AVX2; the same bits either way),
VNNI from as many tokens as pays on this CPU (timed at the first load on a machine, ``_vnni_crossing``, and
kept beside the build);
``TOKENMILL_CPU_ISA=avx2`` forces AVX2, and ``torch.ops.tokenmill.kernel_isa("")`` says which is in use.

Activations are quantized to int16 per token and block of 32 (the default; float activations to four decimals
of perplexity) or, with ``TOKENMILL_ACTIVATIONS=int8`` / ``--activation-precision int8``
(``set_activation_precision``), to llama.cpp's 127 steps: half the multiply-adds for the K-quants and Q4_0/Q4_1
in panels, at a measured cost in agreement (BENCHMARKS.md). Either is batch invariant; the setting is
process-wide.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenmill.platform import cpu_flags, cpu_name

if TYPE_CHECKING:
    from torch._ops import _OpNamespace  # torch.ops.tokenmill, the loaded kernels' op namespace

logger = logging.getLogger("tokenmill")

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG",
         "-Wno-unused-function"]
_reason: str | None = None


def unavailable_reason() -> str | None:
    """Why the CPU kernels are not in use (None when they are, or have not been asked for yet)."""
    return _reason


def _cache_dir() -> Path:
    base = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill")
    return Path(base) / "kernels"


def _build(cxx: str) -> Path:
    # the key covers every file of csrc/: cpu_kernels.cpp includes the others
    src = "\0".join(f"{f.name}\0{f.read_text()}" for f in sorted(SOURCE.parent.iterdir()) if f.is_file())
    tdir = Path(torch.__file__).parent
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cmd_flags = FLAGS + [abi]
    key = hashlib.sha256("\0".join([src, torch.__version__, str(tdir), cxx, *cmd_flags]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"tokenmill_cpu_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    inc = [f"-I{tdir / 'include'}", f"-I{tdir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
           f"-I{sysconfig.get_paths()['include']}"]
    libs = [f"-L{tdir / 'lib'}", f"-Wl,-rpath,{tdir / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch"]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [cxx, *cmd_flags, *inc, str(SOURCE), "-o", str(tmp_out), *libs]
        # A warning, so the first run says why it waits (~25 s on 2 cores); later runs load the cached build.
        logger.warning("building tokenmill's CPU kernels into %s (once per torch version and kernel source; "
                       "under a minute)", out.parent)
        logger.debug("kernel build command: %s", " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{r.stderr[-2000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent build of the same key writes the same file
    return out


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def kernels_expected() -> bool:
    """True where the kernels must build and load: x86-64 with AVX2/FMA/F16C, a C++ compiler, and not
    disabled. The tests fail rather than skip when the kernels are missing on such a machine."""
    return (os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS", "") in ("", "0")
            and platform.machine().lower() in ("x86_64", "amd64")
            and {"avx2", "fma", "f16c"} <= cpu_flags() and _compiler() is not None)


CROSSING_TOKENS = (4, 6, 8, 10, 12, 16)
# (out, in, how many): a small model's MLP up and down matrices and a head, some 25 MB of Q8_0 in all, so
# that the weights stream from memory as in a real step (cached in L2/L3 the crossing comes out lower)
SHAPES = ((1536, 576, 8), (576, 1536, 8), (16384, 576, 1))


ACTIVATION_PRECISIONS = ("int16", "int8")


def activation_precision_from_env() -> str:
    """``TOKENMILL_ACTIVATIONS`` ("int16" when unset); any other value is refused."""
    env = os.environ.get("TOKENMILL_ACTIVATIONS", "") or "int16"
    if env not in ACTIVATION_PRECISIONS:
        raise ValueError(f"TOKENMILL_ACTIVATIONS must be one of {', '.join(ACTIVATION_PRECISIONS)}, got {env!r}")
    return env


def set_activation_precision(name: str) -> None:
    """The integer kernels' activations from now on, in this process and the ones it starts: "int16" (the
    default) or "int8" (needs the kernels: the torch paths compute in float)."""
    if name not in ACTIVATION_PRECISIONS:
        raise ValueError(f"activation precision must be one of {', '.join(ACTIVATION_PRECISIONS)}, got {name!r}")
    ops = cpu_kernels()
    if name == "int8" and ops is None:
        raise ValueError(f"--activation-precision int8 runs on tokenmill's CPU kernels, which are unavailable here "
                         f"({unavailable_reason()}); leave it at int16")
    os.environ["TOKENMILL_ACTIVATIONS"] = name
    if ops is not None:
        ops.activation_precision(name)


def apply_activation_precision(name: str | None, device: torch.device) -> str:
    """An engine's --activation-precision (None: TOKENMILL_ACTIVATIONS, else int16), set for this process's
    kernels where it runs on the CPU; int8 elsewhere is refused. Returns the precision in effect."""
    name = name or activation_precision_from_env()
    if device.type == "cpu":
        set_activation_precision(name)
    elif name != "int16":
        raise ValueError(f"--activation-precision {name} applies to tokenmill's CPU kernels; on {device} leave it "
                         "at int16")
    return name


def vnni_min_tokens_from_env() -> int | None:
    """``TOKENMILL_VNNI_MIN_TOKENS`` (None when unset); a value that is not a positive integer is refused."""
    env = os.environ.get("TOKENMILL_VNNI_MIN_TOKENS", "")
    if not env:
        return None
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"TOKENMILL_VNNI_MIN_TOKENS must be a positive integer (the fewest tokens a GEMM call "
                         f"takes AVX512-VNNI for), got {env!r}; unset it to have the crossing timed")
    return n


def _vnni_crossing(ops: _OpNamespace) -> int:
    """The fewest tokens from which the AVX512-VNNI GEMM beats the AVX2 one on this CPU (16 where VNNI is not
    in use): it widens a panel of weights once for all tokens, which pays from 8 tokens on a Sapphire
    Rapids-class Xeon (a whole step of the embedded model: 1.15x slower at 7 tokens, 0.94x at 8, 0.78x
    at 12); an earlier, fixed-shape measurement on a Zen 5 EPYC had VNNI 0.9x at 8 tokens and 1.4x at 16.
    Timed over SHAPES in Q8_0 (about 0.3 s; once per machine, see _cached_crossing): the smallest count
    from which VNNI is 10% faster at every larger one, 16 when none is. The results are the same bits either way; the kernels' ISA
    and crossing are as they were after the timing."""
    import time

    from tokenmill.layers.formats import FORMAT_IDS

    before, crossing_before = ops.kernel_isa(""), ops.vnni_min_tokens(0)
    if before != "avx512vnni":  # this CPU lacks it, or TOKENMILL_CPU_ISA=avx2 turned it off
        return 16
    gen = torch.Generator().manual_seed(0)
    mats = []
    for n, k, count in SHAPES:
        for _ in range(count):  # Q8_0 blocks: an fp16 scale of 1/64, then 32 random int8s
            # in the kernel layout (quant.py's kernel_layout): a row's fp16 scales, then its int8 quants
            scales = torch.tensor([1 / 64], dtype=torch.float16).view(torch.uint8).repeat(n, k // 32)
            w = torch.cat([scales, torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)], 1).contiguous()
            mats.append((w, n, torch.randn(max(CROSSING_TOKENS), k, generator=gen)))
    best: dict[tuple[str, int], float] = {}
    try:
        ops.vnni_min_tokens(1)
        for isa in ("avx2", "avx512vnni", "avx2", "avx512vnni"):  # alternated: a noisy machine hurts both alike
            ops.kernel_isa(isa)
            for m in CROSSING_TOKENS:
                for _ in range(2):
                    t = time.perf_counter()
                    for w, n, x in mats:
                        ops.qlinear(x[:m], w, n, FORMAT_IDS["q8_0"])
                    best[isa, m] = min(time.perf_counter() - t, best.get((isa, m), float("inf")))
    finally:
        ops.kernel_isa(before)
        ops.vnni_min_tokens(crossing_before)
    crossing = 16
    for m in reversed(CROSSING_TOKENS):
        # 10% to spare: these matrices favour VNNI by about 0.15 over a whole step (1.0x here at 6 tokens,
        # where the step ran 1.2x slower)
        if best["avx512vnni", m] >= 0.9 * best["avx2", m]:
            break
        crossing = m
    return crossing


CROSSING_VERSION = 1  # bump when the timing (SHAPES, CROSSING_TOKENS, the 10% rule) changes


def _cached_crossing(ops: _OpNamespace, so: Path) -> int:
    """_vnni_crossing, timed once per (kernel build, CPU model and flags, thread count) and kept beside the
    build: a one-shot command should not spend a second of its start timing GEMMs (the result only moves
    speed). A missing, unreadable or out-of-range file is timed again; a file that cannot be written only
    costs the timing next time. Delete the ``*.vnni-crossing.*`` files to have it timed afresh."""
    if ops.kernel_isa("") != "avx512vnni":
        return 16
    key = hashlib.sha256("\0".join([cpu_name(), *sorted(cpu_flags()), str(CROSSING_VERSION)]).encode())
    path = so.with_name(f"{so.stem}.vnni-crossing.{key.hexdigest()[:12]}.{torch.get_num_threads()}t")
    try:
        kept = int(path.read_text())
        if kept in CROSSING_TOKENS:
            return kept
    except (OSError, ValueError):
        pass
    crossing = _vnni_crossing(ops)
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        tmp.write_text(str(crossing))
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("could not keep the VNNI crossing in %s: %s", path, e)
        tmp.unlink(missing_ok=True)
    return crossing


_load_lock = threading.Lock()


@functools.cache
def cpu_kernels():
    """torch.ops.tokenmill with the CPU kernels loaded, or None (see unavailable_reason())."""
    with _load_lock:  # functools.cache lets two first callers in at once; the timing below must run alone
        return _load_kernels()


def _load_kernels() -> _OpNamespace | None:
    global _reason
    crossing = vnni_min_tokens_from_env()  # a bad value is the user's to fix, not a reason to go without kernels
    activation_precision_from_env()
    if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS", "") not in ("", "0"):
        _reason = "disabled by TOKENMILL_DISABLE_CPU_KERNELS"
    elif platform.machine().lower() not in ("x86_64", "amd64"):
        _reason = f"the kernels are x86-64 AVX2 code and this machine is {platform.machine()}"
    elif not {"avx2", "fma", "f16c"} <= cpu_flags():
        _reason = "this CPU lacks AVX2, FMA or F16C"
    elif not SOURCE.exists():
        _reason = f"the kernel source {SOURCE} is not installed"
    else:
        cxx = _compiler()
        if cxx is None:
            _reason = "no C++ compiler (g++, c++ or clang++) on PATH; install one to build the kernels"
        else:
            try:
                so = _build(cxx)
                torch.ops.load_library(str(so))
                _reason = None
                ops = torch.ops.tokenmill
                ops.vnni_min_tokens(crossing or _cached_crossing(ops, so))
                if ops.kernel_isa("") == "avx512vnni":
                    logger.info("tokenmill CPU kernels loaded; many-token GEMMs use avx512vnni from %d tokens",
                                ops.vnni_min_tokens(0))
                else:
                    logger.info("tokenmill CPU kernels loaded; many-token GEMMs use avx2")
                return ops
            except Exception as e:  # noqa: BLE001 -- any failure means: use the torch paths, and say why
                _reason = f"{type(e).__name__}: {e}"
    logger.warning("tokenmill CPU kernels unavailable (%s); quantized layers use the slower torch paths", _reason)
    return None
