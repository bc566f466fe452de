"""Building an engine core from a config: the device and dtype, the tensor-parallel ranks, the model, the drafter,
the KV pool, the scheduler and runner, the speculative off rule, the step-cost model, the KV connector and the
roofline, in that order (``build_core``). EngineCore (core.py) only holds what this makes (CoreParts)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.engine.core import CoreParts, EngineCore, StartupPhases, device_uuid  # first: times torch

import torch  # noqa: E402

from tokenmill.config import EngineConfig, parse_memory  # noqa: E402
from tokenmill.core.kv_cache import KVCacheManager, size_kv_pool  # noqa: E402
from tokenmill.core.kv_tier import check_kv_offload, default_path, tier_key  # noqa: E402
from tokenmill.core.assembly import make_scheduler  # noqa: E402
from tokenmill.engine.calibration import startup_step_cost  # noqa: E402
from tokenmill.engine.drafting import load_drafter, measure_draft_cost  # noqa: E402
from tokenmill.distributed.pipeline import check_pipeline_parallel  # noqa: E402
from tokenmill.distributed.sharding import check_tensor_parallel  # noqa: E402
from tokenmill.engine.messages import CoreInfo  # noqa: E402
from tokenmill.engine.tasks import encoder_config, resolve_task  # noqa: E402
from tokenmill.executor import start_executor  # noqa: E402
from tokenmill.kv_transfer.connector import KVConnector  # noqa: E402
from tokenmill.lora.manager import LoRAManager  # noqa: E402
from tokenmill.models.loader import model_config_of  # noqa: E402
from tokenmill.models.registry import ModelSource, resolve_model  # noqa: E402
from tokenmill.perf.roofline import machine_roofline, weight_bytes_read  # noqa: E402
from tokenmill.platform import free_memory_bytes, resolve_device  # noqa: E402
from tokenmill.spec_decode.draft_model import DraftModelProposer  # noqa: E402
from tokenmill.spec_decode.ngram import NgramProposer  # noqa: E402
from tokenmill.structured_output import GrammarCompiler  # noqa: E402
from tokenmill.worker.model_runner import ModelRunner, allocate_kv_cache, kv_cache_bytes_per_token  # noqa: E402
from tokenmill.worker.kv_tier import open_kv_tier  # noqa: E402
from tokenmill.worker.worker import Worker, worker_dtype  # noqa: E402

if TYPE_CHECKING:
    from tokenmill.distributed.group import TPGroup
    from tokenmill.models.loader import LoadedModel

logger = logging.getLogger("tokenmill")
# Devices whose KV cache is not host memory, where --preemption-mode swap pays (tests add "cpu" to
# exercise the same code on this machine).
SWAP_DEVICES = ("cuda",)


def build_core(config: EngineConfig) -> EngineCore:
    """The engine core for ``config``: what the offline LLM, the engine-core process and ``tokenmill profile``
    run. A failure part way stops whatever had started (worker ranks, the KV connector) and raises."""
    return CoreBuilder(config).build()


class CoreBuilder:
    """The state of a start-up in progress: what the drafter's checks, the off rule's probe and the step-cost
    calibration (engine/drafting.py, engine/calibration.py) read as it goes (the device and dtype, the model's
    config and tokenizer, the KV cache, the runner)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = None  # the ranks (executor/): this process alone, or the tensor/pipeline-parallel ones
        self.kv_connector = None  # prefill/decode disaggregation (kv_transfer/connector.py), with --kv-role

    def build(self) -> EngineCore:
        try:
            self._build(self.config)
        except BaseException:
            for part in (self.executor, self.kv_connector):
                if part is not None:
                    part.shutdown()
            raise
        return EngineCore(self.config, CoreParts(
            self.model_config, self.tokenizer, self.max_model_len, self.kv_cache, self.scheduler, self.runner,
            self.grammars, self.info, self.weight_bytes, self.kv_bytes_per_token, self.executor, self.kv_connector,
            self.startup, self.device, self.dtype, self.proposer))

    def _build(self, config: EngineConfig) -> None:
        phase = self.startup = StartupPhases()
        self.device = resolve_device(config.device)
        check_kv_offload(config, self.device.type)
        if config.scheduler.preemption_mode == "swap" and self.device.type not in SWAP_DEVICES:
            raise ValueError(
                f"preemption_mode 'swap' copies a preempted request's KV to host memory; on the {self.device.type} "
                "the KV cache is already in host memory, so it would only copy it to itself: use 'recompute'")
        torch.manual_seed(config.seed)
        source = resolve_model(config.model)
        self.model_name = source.name
        self.model_path = source.path  # a .gguf file or a Hugging Face folder (its generation_config.json)
        # On the CPU kernels every mode takes float32 activations and is batch invariant (integer GEMMs on
        # quantized blocks, fixed-order float GEMMs on float weights): --dtype auto picks float32 there.
        self.dtype = worker_dtype(config, self.device)
        phase("kernels")
        if config.parallel.world_size > 1:
            self._check_parallel(config, source)
        elif config.parallel.enable_expert_parallel:
            logger.warning("--enable-expert-parallel has no effect with --tensor-parallel-size 1 (one rank holds "
                           "every expert)")
        self.executor = start_executor(config, self.device)  # (the other ranks load their shards meanwhile)
        self.device = self.executor.device
        if config.parallel.world_size > 1:
            phase("parallel workers")
        tp = self.executor.group
        self.worker = Worker(config, source, self.device, self.dtype, tp, phase)  # this rank's shard
        self.activation_precision = self.worker.activation_precision
        loaded = self.worker.loaded
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.quantization = loaded.quantization  # "auto" resolved
        self.served = resolve_task(config, self.model_config, self.tokenizer,
                                   getattr(loaded.model, "classifier", None) is not None)
        if getattr(loaded.model, "is_encoder", False):
            self.config = config = encoder_config(config, self.max_model_len)

        spec = config.speculative
        if spec.num_speculative_tokens >= self.max_model_len and spec.speculative_method is not None:
            raise ValueError(f"--num-speculative-tokens {spec.num_speculative_tokens} leaves no room in the "
                             f"{self.max_model_len}-token context; use fewer")
        draft = load_drafter(self, spec, phase) if spec.speculative_method == "draft" else None

        cache = config.cache
        # The drafter's KV rides on the target's blocks: one pool, sized for both per block. Under tensor
        # parallelism each rank holds its KV heads (loaded.model.cfg: this rank's view): sized per rank.
        shard_config = loaded.model.cfg
        self.kv_bytes_per_token = kv_cache_bytes_per_token(shard_config, self.dtype, cache.kv_cache_dtype)
        if draft is not None:
            self.kv_bytes_per_token += kv_cache_bytes_per_token(draft.config, self.dtype, cache.kv_cache_dtype)
        block_bytes = self.kv_bytes_per_token * cache.block_size
        budget = parse_memory(cache.kv_cache_memory)
        num_blocks, why = size_kv_pool(budget, free_memory_bytes(self.device) if budget[0] == "fraction" else 0,
                                       block_bytes, cache.block_size, config.scheduler.max_num_seqs,
                                       self.max_model_len)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory {cache.kv_cache_memory!r} holds no KV block of {block_bytes} bytes; "
                "raise --kv-cache-memory"
            )
        # Anything that changes the KV values must change the salt, or a cached block could be reused wrongly.
        salt = (f"{self.model_name}|{self.dtype}|{config.max_model_len}|{self.quantization}|{cache.kv_cache_dtype}|"
                f"{self.activation_precision}").encode()
        self.kv_cache = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, salt)
        self.executor.start_workers(num_blocks)
        proposer = None
        if spec.speculative_method == "ngram":
            proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif draft is not None:
            draft_kv = allocate_kv_cache(draft.config, num_blocks, cache.block_size, self.dtype, self.device,
                                         cache.kv_cache_dtype, zeroed=not draft.model.attention_backend.reads_only_written_slots)
            proposer = DraftModelProposer(ModelRunner(draft.model, draft_kv, cache.block_size, self.device,
                                                      config.seed + 1), cache.block_size,
                                          spec.num_speculative_tokens)
        self.proposer = proposer
        phase("KV pool")
        self.runner = self.worker.init_kv_cache(num_blocks, self.executor)
        # structured outputs: grammars compiled against the vocabulary (at add_request), matched by the runner
        self.grammars = self.runner.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        if proposer is not None:
            proposer.draft_cost = measure_draft_cost(self, proposer)
            phase("speculative off rule")
        step_cost = None
        if config.scheduler.plans_steps:
            step_cost = startup_step_cost(self, config)
            phase("step cost")
        self.scheduler = make_scheduler(config.scheduler, self.kv_cache, self.max_model_len, step_cost,
                                        config.parallel.batches_in_flight if tp is not None and tp.pipeline else 1,
                                        proposer.finish if proposer is not None else None)
        if config.lora.enable_lora:  # the adapters' pool and slots around the model's projections (tokenmill/lora/)
            lora = self.runner.lora = LoRAManager(self.runner.model, self.model_config, config.lora, self.device)
            self.scheduler.max_loras = config.lora.max_loras
            self.scheduler.finish_hooks.append(lora.release)
        if config.kv_transfer.kv_role is not None:
            self._start_kv_transfer(config, self.runner.kv_caches, tp, draft)
        if cache.kv_offload_size is not None:
            self._start_kv_tier(config)
        self.weight_bytes = weight_bytes_read(loaded.model)  # what a step reads of the weights
        # a known GPU's datasheet costs nothing; a measurement only where a server reports it
        roofline = machine_roofline(self.device.type, self.device.index, str(self.dtype).removeprefix("torch."),
                                    config.measure_roofline)
        phase("roofline")
        self.info = CoreInfo(self.model_name, str(self.model_path), self.model_config, self.max_model_len,
                             str(self.dtype).removeprefix("torch."), self.quantization, num_blocks,
                             cache.block_size, self.kv_bytes_per_token, proposer is not None, config,
                             str(self.device), device_uuid(self.device), roofline,
                             list(self.kv_connector.address) if self.kv_connector and self.kv_connector.address
                             else None, self.served)
        logger.info("model %s: %s, dtype %s on %s, weights %s; KV cache %s, %d blocks x %d tokens (%.1f MiB: %s)",
                    self.model_name, self.model_config.architecture, self.dtype, self.device, self.quantization,
                    cache.kv_cache_dtype, num_blocks, cache.block_size, num_blocks * block_bytes / 2**20, why)

    def _check_parallel(self, config: EngineConfig, source: ModelSource) -> None:
        """Check that the model splits over the ranks before any process starts."""
        par = config.parallel
        if config.scheduler.preemption_mode == "swap":
            raise ValueError("--preemption-mode swap is not supported with more than one rank "
                             "(--tensor-parallel-size, --pipeline-parallel-size) yet")
        model_cfg = model_config_of(source)
        check_tensor_parallel(model_cfg, par.tensor_parallel_size,
                              quantized=config.quantization in ("int8", "int4", "gguf"),
                              expert_parallel=par.enable_expert_parallel)
        check_pipeline_parallel(model_cfg, par.pipeline_parallel_size)

    def _start_kv_transfer(self, config: EngineConfig, kv_tensors: list, tp: TPGroup | None,
                           draft: LoadedModel | None) -> None:
        """Prefill/decode disaggregation: this engine's side of the KV connector."""
        role = config.kv_transfer.kv_role
        if tp is not None:
            raise ValueError(f"--kv-role {role} with more than one rank (--tensor-parallel-size, "
                             "--pipeline-parallel-size) is not built yet: the KV is sharded over the ranks")
        if draft is not None:
            raise ValueError(f"--kv-role {role} with a draft model is not built yet (the drafter's KV would have "
                             "to travel too); use --speculative-method ngram or none")
        cfg = self.model_config
        layout = (f"{self.model_name}|{self.dtype}|{self.quantization}|act {self.activation_precision}|"
                  f"kv {config.cache.kv_cache_dtype}|block "
                  f"{config.cache.block_size}|{cfg.num_layers}x{cfg.num_kv_heads}x{cfg.head_dim}")
        self.kv_connector = KVConnector(config.kv_transfer, kv_tensors, config.cache.block_size, layout)
        self.scheduler.remote_kv.recompute_failed = config.kv_transfer.kv_load_failure_policy == "recompute"

    def _start_kv_tier(self, config: EngineConfig) -> None:
        """The KV tier on local disk (--kv-offload-size; core/kv_tier.py): blocks the pool evicts are written
        there and read back on a prefix hit. Its directory is keyed by all that shapes a block's bytes."""
        cache, cfg = config.cache, self.model_config
        key = tier_key(self.model_path, {
            "model": self.model_name, "dtype": str(self.dtype), "quantization": self.quantization,
            "activations": self.activation_precision, "kv_cache_dtype": cache.kv_cache_dtype,
            "block_size": cache.block_size, "max_model_len": self.max_model_len, "layers": cfg.num_layers,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rank": 0, "world_size": 1})
        root = Path(cache.kv_offload_path).expanduser() if cache.kv_offload_path else default_path()
        store = open_kv_tier(self.runner.kv_caches, self.kv_cache.pool, root / key.hex()[:32],
                             int(cache.kv_offload_size * 2**30), key)
        self.kv_connector = store  # the engine core drives its reads as it drives a KV connector's pulls
        self.runner.kv_tier, self.scheduler.kv_tier = store, store.tier
