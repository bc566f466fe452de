"""The decoder-only transformer every supported family runs on: Llama 2/3, SmolLM2, Mistral (sliding
window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Gemma 2 (sandwich norms, GELU, embedding scale,
logit soft-capping, alternating sliding window), Gemma 3 (Gemma 2's extras, q/k norms, 5:1 local/global
layers with two RoPE bases), Phi-3 (fused checkpoints; Phi-3.5/Phi-4-mini: partial RoPE, longrope) and
SmolLM3 (no RoPE on every fourth layer). ModelConfig says which extras a model has; the code below is one
definition with those switches, not one class per family.

Runs over a flat batch of T tokens from many requests at once; attention goes through the
paged-KV backend. Weights arrive under Hugging Face names and are fused on load:
q/k/v into one projection and gate/up into another (one GEMM each instead of three/two); Phi-3
checkpoints arrive fused already.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.pipeline import model_stage_layers, stage_config
from tokenmill.distributed.sharding import dispatches_all_to_all, expert_range, local_config, padded_vocab
from tokenmill.layers.attention import AttentionMetadata, TorchPagedAttention
from tokenmill.layers.moe import SparseMoE
from tokenmill.layers.quant import FORMAT_IDS, QuantizedLinear, StackedLinear
from tokenmill.layers.rotary import RotaryEmbedding


class Linear(nn.Linear):
    """nn.Linear without its random initialization: load_weights fills every parameter or refuses the
    checkpoint, and initializing 135M weights only to overwrite them was ~2 s of every load."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.ops = None  # torch.ops.tokenmill when the fused CPU kernels are on (see use_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        # Normalise in float32, as the reference implementation does, then scale in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """cfg: this rank's view under tensor parallelism (its heads): the output is this rank's partial sum
    through its o_proj columns, which DecoderLayer all-reduces; ``tp`` serves OLMoE's norm over all heads."""

    def __init__(self, cfg: ModelConfig, backend: TorchPagedAttention, layer: int, tp=None) -> None:
        super().__init__()
        self.tp = tp
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # over each head (Qwen3) or over all of q and all of k (OLMoE)
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(self.d if per_head else self.h * self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d if per_head else self.hkv * self.d, cfg.rms_norm_eps)
        self.qk_norm, self.clip = cfg.qk_norm, cfg.clip_qkv
        self.rot = cfg.rope_dim  # < d: partial rotary, which the fused RoPE kernel (whole heads) cannot run
        self.scale, self.window, self.softcap = cfg.attention_scale, cfg.window(layer), cfg.attn_logit_softcap
        self.backend = backend
        self.ops = None

    def forward(self, x, rope_tables, kv: tuple[torch.Tensor, torch.Tensor], meta):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = self.h + self.hkv  # q and k heads are adjacent in the fused output
        if self.qk_norm:  # normalised before RoPE, written back so that RoPE still takes one call
            rows = self.d if self.qk_norm == "head" else None  # None: the whole of q, of k
            q, k = qkv[:, : self.h * self.d], qkv[:, self.h * self.d: qk * self.d]
            if rows is None and self.tp is not None:
                q_n, k_n = self._norm_split_heads(q, k)
            else:
                q_n = self.q_norm(q.reshape(-1, rows or q.shape[1])).view(t, -1)
                k_n = self.k_norm(k.reshape(-1, rows or k.shape[1])).view(t, -1)
            qkv[:, : qk * self.d] = torch.cat([q_n, k_n], dim=1)
        if self.clip:
            qkv.clamp_(-self.clip, self.clip)
        fused_rope = self.ops is not None and self.rot == self.d
        if fused_rope:  # rotate q and k heads in one call
            self.ops.rope_(qkv, rope_tables[0], rope_tables[1], qk, self.d)
        q, k, v = qkv.split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k = q.view(t, self.h, self.d), k.view(t, self.hkv, self.d)
        if not fused_rope:
            q, k = RotaryEmbedding.apply(q, k, *rope_tables)
        o = self.backend.forward(q, k, v.view(t, self.hkv, self.d), kv, meta,
                                 scale=self.scale, window=self.window, softcap=self.softcap)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.h * self.d))

    def _norm_split_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMoE's RMSNorm over all of q and all of k, with the heads split over the ranks: each rank's
        sums of squares, one all-reduce of the pair, then this rank's slice of each norm's weight."""
        sums = torch.stack([q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)], dim=-1)  # [T, 2]
        self.tp.all_reduce_(sums)
        out = []
        for x, norm, total in ((q, self.q_norm, sums[:, :1]), (k, self.k_norm, sums[:, 1:])):
            xf = x.float() * torch.rsqrt(total / (x.shape[1] * self.tp.size) + norm.eps)
            out.append(norm.weight * xf.to(x.dtype))
        return out[0], out[1]


class MLP(nn.Module):
    """Under tensor parallelism this rank's slice of the width: the output is its partial sum through its
    down_proj columns (DecoderLayer all-reduces it; a shared expert's joins SparseMoE's)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.gelu = act == "gelu_tanh"
        self.ops = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and not self.gelu:
            return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    """The decoder layer, the model's one definition of it: two halves, each a residual branch (attention:
    norm, q/k/v, RoPE, the KV cache write, paged attention, o_proj; MLP: norm, gate/up, activation, down),
    with the family's extras as switches (Gemma 2's sandwich norms around each half, q/k norms, windows,
    soft-caps, GELU, experts). Under tensor parallelism each half's row-parallel output is all-reduced
    here, between the half and its residual add (a MoE layer combines across ranks itself: SparseMoE).

    Each half runs as one fused kernel call (``ops.attention_half`` / ``ops.mlp_half``, cpu_kernels.cpp)
    where it has no extras and its weights are quantized blocks (with a float32 KV cache and float32
    activations), and op by op otherwise (torch, or the kernels' single ops). LlamaForCausalLM may run
    every layer's fused halves in one call (``ops.forward_layers``): this loop, in C++."""

    def __init__(self, cfg: ModelConfig, backend: TorchPagedAttention, layer: int, tp=None) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, layer, tp)
        # Llama: the norm before the MLP. Gemma 2 (sandwich): the norm of the attention's output, with
        # pre_feedforward_layernorm before the MLP and post_feedforward_layernorm after it.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        self.moe = cfg.is_moe_layer(layer)
        if self.moe:
            shared = cfg.shared_expert_intermediate_size
            experts = (0, cfg.num_experts) if tp is None else \
                expert_range(cfg.num_experts, tp.rank, tp.size, tp.expert_parallel)
            # The shared expert: split by width, its partial sum joining the experts' in SparseMoE's one
            # all-reduce; under the all-to-all dispatch whole on every rank (cfg holds its 1/T: undone
            # here), run over the rank's share of the tokens (distributed/sharding.py loads it whole)
            if dispatches_all_to_all(tp):
                shared *= tp.size
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size, cfg.norm_topk_prob,
                                 MLP(cfg.hidden_size, shared) if shared else None, experts=experts, tp=tp)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        # which RoPE tables this layer takes (LlamaForCausalLM.run_layers): global, Gemma 3's local, or none
        self.rope_kind = cfg.rope_kind(layer)
        # the halves the fused kernels can run: no extras (their weights are checked in fused_halves)
        a = self.self_attn
        self._plain = (not (cfg.qk_norm or cfg.clip_qkv or a.window or a.softcap or self.sandwich or a.rot != a.d),
                       not (self.moe or self.mlp.gelu or self.sandwich))
        self.fuse = True  # LlamaForCausalLM.set_layer_fusion: False runs every half op by op
        self.ops = None
        self._halves: tuple | None = None  # fused_halves' answer, kept until the ops or weights change

    def forward(self, x, rope_tables, kv, meta):
        x = x + self.attention_half(x, rope_tables, kv, meta)
        return x + self.mlp_half(x)

    def attention_half(self, x, rope_tables, kv, meta) -> torch.Tensor:
        """The attention branch's output, to add to the residual stream x."""
        fused = self.fused_halves()[0] if len(kv) == 2 and x.dtype == torch.float32 else None
        if fused is not None:
            a = self.self_attn
            out = self.ops.attention_half(x, fused[0], fused[1], kv[0], kv[1], rope_tables[0], rope_tables[1],
                                          meta.slot_mapping, meta.block_tables, meta.seq_of, meta.ctx_lens, a.h,
                                          a.hkv, a.d, self.input_layernorm.eps, a.scale)
        else:
            out = self.self_attn(self.input_layernorm(x), rope_tables, kv, meta)
        if self.tp is not None:
            self.tp.all_reduce_(out)
        return self.post_attention_layernorm(out) if self.sandwich else out

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP branch's output, to add to the residual stream x."""
        fused = self.fused_halves()[1] if x.dtype == torch.float32 else None
        if fused is not None:
            out = self.ops.mlp_half(x, fused[0], fused[1], self.post_attention_layernorm.eps)
        else:
            norm = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
            out = self.mlp(norm(x))
        if self.tp is not None and not self.moe:
            self.tp.all_reduce_(out)
        return self.post_feedforward_layernorm(out) if self.sandwich else out

    def fused_halves(self) -> tuple:
        """(attention, MLP): each half's (weights, kernel formats) for the fused kernels, or None where the
        half runs op by op (no kernels, fusion off, a family's extras, float weights, an attention backend
        other than the CPU kernels')."""
        if self._halves is None:
            def quantized(*lins) -> bool:  # (only q/k/v may have a bias: the kernel adds it)
                return all(isinstance(lin, QuantizedLinear) and lin.bias is None for lin in lins)

            def attention():  # norm, qkv (or q|k), bias, o_proj, v (or empty); formats of qkv, o_proj, v
                qkv, o = a.qkv_proj, a.o_proj
                bias = qkv.bias if qkv.bias is not None else torch.empty(0)
                if isinstance(qkv, QuantizedLinear) and quantized(o):
                    parts = [qkv]
                elif isinstance(qkv, StackedLinear) and len(qkv.parts) == 2 and quantized(*qkv.parts, o):
                    parts = list(qkv.parts)
                else:
                    return None
                v = [parts[1].qweight, FORMAT_IDS[parts[1].kernel_fmt]] if len(parts) == 2 else [torch.empty(0), 0]
                return ([self.input_layernorm.weight, parts[0].qweight, bias, o.qweight, v[0]],
                        [FORMAT_IDS[parts[0].kernel_fmt], FORMAT_IDS[o.kernel_fmt], v[1]])

            def mlp():
                lins = (m.gate_up_proj, m.down_proj)
                return ([self.post_attention_layernorm.weight, *(lin.qweight for lin in lins)],
                        [FORMAT_IDS[lin.kernel_fmt] for lin in lins]) if quantized(*lins) else None

            a, m = self.self_attn, self.mlp
            on = self.ops is not None and self.fuse
            fused_attention = on and self._plain[0] and a.backend.fuses_layers  # (the cpu backend's kernel inside)
            self._halves = (attention() if fused_attention else None, mlp() if on and self._plain[1] else None)
        return self._halves


class LlamaForCausalLM(nn.Module):
    """``tp`` (a distributed.group.TPGroup): tensor parallelism. The model is then this rank's shard:
    ``cfg`` its view (its query and KV heads, its MLP width; distributed/sharding.py), the embedding and
    head its rows of the padded vocabulary; the weights arrive sliced (models/loader.py). A group of
    pipeline stages (``tp.pipeline``) instead: this rank's layers ``layer_range`` whole, renumbered from 0
    in ``cfg`` and ``layers`` (distributed/pipeline.py); embed, run_layers and compute_logits are the
    stage's three parts."""

    def __init__(self, cfg: ModelConfig, backend: TorchPagedAttention, max_positions: int, tp=None) -> None:
        super().__init__()
        self.whole_cfg = cfg  # the whole model's (a pipeline stage's cfg holds its layers only)
        if tp is not None and tp.pipeline:  # a pipeline stage: its layers, renumbered from 0 (and split
            self.layer_range = model_stage_layers(cfg, tp.stage, tp.num_stages)  # over its tensor group)
            cfg, tp = stage_config(cfg, *self.layer_range), tp.tensor
        else:
            self.layer_range = (0, cfg.num_layers)
        self.tp = tp
        self.cfg = cfg = cfg if tp is None else local_config(cfg, tp.size, tp.expert_parallel)
        rows = self.vocab_rows = cfg.vocab_size if tp is None else padded_vocab(cfg.vocab_size, tp.size) // tp.size
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size,
                                         _weight=torch.empty(rows, cfg.hidden_size))  # (no random init)
        self.attention_backend = backend  # (one instance, shared by every layer)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i, tp) for i in range(cfg.num_layers))
        self._rope_kinds = sorted({layer.rope_kind for layer in self.layers})  # the RoPE tables a step makes
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, rows, bias=False)
        self.rope = RotaryEmbedding(cfg.rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rope_local = None if cfg.rope_local_base_freq is None else \
            RotaryEmbedding(cfg.rope_dim, max_positions, cfg.rope_local_base_freq, None)  # Gemma 3's sliding layers
        self.head: nn.Module | None = None  # a quantized output head (models/quantize.py), else the float one
        self.ops = None
        self._layer_stack: tuple | None = None  # forward_layers' arguments (see _fused_layers)
        self.requires_grad_(False)

    def use_fused_ops(self, ops) -> None:
        """Run RMSNorm, RoPE, SwiGLU and float32-cache attention through fused CPU kernels
        (``torch.ops.tokenmill``; float32 on the CPU only), and each decoder layer's halves as one call
        where they qualify (DecoderLayer), or the torch reference code when ``ops`` is None."""
        for m in self.modules():
            if hasattr(m, "ops"):
                m.ops = ops
        for layer in self.layers:
            layer.self_attn.backend.ops = ops
            layer._halves = None
        self._layer_stack = None

    def set_layer_fusion(self, on: bool) -> None:
        """Whether the decoder layers' halves run as fused kernel calls where they qualify (the default),
        or op by op (tests compare the two)."""
        for layer in self.layers:
            layer.fuse, layer._halves = on, None
        self._layer_stack = None

    def _fused_layers(self, x, rope_tables, kv_caches, meta) -> torch.Tensor | None:
        """All decoder layers of a step in one kernel call (``forward_layers``: the layers' fused halves
        in a C++ loop, without the Python between them), where every half of every layer is fused, every
        layer takes the same RoPE tables, and there are no collectives between them (one process); None
        otherwise."""
        if self.tp is not None or x.dtype != torch.float32 or any(len(kv) != 2 for kv in kv_caches) \
                or len(rope_tables) != 1:
            return None
        rope_tables = next(iter(rope_tables.values()))
        if self._layer_stack is None:
            halves = [layer.fused_halves() for layer in self.layers]
            ok = all(a is not None and m is not None for a, m in halves)
            self._layer_stack = ([w for a, m in halves for w in a[0] + m[0]],
                                 [f for a, m in halves for f in a[1] + m[1]]) if ok else ()
        if not self._layer_stack:
            return None
        weights, fmts = self._layer_stack
        cfg, a = self.cfg, self.layers[0].self_attn
        return self.ops.forward_layers(x, weights, fmts, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches],
                                       rope_tables[0], rope_tables[1], meta.slot_mapping, meta.block_tables,
                                       meta.seq_of, meta.ctx_lens, a.h, a.hkv, a.d, self.norm.eps, cfg.attention_scale)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, ...]],  # per layer; see layers/attention.py
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [N]: rows of the batch that need next-token logits
        hidden_indices: torch.Tensor | None = None,  # [M]: rows whose final hidden states pooling requests need
    ):  # [N, V] float32; with hidden_indices ([N, V] logits, [M, H] normed hidden states)
        x = self.run_layers(self.embed(input_ids), positions, kv_caches, meta)
        if hidden_indices is None:
            return self.compute_logits(x, logits_indices)
        return self.compute_logits(x, logits_indices), self.norm(x[hidden_indices]).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        x = self.embed_tokens(input_ids) if self.tp is None else self._embed_parallel(input_ids)
        if self.cfg.embed_scale != 1.0:  # Gemma: the scale rounded to the model dtype, as transformers does
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """The decoder layers this model holds (all of them, or a pipeline stage's) over hidden states x."""
        tables = {kind: self._rope_tables(kind, positions) for kind in self._rope_kinds}
        fused = self._fused_layers(x, tables, kv_caches, meta)
        if fused is not None:
            x = fused
        else:
            for layer, kv in zip(self.layers, kv_caches):
                x = layer(x, tables[layer.rope_kind], kv, meta)
        return x

    def _rope_tables(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin per token for the layers of one RoPE kind ([T, 1, R/2]; [T, R/2] for the kernels). A NoPE
        layer's are cos 1, sin 0: rotating by them leaves q and k exactly as they are, so the fused kernels
        run it too."""
        if kind == "none":
            cos = torch.ones(positions.shape[0], 1, self.rope.cos.shape[1], dtype=torch.float32,
                             device=self.rope.cos.device)
            sin = torch.zeros_like(cos)
        else:
            cos, sin = (self.rope if kind == "global" else self.rope_local).tables(positions)
        return (cos.squeeze(1), sin.squeeze(1)) if self.ops is not None else (cos, sin)

    def compute_logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:  # [N, V] float32
        # The output head is the largest GEMM: run it only where a token is sampled.
        x = self.norm(x[logits_indices])
        if self.head is not None:
            logits = self.head(x).float()
        else:
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(x, head).float()
        if self.tp is not None:  # each rank's slice of the vocabulary, in rank order; drop the padding
            logits = self.tp.all_gather(logits, dim=-1)[:, : self.cfg.vocab_size]
        cap = self.cfg.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def _embed_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids in its rows (zeros elsewhere); one all-reduce."""
        local = input_ids - self.tp.rank * self.vocab_rows
        mine = (local >= 0) & (local < self.vocab_rows)
        x = self.embed_tokens(torch.where(mine, local, 0))
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return self.tp.all_reduce_(x)

    def take_expert_tokens(self) -> list[list[int]] | None:
        """Tokens routed to each expert since the last call, per layer ([] for a dense layer), and restart
        the counts; None for a model without experts."""
        if not self.cfg.num_experts:
            return None
        return [row if layer.moe else [] for layer, row in zip(self.layers, self.expert_counts().tolist())]

    def expert_counts(self) -> torch.Tensor:
        """Tokens routed to each expert since the last call, [layers, experts] on the CPU (zeros for a
        dense layer), the counts restarted."""
        rows = []
        for layer in self.layers:
            counts = layer.mlp.expert_tokens if layer.moe else torch.zeros(self.cfg.num_experts, dtype=torch.long)
            rows.append(counts.cpu().clone())
            if layer.moe:
                counts.zero_()
        return torch.stack(rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | None]]) -> None:
        """Load from Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight``...). A tensor
        given as None is kept as quantized blocks (models/quantize.py): its parameter stays untouched."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}  # fused parameter -> parts seen so far
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        kept: set[str] = set()  # weights that come as None: their quantized blocks replace them later
        expert_parts: dict[str, int] = {}  # stacked expert parameter -> expert matrices copied into it
        for name, tensor in weights:
            name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name
            if name.startswith("rotary_emb") or "rotary_emb.inv_freq" in name:
                continue
            head, sep, tail = name.rpartition(".mlp.")
            if sep and tail in _STACKED_EXPERTS:
                name = f"{head}.mlp.{_STACKED_EXPERTS[tail]}"
            expert = _EXPERT.match(name)
            if expert is not None and tensor is not None:
                key = self._load_expert(params, name, expert, tensor)
                expert_parts[key] = expert_parts.get(key, 0) + 1
                continue
            parts = name.split(".")
            if tensor is None:
                if len(parts) >= 2 and parts[-2] in fused:
                    name = ".".join(parts[:-2] + [fused[parts[-2]][0], parts[-1]])
                kept.add(name)
                continue
            if len(parts) >= 2 and parts[-2] in fused:
                target, idx = fused[parts[-2]]
                key = ".".join(parts[:-2] + [target, parts[-1]])
                if key in params:  # check each part here: torch.cat would fail obscurely, or name the fused one
                    c = self.cfg
                    rows = ([c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2
                            if target == "qkv_proj" else [params[key].shape[0] // 2] * 2)[idx]
                    want = (rows, *params[key].shape[1:])
                    if tuple(tensor.shape) != want:
                        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
                pending.setdefault(key, {})[idx] = tensor
                n_parts = 3 if target == "qkv_proj" else 2
                if len(pending[key]) < n_parts:
                    continue
                parts_seen = pending.pop(key)
                tensor = torch.cat([parts_seen[i] for i in range(n_parts)], dim=0)
                name = key
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the head
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {self.cfg.architecture} model")
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            p.data.copy_(tensor)
            loaded.add(name)
        for key, n in expert_parts.items():  # every expert's gate and up (or down) matrix
            if n == params[key].shape[0] * (2 if key.endswith("w_gate_up") else 1):
                loaded.add(key)
        missing = set(params) - loaded - kept
        if missing == {"lm_head.weight"} and self.cfg.pooling_type:  # an embedder saved without its head
            self.lm_head = None
            missing = set()
        if pending or missing:
            raise ValueError(f"checkpoint is incomplete: missing {sorted(missing | set(pending))[:8]}")

    def _load_expert(self, params: dict, name: str, match, tensor: torch.Tensor) -> str:
        """Copy one expert's gate, up or down matrix into its slice of the stacked parameter; its key."""
        layer, e, part = match.groups()
        target, half = _EXPERT_PARTS[part]
        key = f"layers.{layer}.mlp.{target}"
        first = getattr(self.layers[int(layer)].mlp, "first_expert", 0) if int(layer) < len(self.layers) else 0
        e = int(e) - first  # this rank's experts are [first, first + E_local) (expert parallelism)
        if key not in params or not 0 <= e < params[key].shape[0]:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {self.cfg.architecture} model")
        dst = params[key].data[e]
        if half is not None:
            dst = dst.chunk(2)[half]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        return key


# one expert's matrices as checkpoints name them (Qwen2-MoE/OLMoE; Mixtral's w1/w3/w2) -> where they go
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PARTS = {"gate_proj": ("w_gate_up", 0), "w1": ("w_gate_up", 0), "up_proj": ("w_gate_up", 1),
                 "w3": ("w_gate_up", 1), "down_proj": ("w_down", None), "w2": ("w_down", None)}
# transformers 5's in-memory layout, all experts in one tensor (a checkpoint saved that way loads as is)
_STACKED_EXPERTS = {"experts.gate_up_proj": "w_gate_up", "experts.down_proj": "w_down"}
