"""Engine configuration: frozen plain data, validated once, no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
TASKS = ("auto", "generate", "embed", "score")
POLICIES = ("fcfs", "priority")
SLO_POLICIES = ("shed", "queue")
QUANTIZATIONS = ("none", "int8", "int4", "gguf")  # --quantization (layers/quant.py)
# "auto" (the default) resolves to one of them when the model loads (models/loader.py: resolve_quantization)
# --attention-backend: auto resolves to cpu where the CPU kernels run the model, else torch (layers/attention.py)
ATTENTION_BACKEND_CHOICES = ("auto", "torch", "cpu", "flex")
QUANTIZATION_CHOICES = ("auto",) + QUANTIZATIONS
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # --kv-cache-dtype (layers/attention.py)
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer: the Llama family (Llama, SmolLM2/3,
    Mistral), Qwen2/Qwen3, Gemma 2/3 and Phi-3/Phi-4-mini. The fields after attention_bias are the few places where
    the families differ; their defaults are Llama's."""

    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3" | "phi3" | "smollm3" | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # as Hugging Face spells it: {"rope_type": "linear"|"llama3"|"yarn"|"dynamic"|"longrope", "factor": ..., ...}
    # (the loaders fill in what the type needs: original_max_position_embeddings, longrope's factor)
    rope_scaling: dict | None = None
    rotary_dim: int = 0  # the leading dims of each head that RoPE rotates (Phi-4-mini: 96 of 128); 0: all of them
    # Gemma 3: the RoPE base of the sliding-window layers (plain RoPE; rope_theta and rope_scaling are the global
    # layers'); None: every layer takes rope_theta
    rope_local_base_freq: float | None = None
    # per layer, as SmolLM3's config says it: 1 where the layer applies RoPE, 0 where it has none (NoPE); empty: all 1
    no_rope_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    # RMSNorm on queries and keys before RoPE: "head" over each head (Qwen3), "all" over all of q and of
    # k (OLMoE); "" none
    qk_norm: str = ""
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip] (after the norms)
    # per layer: how many recent tokens attention sees (0: all of them). Mistral and Phi-3 window every
    # layer, Gemma 2 every other one. Empty: no layer is windowed.
    layer_windows: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" | "gelu_tanh" (Gemma 2)
    sandwich_norms: bool = False  # Gemma 2: RMSNorm on the attention and MLP outputs too (4 per layer)
    embed_scale: float = 1.0  # Gemma: embeddings are multiplied by sqrt(hidden_size)
    query_scale: float | None = None  # attention's softmax scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    # Mixture of experts (Mixtral, Qwen2-MoE, OLMoE): 0 experts means a dense MLP in every layer
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1 (Mixtral)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token also takes, sigmoid-gated
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP in a MoE model (Qwen2-MoE mlp_only_layers)
    # an embedding model's pooling, as its files declare it (sentence-transformers' modules, GGUF pooling_type):
    # "last" | "mean" | "cls"; "" for a model that declares none (a generative one)
    pooling_type: str = ""
    pooling_normalize: bool = True
    # BERT-family encoders (models/bert.py): token types, RoBERTa's position offset, a classifier head
    type_vocab_size: int = 0
    position_offset: int = 0
    num_labels: int = 0
    classifier_head: str = ""  # "" | "bert" (pooler + classifier) | "roberta" (dense + out_proj)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if self.no_rope_layers and len(self.no_rope_layers) != self.num_layers:
            raise ValueError(f"no_rope_layers has {len(self.no_rope_layers)} entries for {self.num_layers} layers")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and at most head_dim ({self.head_dim}), got {self.rotary_dim}")
        if self.qk_norm not in ("", "head", "all"):
            raise ValueError(f"qk_norm must be '', 'head' or 'all', got {self.qk_norm!r}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.num_experts_per_tok}")
        if self.hidden_act not in ("silu", "gelu_tanh", "gelu"):
            raise ValueError(f"hidden activation {self.hidden_act!r} is not supported "
                             "(supported: silu, gelu_tanh, gelu)")

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    @property
    def rope_dim(self) -> int:
        """How many leading dims of each head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    def rope_kind(self, layer: int) -> str:
        """Which RoPE layer ``layer`` applies: "global" (rope_theta, rope_scaling), "local" (Gemma 3's sliding
        layers: rope_local_base_freq) or "none" (a NoPE layer)."""
        if self.no_rope_layers and not self.no_rope_layers[layer]:
            return "none"
        return "local" if self.rope_local_base_freq is not None and self.window(layer) else "global"

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window in tokens, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # bytes ("2GiB", "512MB", 1e9) or a fraction of free memory (0 < x <= 1)
    kv_cache_memory: str | float = "0.1"
    enable_prefix_caching: bool = True  # share full KV blocks between requests with a common prefix
    kv_cache_dtype: str = "auto"  # auto: the model dtype; int8 / fp8 (e4m3) with a scale per token and head
    # a second KV tier on local disk (core/kv_tier.py): its size in GiB (None: off) and its directory (None: under
    # the user's cache directory)
    kv_offload_size: float | None = None
    kv_offload_path: str | None = None

    def __post_init__(self) -> None:
        if self.kv_offload_size is not None and not (isinstance(self.kv_offload_size, (int, float))
                                                     and self.kv_offload_size > 0):
            raise ValueError(f"--kv-offload-size must be positive GiB, got {self.kv_offload_size!r}")
        if self.kv_offload_path is not None and self.kv_offload_size is None:
            raise ValueError("--kv-offload-path needs --kv-offload-size (GiB of the directory the tier may use)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size!r}")
        parse_memory(self.kv_cache_memory)  # validate early


CHUNKED_BUDGET = 256
UNCHUNKED_BUDGET = 8192
ADAPTIVE_BUDGET_CAP = 2048  # vLLM's GPU default; on a CPU the latency target keeps steps far below it


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # The step's token budget. None: CHUNKED_BUDGET with chunked prefill (a 256-token chunk step costs a
    # few decode steps on a CPU; raise it on a GPU, where vLLM uses 2048 or more), else UNCHUNKED_BUDGET.
    max_num_batched_tokens: int | None = None
    # On by default: it cut p99 ITL 10x at no throughput cost with long prompts arriving (BENCHMARKS.md).
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority" (lower priority value runs first; ties by arrival)
    preemption_mode: str = "recompute"  # "recompute" | "swap" (GPU only)
    # priority policy: a request waiting longer than this (seconds) is promoted ahead of all others
    starvation_timeout: float | None = 30.0
    # Latency targets (core/step_planner.py). itl_target_ms: each step's token budget is the decodes plus
    # the largest prefill chunk whose predicted step time meets it (serve's default 100 ms; None: the
    # fixed budget). slo_tpot_ms: the same target, and the running batch held to the size that meets it.
    # slo_ttft_ms: a request whose predicted TTFT misses it is shed (503) or, under slo_policy "queue",
    # kept waiting and counted.
    itl_target_ms: float | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_policy: str = "shed"

    @property
    def plans_steps(self) -> bool:
        """Whether steps are planned on a cost model (a latency target is set)."""
        return bool(self.itl_target_ms or self.slo_tpot_ms or self.slo_ttft_ms)

    def __post_init__(self) -> None:
        for name in ("itl_target_ms", "slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be positive milliseconds or None, got {v!r}")
        if self.slo_ttft_ms and not (self.slo_tpot_ms or self.itl_target_ms):
            raise ValueError("slo_ttft_ms is predicted from planned steps, which need a step-time target: give "
                             "--slo-tpot-ms or --itl-target-ms (serve's default, 100) as well")
        if self.slo_policy not in SLO_POLICIES:
            raise ValueError(f"slo_policy must be one of {', '.join(SLO_POLICIES)}, got {self.slo_policy!r}")
        if self.max_num_batched_tokens is None:
            if self.enable_chunked_prefill:
                # with a target the budget adapts under this cap; without one it is the budget
                default = ADAPTIVE_BUDGET_CAP if self.plans_steps else CHUNKED_BUDGET
            else:
                default = UNCHUNKED_BUDGET
            object.__setattr__(self, "max_num_batched_tokens", default)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}"
            )
        if self.starvation_timeout is not None and not self.starvation_timeout > 0:
            raise ValueError(f"starvation_timeout must be positive seconds or None, got {self.starvation_timeout!r}")


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-method``; off when None): each decoding request gets up to
    ``num_speculative_tokens`` drafted tokens a step, verified by the target in the same forward pass.
    ngram: prompt lookup over the request's own tokens, matching its last prompt_lookup_max down to
    prompt_lookup_min tokens (vLLM's meaning). draft: a smaller (or more quantized) model sharing the
    target's vocabulary, ``speculative_model``, loaded with weights ``speculative_quantization``; giving
    a speculative_model alone implies draft."""

    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_model: str | None = None
    speculative_quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.speculative_method is None and self.speculative_model is not None:
            object.__setattr__(self, "speculative_method", "draft")
        if self.speculative_method is None:
            return
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                             f"{self.speculative_method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"--num-speculative-tokens must be a positive integer, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"--prompt-lookup-min/--prompt-lookup-max must satisfy 1 <= min <= max, got {lo}, {hi}")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("--speculative-method draft needs a draft model: pass --speculative-model (a model name "
                             "as --model takes it, a .gguf file or a Hugging Face folder, sharing the target's "
                             "vocabulary)")
        if self.speculative_method == "ngram" and self.speculative_model is not None:
            raise ValueError("--speculative-model is for --speculative-method draft; ngram drafts need no model")
        if self.speculative_quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"--speculative-quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.speculative_quantization!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (``--enable-lora``; tokenmill/lora/): adapters on the attention and MLP projections, chosen
    per request. ``max_loras``: adapters one step may run, each in a slot of the model's working set (vLLM's GPU
    slots); ``max_cpu_loras``: adapters kept loaded in host memory (None: max_loras), least recently used out
    first; ``max_lora_rank``: the largest rank an adapter may have."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < self.max_loras):
            raise ValueError(f"--max-cpu-loras must be an integer >= --max-loras ({self.max_loras}), got {cpu!r}")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


# --distributed-executor-backend: tokenmill starts the ranks itself (mp), or torchrun did (external_launcher)
DISTRIBUTED_BACKENDS = ("mp", "external_launcher")
MAX_MICRO_BATCHES = 1000  # (distributed/pipeline.py's forward_tag has 1,024 slots a pass, one for expert counts)
ALL2ALL_BACKENDS = ("allreduce", "alltoall")  # how a MoE layer's tokens reach the experts' ranks


@dataclass(frozen=True)
class ParallelConfig:
    """How one model spreads over processes (``--tensor-parallel-size``, ``--pipeline-parallel-size``,
    vLLM's names). More than one rank: the engine core is rank 0 (the driver) and starts the others as
    worker processes (tokenmill/distributed/)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # layers split into this many stages, one process each
    pipeline_micro_batches: int = 0  # micro-batches a step is cut into under pipeline parallelism (0: 1)
    distributed_executor_backend: str = "mp"
    enable_expert_parallel: bool = False  # MoE: ranks hold whole experts instead of a slice of each
    # expert parallelism's dispatch and combine: allreduce (every rank routes every token to its own
    # experts, one all-reduce sums the layer) or alltoall (each rank routes its share of the tokens, an
    # all-to-all sends them to their experts' ranks and another brings the outputs back)
    all2all_backend: str = "allreduce"
    pipeline_batches_in_flight: int = 0  # steps in flight across the pipeline stages at once (0: P)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def micro_batches(self) -> int:
        return self.pipeline_micro_batches or 1

    @property
    def batches_in_flight(self) -> int:
        return self.pipeline_batches_in_flight or self.pipeline_parallel_size

    def __post_init__(self) -> None:
        for flag, v in (("--tensor-parallel-size", self.tensor_parallel_size),
                        ("--pipeline-parallel-size", self.pipeline_parallel_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{flag} must be a positive integer, got {v!r}")
        m = self.pipeline_micro_batches
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= MAX_MICRO_BATCHES:
            raise ValueError(f"--pipeline-micro-batches must be a positive integer up to {MAX_MICRO_BATCHES} "
                             f"(0: one), got {m!r}")
        n = self.pipeline_batches_in_flight
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"--pipeline-batches-in-flight must be a positive integer (0: the pipeline size), "
                             f"got {n!r}")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"--all2all-backend must be one of {', '.join(ALL2ALL_BACKENDS)}, "
                             f"got {self.all2all_backend!r}")
        if self.all2all_backend == "alltoall":  # (layers/moe.py: dispatch between the ranks holding the experts)
            missing = ([] if self.tensor_parallel_size > 1 else ["--tensor-parallel-size N (N > 1)"]) + \
                ([] if self.enable_expert_parallel else ["--enable-expert-parallel"])
            if missing:
                raise ValueError("--all2all-backend alltoall sends a mixture-of-experts layer's tokens to the ranks "
                                 "holding their experts, so it needs expert parallelism over several ranks: add "
                                 f"{' and '.join(missing)} (or use --all2all-backend allreduce)")
        if self.distributed_executor_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of {', '.join(DISTRIBUTED_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")


# --kv-role: prefill/decode disaggregation (tokenmill/kv_transfer/)
KV_ROLES = ("producer", "consumer")
KV_TRANSPORTS = ("tcp", "torch")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation: this instance's side of the KV transfer (``--kv-role``).

    A producer prefills requests sent with ``kv_transfer_params: {"do_remote_decode": true}`` and holds
    their KV blocks until a consumer pulls them (or ``kv_transfer_timeout`` passes); a consumer admits
    requests sent with ``{"do_remote_prefill": true, remote_host, remote_port, remote_request_id}``,
    reserves their blocks, pulls the KV from the producer and then decodes. ``kv_transport``: tcp
    (length-prefixed frames of raw tensor bytes) or torch (torch.distributed point to point: gloo here,
    NCCL on GPUs; the control frames still go over TCP)."""

    kv_role: str | None = None
    kv_transport: str = "tcp"
    kv_host: str = "127.0.0.1"  # where a producer listens for pulls (loopback unless told)
    kv_port: int = 0  # 0: a free port (the producer's responses say which)
    kv_transfer_timeout: float = 30.0
    kv_load_failure_policy: str = "recompute"  # a consumer whose pull fails: compute the prompt here, or fail it

    def __post_init__(self) -> None:
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"--kv-load-failure-policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, "
                             f"got {self.kv_load_failure_policy!r}")
        if not (isinstance(self.kv_port, int) and 0 <= self.kv_port < 65536):
            raise ValueError(f"--kv-port must be a TCP port (0 for a free one), got {self.kv_port!r}")
        if not self.kv_transfer_timeout > 0:
            raise ValueError(f"--kv-transfer-timeout must be positive seconds, got {self.kv_transfer_timeout!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # auto: float32 for quantized weights on the CPU kernels, else bf16 where fast (platform.py)
    device: str = "cpu"
    quantization: str = "auto"  # weights: auto | none | int8 | int4 | gguf (layers/quant.py)
    # The CPU kernels' activations: int16 | int8 (layers/kernels.py); None: TOKENMILL_ACTIVATIONS, else int16
    activation_precision: str | None = None
    attention_backend: str = "auto"  # auto | torch | cpu (layers/attention.py's registry)
    max_model_len: int | None = None  # default: the model's context length
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # multi-LoRA serving (--enable-lora)
    # The step-cost model latency targets plan with: a `tokenmill profile` file; None: measured at startup
    step_cost_profile: str | None = None
    # Measure the device's roofline at startup (a GEMM and a streaming read: about 0.3 s and 256 MiB on a
    # CPU) for the utilization figures a server reports; `serve` sets it. Off, CoreInfo.roofline is a known
    # GPU's datasheet or None.
    measure_roofline: bool = False
    # what the model serves: generate | embed | score; auto: embed where the model's files declare a pooling
    # (an embedding model), score for a cross-encoder, else generate (engine/tasks.py)
    task: str = "auto"
    # a decoder reranker (the Qwen3-Reranker shape) under task score: its "no" and "yes" words, whose next-token
    # probability at the prompt's end makes the score (vLLM's hf_overrides classifier_from_token)
    classifier_from_token: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_CHOICES)}, "
                             f"got {self.attention_backend!r}")
        if self.activation_precision not in (None, "int16", "int8"):
            raise ValueError(f"activation_precision must be int16 or int8, got {self.activation_precision!r}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", self.device):
            raise ValueError(f"device must be cpu, cuda, cuda:N or mps, got {self.device!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.classifier_from_token is not None and len(self.classifier_from_token) != 2:
            raise ValueError("classifier_from_token takes two words, the 'no' and the 'yes' one (e.g. no,yes), "
                             f"got {self.classifier_from_token!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments (the LLM and CLI spelling): each goes to the config that has it."""
        kwargs = {_ALIASES.get(k, k): v for k, v in kwargs.items()}
        parts = {}
        for name, sub in (("cache", CacheConfig), ("scheduler", SchedulerConfig), ("speculative", SpeculativeConfig),
                          ("parallel", ParallelConfig), ("kv_transfer", KVTransferConfig),
                          ("lora", LoRAConfig)):
            own = {f.name for f in fields(sub)}
            parts[name] = sub(**{k: kwargs.pop(k) for k in list(kwargs) if k in own})
        unknown = set(kwargs) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs, **parts)


_ALIASES = {"scheduling_policy": "policy"}


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(spec: str | float | int) -> tuple[str, float]:
    """Parse a memory budget: returns ("fraction", f) for 0 < f <= 1, else ("bytes", n)."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        value, unit = float(spec), ""
    elif isinstance(spec, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", spec)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"kv_cache_memory {spec!r} is not understood: give bytes (e.g. 2GiB, 512MB, 1000000000) "
                "or a fraction of free memory (e.g. 0.1)"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    else:
        raise ValueError(f"kv_cache_memory must be a string or a number, got {type(spec).__name__}")
    if unit == "" and 0 < value <= 1:
        return "fraction", value
    nbytes = value * _UNITS[unit]
    if nbytes < 1:
        raise ValueError(f"kv_cache_memory {spec!r} must be positive")
    return "bytes", nbytes
