"""The attention backends' registry: ``--attention-backend`` names one (config.py's ATTENTION_BACKEND_CHOICES lists
the same names; a test holds them equal)."""

from __future__ import annotations

from tokenmill.layers.attention import CPUPagedAttention, TorchPagedAttention
from tokenmill.layers.flex_attention import FlexPagedAttention

ATTENTION_BACKENDS: dict[str, type[TorchPagedAttention]] = {"torch": TorchPagedAttention, "cpu": CPUPagedAttention,
                                                           "flex": FlexPagedAttention}


def get_backend(name: str = "auto", kernels: bool = False) -> TorchPagedAttention:
    """The backend ``name`` names; ``auto``: ``cpu`` where the CPU kernels run the model (``kernels``), else
    ``torch``."""
    if name == "auto":
        name = "cpu" if kernels else "torch"
    if name == "cpu" and not kernels:
        raise ValueError("--attention-backend cpu runs the CPU kernels' paged attention, which need float32 on the "
                         "CPU with the kernels built (see the log's kernel line); use --attention-backend auto or "
                         "torch")
    try:
        return ATTENTION_BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, "
                         f"{', '.join(ATTENTION_BACKENDS)}") from None
