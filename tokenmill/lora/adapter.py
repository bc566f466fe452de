"""Reading a LoRA adapter and checking it against the model it is to run on, in numpy (the API process checks an
adapter's files without torch; the engine core reads the same way and moves the arrays to torch).

Two formats: a PEFT folder (``adapter_config.json`` and ``adapter_model.safetensors``, as ``save_pretrained``
writes them) and a llama.cpp GGUF LoRA file (``convert_lora_to_gguf.py``: ``general.type`` adapter,
``adapter.lora.alpha``, ``blk.N.attn_q.weight.lora_a`` / ``.lora_b`` pairs, Llama's q/k rows permuted as the
base weights are). Either way an adapter is a set of (A [r, in], B [out, r]) pairs on the attention and MLP
projections, and its delta on a projection's output is ``x A^T B^T * scale`` with scale alpha / r (alpha /
sqrt(r) for rsLoRA). tokenmill fuses q/k/v and gate/up into one projection each, so an adapter's q_proj pair
becomes the q part of the fused qkv_proj, and a Phi-3 adapter's fused qkv_proj pair the three parts at once
(the same A, B's rows split). B is scaled here, once.

Anything the engine cannot apply is refused with a message naming the adapter and what is wrong: a missing or
corrupt file, a rank over ``--max-lora-rank``, a target module the model lacks (or that LoRA here does not reach:
embeddings, the head, experts), shapes of another base model, DoRA, bias or modules_to_save training."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.sampling_params import InvalidParameter

if TYPE_CHECKING:
    from tokenmill.config import ModelConfig

# the fused projections LoRA applies to, and the parts of each one's output, in order
PARTS = {"qkv_proj": ("q", "k", "v"), "o_proj": ("o",), "gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
# an adapter's target module (PEFT's name) -> (the fused projection, the parts it covers)
TARGETS = {"q_proj": ("qkv_proj", ("q",)), "k_proj": ("qkv_proj", ("k",)), "v_proj": ("qkv_proj", ("v",)),
           "qkv_proj": ("qkv_proj", ("q", "k", "v")), "o_proj": ("o_proj", ("o",)),
           "gate_proj": ("gate_up_proj", ("gate",)), "up_proj": ("gate_up_proj", ("up",)),
           "gate_up_proj": ("gate_up_proj", ("gate", "up")), "down_proj": ("down_proj", ("down",))}
# llama.cpp's tensor names -> PEFT's (Phi-3's fused gate/up is its "ffn_up")
GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_qkv": "qkv_proj",
                "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_ATTENTION = ("qkv_proj", "o_proj")
GGUF_PERMUTED = ("llama", "smollm3")  # where llama.cpp's converter permutes q/k rows (as models/gguf_loader.py undoes)

_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\."
                       r"(?:self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_(a|b)$")
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


class LoRAError(InvalidParameter):
    """An adapter this engine cannot run; ``param`` is the request field that named it."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message, param)


@dataclass
class AdapterWeights:
    """An adapter checked against one model: per (layer, fused projection), each part's (part index, A [r, in],
    B [out, r] scaled) in float32."""

    name: str
    path: str
    rank: int  # the largest over its modules
    digest: str  # sha256 of the files read: what keys the prefix cache (two adapters never share KV)
    modules: dict[tuple[int, str], list[tuple[int, np.ndarray, np.ndarray]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for parts in self.modules.values() for _, a, b in parts)


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each fused projection's (in_features, out_features of each part)."""
    q, kv, hidden, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    return {"qkv_proj": (hidden, (q, kv, kv)), "o_proj": (q, (hidden,)), "gate_up_proj": (hidden, (inter, inter)),
            "down_proj": (inter, (hidden,))}


def read_adapter(path: str, cfg: ModelConfig, max_rank: int, name: str = "") -> AdapterWeights:
    """The adapter at ``path`` (a PEFT folder or a GGUF file), checked against ``cfg``; LoRAError if it cannot run."""
    name = name or path
    p = Path(path).expanduser()
    if not p.exists():
        raise LoRAError(f"LoRA adapter {name!r}: {path} does not exist")
    try:
        if p.is_dir():
            pairs, digest = _read_peft(p, name)
        elif p.suffix.lower() == ".gguf" or _is_gguf(p):
            pairs, digest = _read_gguf(p, name, cfg)
        else:
            raise LoRAError(f"LoRA adapter {name!r}: {path} is neither a PEFT adapter folder (adapter_config.json, "
                            "adapter_model.safetensors) nor a GGUF LoRA file")
    except LoRAError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {path} could not be read ({type(e).__name__}: {e})") from None
    return _check(pairs, cfg, max_rank, name, str(p), digest)


def _is_gguf(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


# (target module, layer, A, B, scale) as a file holds them
_Pair = tuple[str, int, np.ndarray, np.ndarray, float]


def _read_peft(folder: Path, name: str) -> tuple[list[_Pair], str]:
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_config.json in {folder} (a PEFT adapter folder holds "
                        "adapter_config.json and adapter_model.safetensors)")
    if not weights_file.is_file():
        why = (" (adapter_model.bin is a pickle, which tokenmill does not load: save the adapter with "
               "safe_serialization=True)" if (folder / "adapter_model.bin").exists() else "")
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {folder}{why}")
    raw_config = config_file.read_bytes()
    try:
        conf = json.loads(raw_config)
    except json.JSONDecodeError as e:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(conf, dict):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not a JSON object")
    _check_peft_config(conf, name)
    raw = weights_file.read_bytes()
    tensors = _safetensors(raw, name)
    rank, alpha = int(conf.get("r", 8)), float(conf.get("lora_alpha", 8))
    rslora = bool(conf.get("use_rslora"))
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, arr in tensors.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            what = next((w for w in ("embed", "lm_head", "expert") if w in key), None)
            why = f"LoRA on {what}s is not supported (only the attention and dense MLP projections)" if what else \
                "not a LoRA A/B weight of a decoder layer's projection"
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r}: {why}")
        found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = arr
    pairs = []
    for (layer, target), ab in sorted(found.items()):
        if len(ab) != 2:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {target} has lora_{next(iter(ab))} without its "
                            f"lora_{'B' if 'A' in ab else 'A'}")
        where = "self_attn" if TARGETS.get(target, ("",))[0] in _ATTENTION else "mlp"
        module = f"model.layers.{layer}.{where}.{target}"  # (the name PEFT's patterns match)
        r = int(_pattern(conf.get("rank_pattern"), module, rank))
        a = float(_pattern(conf.get("alpha_pattern"), module, alpha))
        if ab["A"].ndim == 2 and ab["A"].shape[0] != r:
            r = ab["A"].shape[0]  # the tensors are what ran in training
        pairs.append((target, layer, ab["A"], ab["B"], a / (r ** 0.5 if rslora else r)))
    digest = hashlib.sha256(raw_config + b"\0" + raw).hexdigest()
    return pairs, digest


def _check_peft_config(conf: dict, name: str) -> None:
    refuse = [("peft_type", lambda v: v not in (None, "LORA"), "is not a LoRA adapter"),
              ("use_dora", bool, "DoRA is not supported"),
              ("bias", lambda v: v not in (None, "none"), "trained biases are not supported"),
              ("lora_bias", bool, "trained biases are not supported"),
              ("fan_in_fan_out", bool, "fan_in_fan_out (GPT-2's Conv1D layout) is not supported"),
              ("modules_to_save", bool, "modules_to_save (fully trained layers) are not supported"),
              ("target_parameters", bool, "LoRA on parameters (MoE experts) is not supported"),
              ("layer_replication", bool, "layer_replication is not supported")]
    for key, bad, why in refuse:
        if key in conf and bad(conf[key]):
            raise LoRAError(f"LoRA adapter {name!r}: {key}={conf[key]!r}: {why}")


def _pattern(patterns: dict | None, module: str, default):
    """PEFT's rank_pattern/alpha_pattern: the value of the first key that matches the module's name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _safetensors(raw: bytes, name: str) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as float32 arrays. (safetensors' own numpy loader has no bfloat16, and the API
    process has no torch: the format is a JSON header of dtypes, shapes and byte ranges, then the bytes.)"""
    def corrupt(why: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors is corrupt: {why}")

    if len(raw) < 8:
        raise corrupt("shorter than its header")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise corrupt(f"its header claims {n} bytes, the file holds {len(raw) - 8}")
    try:
        header = json.loads(raw[8:8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise corrupt(f"its header is not JSON ({e})") from None
    data, out = memoryview(raw)[8 + n:], {}
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = spec["dtype"], [int(d) for d in spec["shape"]], spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"tensor {key!r} has no dtype, shape and data_offsets") from None
        if dtype not in _ST_DTYPES:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is {dtype}; adapters load from F32, F16 or BF16")
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[dtype]).itemsize
        if not 0 <= start <= end <= len(data) or end - start != size:
            raise corrupt(f"tensor {key!r}'s bytes [{start}, {end}) do not hold {dtype} {shape} within the file")
        arr = np.frombuffer(data[start:end], dtype=_ST_DTYPES[dtype]).reshape(shape)
        out[key] = _bf16(arr) if dtype == "BF16" else arr.astype(np.float32)
    return out


def _bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _read_gguf(path: Path, name: str, cfg: ModelConfig) -> tuple[list[_Pair], str]:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf-py raises what it meets (ValueError, struct and index errors)
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a readable GGUF file ({type(e).__name__}: {e})") \
            from None

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind, adapter = field("general.type"), field("adapter.type")
    if kind != "adapter" or adapter != "lora":
        raise LoRAError(f"LoRA adapter {name!r}: {path} is a GGUF file but not a LoRA adapter (general.type "
                        f"{kind!r}, adapter.type {adapter!r}; llama.cpp's convert_lora_to_gguf.py writes them)")
    arch, alpha = field("general.architecture", ""), float(field("adapter.lora.alpha", 0.0) or 0.0)
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        m = _GGUF_KEY.match(t.name)
        if m is None or m.group(2) not in GGUF_TARGETS:
            raise LoRAError(f"LoRA adapter {name!r}: GGUF tensor {t.name!r} is not a LoRA pair of a projection this "
                            f"engine applies it to ({', '.join(GGUF_TARGETS)})")
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest first
        arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        target = "gate_up_proj" if arch == "phi3" and m.group(2) == "ffn_up" else GGUF_TARGETS[m.group(2)]
        found.setdefault((int(m.group(1)), target), {})[m.group(3)] = arr
    pairs = []
    for (layer, target), ab in sorted(found.items()):
        if len(ab) != 2:
            raise LoRAError(f"LoRA adapter {name!r}: blk.{layer} {target} has lora_{next(iter(ab))} without its pair")
        a, b = ab["a"], ab["b"]
        if arch in GGUF_PERMUTED and target in ("q_proj", "k_proj"):
            heads = cfg.num_heads if target == "q_proj" else cfg.num_kv_heads
            if b.shape[0] % (2 * heads):
                raise LoRAError(f"LoRA adapter {name!r}: blk.{layer} {target} lora_b has {b.shape[0]} rows, not "
                                f"{heads} heads of this model")
            b = b.reshape(heads, b.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(b.shape)  # (undone)
        r = a.shape[0] if a.ndim == 2 else 1
        pairs.append((target, layer, a, b, alpha / r if alpha else 1.0))  # (llama.cpp: scale 1 without an alpha)
    return pairs, hashlib.sha256(path.read_bytes()).hexdigest()


def _check(pairs: list[_Pair], cfg: ModelConfig, max_rank: int, name: str, path: str, digest: str) -> AdapterWeights:
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: {path} holds no LoRA weights")
    shapes = projection_shapes(cfg)
    out = AdapterWeights(name, path, 0, digest)
    covered: dict[tuple[int, str], set[str]] = {}
    for target, layer, a, b, scale in pairs:
        where = f"LoRA adapter {name!r}: layer {layer} {target}"
        if target not in TARGETS:
            raise LoRAError(f"LoRA adapter {name!r} targets module {target!r}, which this {cfg.architecture} model "
                            f"does not have (LoRA applies to {', '.join(TARGETS)})")
        if not 0 <= layer < cfg.num_layers:
            raise LoRAError(f"{where}: the model has {cfg.num_layers} layers")
        module, parts = TARGETS[target]
        if module in ("gate_up_proj", "down_proj") and cfg.is_moe_layer(layer):
            raise LoRAError(f"{where}: that layer's MLP is a mixture of experts; LoRA on experts is not supported")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{where}: lora_A {a.shape} and lora_B {b.shape} are not a rank-r pair")
        r = a.shape[0]
        if r > max_rank:
            raise LoRAError(f"{where}: rank {r} is above --max-lora-rank {max_rank}")
        fan_in, part_outs = shapes[module]
        index = [PARTS[module].index(p) for p in parts]
        want_out = sum(part_outs[i] for i in index)
        if a.shape[1] != fan_in or b.shape[0] != want_out:
            raise LoRAError(f"{where}: lora_A {a.shape} / lora_B {b.shape} do not fit this model's {target} "
                            f"([{want_out}, {fan_in}]): was the adapter trained for another base model?")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise LoRAError(f"{where}: the weights hold NaN or infinity")
        seen = covered.setdefault((layer, module), set())
        if seen & set(parts):
            raise LoRAError(f"{where}: the same projection is adapted twice")
        seen.update(parts)
        row = 0
        for i in index:
            rows = b[row: row + part_outs[i]]
            row += part_outs[i]
            out.modules.setdefault((layer, module), []).append(
                (i, np.array(a, dtype=np.float32), np.ascontiguousarray(rows * np.float32(scale), dtype=np.float32)))
        out.rank = max(out.rank, r)
    return out
