"""What a run needs before it is launched: parameters, FLOPs, memory per GPU, and time.

`tools/plan.py` is the command; this module is the arithmetic, so tests and scripts can call it.
It takes the same flags as `pretrain_gpt.py` (the shared parser of `megatron_focus.config.flags`,
validated by the same `validate_args` at the cluster's world size), plus a few about the cluster.

Formulas (bytes; Psi = parameters held by one tensor-parallel rank, N_d = data-parallel size):

* Parameters are counted from the flags as Megatron-Core's `GPTModel` builds them (fused QKV,
  optional biases, LayerNorm weight+bias or RMSNorm weight, untied output layer, learned position
  table, Focus's router). Tensor parallelism splits the word embedding, output layer, QKV, output
  projection and MLP weights (and the column-parallel biases); norms, row-parallel biases, the
  position table and the Focus router are replicated on every TP rank.
* Model states, mixed precision (bf16/fp16): weights 2 Psi, gradients 2 Psi, optimizer 12 Psi
  (fp32 master copy 4 + Adam m 4 + v 4). fp32: weights 4 Psi, gradients 4 Psi, Adam 8 Psi; with
  ZeRO >= 1 DeepSpeed's optimizer also keeps an fp32 copy of its partition (+4 Psi / N_d).
  ZeRO (Rajbhandari et al. 2020): stage 1 divides the optimizer states by N_d, stage 2 also the
  gradients, stage 3 also the weights. With --retrofit only the routers have gradients and
  optimizer state (the frozen weights have neither).
* Activations of one micro-batch (b sequences of s tokens, hidden h, e bytes per activation),
  kept for the backward, per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", written for any head count/size, GQA and MLP):

      sequence-parallel region (divided by t only with --sequence-parallel):
          4 e s b h             the two norms' inputs and outputs (the QKV and fc1 inputs)
        + 2 s b h               the two dropout masks (1 byte each), when --hidden-dropout > 0
      tensor-parallel region (always divided by t):
          e s b (a d + 2 g d)   Q, K, V (a heads, g query groups, d = --kv-channels)
        + e s b (a d + g d)     with RoPE: the unrotated Q, K (V is a view of the fused QKV
                                output, which keeps all of it alive)
        + e s b a d             attention output, heads merged (the output projection's input)
        + e s b a d + 4 s b a   flash / SDPA kernels: their own output and log-sum-exp; or instead,
                                with --materialized-attention (a kernel that keeps the scores):
          e a s^2 b (+ a s^2 b + e a s^2 b with --attention-dropout)
        + 2 e s b f (GELU: fc1 output, fc2 input) or 4 e s b f (SwiGLU: fc1 output 2f, SiLU,
          product)
        + XSA in half precision: 4 s b (a d + g d) (its fp32 copies of y and v)

  With learned positions and materialized attention, for GPT-2/3 (e = 2, g = a, a d = h,
  f = 4h, dropout) this is exactly Korthikanti's
  s b h (34 + 5 a s / h) without tensor parallelism, s b h (10 + 24/t + 5 a s / (h t)) with TP t,
  and s b h (34/t + 5 a s / (h t)) with TP t and SP. Around the layers: the final norm's input and
  output (2 e s b h, SP region), the embedding dropout mask (s b h) and the logits with the fp32
  softmax that the vocab-parallel cross entropy keeps ((e + 4) s b V / t). Focus adds the peak of
  one recomputed soft-gate chunk: 12 b (a/t) c s bytes for chunk size c (fp32 bias, scores and
  probabilities). No pipeline parallelism and no activation recomputation: one micro-batch's
  activations are alive at a time.
* A GPU fits a configuration when weights + gradients + optimizer + activations <= its memory minus
  `--reserved-gb` (default 10%: CUDA context, NCCL and DeepSpeed communication buckets, ZeRO-3's
  gathered weights, allocator fragmentation).
* FLOPs per token are `megatron_focus.model.flops.flops_per_token` (what the run itself reports
  as TFLOP/s); MFU = achieved FLOP/s per GPU / the GPU's dense bf16 peak.
"""

import argparse
import functools
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, List, Optional, Tuple

from megatron_focus.config.run_config import RunConfig, frozen_flags
from megatron_focus.variants import added_weight, variant

if TYPE_CHECKING:
    from megatron_focus.model.config import ModelConfig

GB = 1e9  # decimal gigabytes, as GPU memory sizes are quoted (80 GB)
DEFAULT_VOCAB = 50257  # GPT-2's tokenizer


class PlanError(ValueError):
    """A plan that cannot run: the message names the flag to change."""


# --- flags ----------------------------------------------------------------------------------------


def add_planner_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("planner (tools/plan.py only)")
    g.add_argument("--nodes", type=int, default=1)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--gpu-memory-gb", type=float, default=80.0)
    g.add_argument(
        "--reserved-gb",
        type=float,
        default=None,
        help="memory per GPU not available to the model (default 10%% of the GPU's)",
    )
    g.add_argument(
        "--gpu",
        default="H100",
        help="GPU name for its dense bf16 peak (H100, H200, A100, L40S, A10)",
    )
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 peak per GPU in TFLOP/s (overrides --gpu)",
    )
    g.add_argument(
        "--train-tokens",
        type=float,
        default=None,
        help="tokens to train on (default --train-iters x --global-batch-size x --seq-length)",
    )
    g.add_argument(
        "--target-days",
        type=float,
        default=None,
        help="wall-clock days the run should take: prints the tokens/s and MFU needed",
    )
    g.add_argument(
        "--assumed-mfu", type=float, default=0.4, help="MFU for the time estimate (default 0.4)"
    )
    g.add_argument(
        "--materialized-attention",
        action="store_true",
        help="count the s x s attention scores (an attention kernel that stores them)",
    )
    g.add_argument(
        "--json", dest="json_path", default=None, metavar="PATH", help="also write the plan as JSON"
    )
    return parser


_PLANNER_FLAGS = [
    a for a in add_planner_args(argparse.ArgumentParser())._actions if a.dest != "help"
]
CLUSTER_FLAGS = [action.dest for action in _PLANNER_FLAGS]
Cluster = frozen_flags("Cluster", _PLANNER_FLAGS, __name__)  # the planner's own flags


def parse_plan_args(argv: Optional[List[str]] = None) -> Tuple[RunConfig, Cluster]:
    """pretrain_gpt.py's flags, validated as a run on the whole cluster would be, and the
    cluster's."""
    from megatron_focus.config.flags import build_parser
    from megatron_focus.config.validation import validate_args
    from megatron_focus.data import reads_data_files

    parser = add_planner_args(build_parser())
    parser.prog = "plan.py"
    args = parser.parse_args(argv)
    cluster = Cluster(**{name: getattr(args, name) for name in CLUSTER_FLAGS})
    world = cluster.nodes * cluster.gpus_per_node
    if cluster.nodes < 1 or cluster.gpus_per_node < 1 or cluster.gpu_memory_gb <= 0:
        raise PlanError("--nodes, --gpus-per-node and --gpu-memory-gb must be positive")
    if (args.tokenizer_model or args.vocab_file) and not reads_data_files(args):
        # only the vocabulary is read
        args = argparse.Namespace(**{**vars(args), "data_path": ["(not read by the planner)"]})
    try:
        config = validate_args(args, world_size=world)  # the ZeRO stage, bf16 from the JSON too
    except ValueError as error:
        raise PlanError(str(error)) from None
    if config.context_parallel_size > 1:
        raise PlanError(
            "--context-parallel-size: the planner does not model context parallelism (each "
            "rank's activations shrink about C-fold, its keys and values do not); plan at "
            "--context-parallel-size 1"
        )
    if world % config.tensor_model_parallel_size:
        raise PlanError(
            f"{world} GPUs do not split into --tensor-model-parallel-size "
            f"{config.tensor_model_parallel_size} groups"
        )
    return config.replace(vocab_size=_vocab_size(config)), cluster


def _vocab_size(config: RunConfig) -> int:
    """The tokenizer's vocabulary: --vocab-size as given (NullTokenizer: and its end-of-document
    id), else read from the tokenizer files, else GPT-2's."""
    reads = config.tokenizer_type == "NullTokenizer" or (
        config.vocab_size is None and (config.tokenizer_model or config.vocab_file)
    )
    if reads:
        from megatron_focus.data.tokenizer import build_tokenizer, tokenizer_flags

        return build_tokenizer(config.tokenizer_type, **tokenizer_flags(config)).vocab_size
    return DEFAULT_VOCAB if config.vocab_size is None else config.vocab_size


# --- parameters -----------------------------------------------------------------------------------


@dataclass
class ParamCount:
    word_embedding: int
    position_embedding: int
    output_layer: int  # 0 when tied to the word embedding
    per_layer: int  # one transformer layer, router included
    router_per_layer: int  # the attention variant's own (Focus's W_g and centroids)
    final_norm: int
    num_layers: int
    sharded: int = 0  # split by tensor parallelism
    replicated: int = 0  # held whole by every tensor-parallel rank

    @property
    def embedding(self) -> int:
        return self.word_embedding + self.position_embedding

    @property
    def non_embedding(self) -> int:
        return self.num_layers * self.per_layer + self.final_norm

    @property
    def total(self) -> int:
        return self.embedding + self.output_layer + self.non_embedding

    def per_tp_rank(self, tp: int) -> float:
        return self.sharded / tp + self.replicated


def _shape(model) -> tuple:
    """(hidden, heads, query groups, head dim, FFN hidden) of a ModelConfig."""
    return (
        model.hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        model.kv_channels,
        model.ffn_hidden_size,
    )


def count_parameters(config: RunConfig, vocab_size: int, tp: int = 1) -> ParamCount:
    """The parameters of the model the flags build (`config.model_config`), with the vocabulary
    padded for `tp` ranks."""
    from megatron_focus.model.gpt import padded_vocab_size

    model = config.model_config
    h, heads, groups, d, ffn = _shape(model)
    vocab = padded_vocab_size(vocab_size, config.make_vocab_size_divisible_by, tp)
    bias = model.add_bias_linear
    layer_norm = model.normalization == "LayerNorm"
    norm = 2 * h if layer_norm else h
    fc1_out = ffn * (2 if model.swiglu else 1)
    # Sharded: QKV (weight, bias), output projection weight, fc1 (weight, bias), fc2 weight.
    qkv = h * (heads + 2 * groups) * d + (heads + 2 * groups) * d * (bias or model.add_qkv_bias)
    layer_sharded = qkv + heads * d * h + h * fc1_out + fc1_out * bias + ffn * h
    # Replicated: the two norms, the row-parallel biases (output projection, fc2).
    qk_norm = 2 * (2 * d if layer_norm else d) if model.qk_layernorm else 0
    layer_replicated = 2 * norm + 2 * h * bias + qk_norm
    # The variant's own (Focus's routers), split or replicated as its core attention declares.
    own_sharded, own_replicated = variant_parameters(model)
    word = vocab * h
    learned = model.position_embedding_type == "learned_absolute"
    position = model.max_position_embeddings * h if learned else 0
    output = 0 if model.tied else vocab * h
    layers = model.num_layers
    return ParamCount(
        word_embedding=word,
        position_embedding=position,
        output_layer=output,
        per_layer=layer_sharded + layer_replicated + (own_sharded + own_replicated) // layers,
        router_per_layer=(own_sharded + own_replicated) // layers,
        final_norm=norm,
        num_layers=layers,
        sharded=word + output + layers * layer_sharded + own_sharded,
        replicated=position + layers * layer_replicated + own_replicated + norm,
    )


@functools.lru_cache(maxsize=8)
def variant_parameters(model: "ModelConfig") -> tuple:
    """(split over TP ranks, replicated) parameters of the variant's own in the whole model (its
    core attention's, `variants.added_weight`), as that code creates and marks them: read off the
    model built on the meta device (no memory), so that a variant declares nothing twice."""
    import torch
    from megatron.core import parallel_state

    from megatron_focus import platform
    from megatron_focus.checkpoint.tp_layout import split_of
    from megatron_focus.model.gpt import build

    with platform.world_of_one(), torch.device("meta"):
        tp = parallel_state.get_tensor_model_parallel_world_size()  # a process's own, if it has one
        built = build(model, tp)  # (the vocabulary is no variant's)
    counts = [0, 0]
    for name, param in built.named_parameters():
        if added_weight(name):
            split = split_of(param) is not None
            counts[not split] += param.numel() * (tp if split else 1)  # this rank's share, if split
    return tuple(counts)


# --- memory ---------------------------------------------------------------------------------------


def activation_bytes_per_layer(
    config: RunConfig,
    micro_batch: int,
    tp: int,
    sp: bool,
    materialized_attention: bool = False,
) -> float:
    """Activations one transformer layer keeps for the backward, one micro-batch (formula above)."""
    h, heads, groups, d, ffn = _shape(config.model_config)
    s, b = config.seq_length, micro_batch
    e = 2 if (config.bf16 or config.fp16) else 4
    sbh = s * b * h
    sp_region = 4 * e * sbh + (2 * sbh if config.hidden_dropout > 0 else 0)
    tp_region = e * s * b * (heads * d + 2 * groups * d)  # Q, K, V
    if config.position_embedding_type == "rope":  # pre-rotary Q, K: V's view keeps the QKV buffer
        tp_region += e * s * b * (heads * d + groups * d)
    tp_region += e * s * b * heads * d  # attention output, heads merged (the projection's input)
    if materialized_attention:  # softmax output (+ dropout mask and output)
        tp_region += e * heads * s * s * b
        if config.attention_dropout > 0:
            tp_region += (1 + e) * heads * s * s * b
    else:  # flash / SDPA kernels keep their output and log-sum-exp, and recompute the scores
        tp_region += e * s * b * heads * d + 4 * s * b * heads
    tp_region += (4 if config.swiglu else 2) * e * s * b * ffn
    if variant(config.attention).xsa and e < 4:
        tp_region += 4 * s * b * (heads * d + groups * d)
    return (sp_region / tp if sp else sp_region) + tp_region / tp


def activation_bytes(
    config: RunConfig,
    vocab: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    materialized_attention: bool = False,
) -> float:
    """All activations of one micro-batch: the layers, the final norm, embedding and logits."""
    s, b, h = config.seq_length, micro_batch, config.hidden_size
    e = 2 if (config.bf16 or config.fp16) else 4
    layers = config.num_layers * activation_bytes_per_layer(
        config, b, tp, sp, materialized_attention
    )
    around = 2 * e * s * b * h + (s * b * h if config.hidden_dropout > 0 else 0)
    around = around / tp if sp else around
    logits = (e + 4) * s * b * vocab / tp
    focus = 0.0
    if variant(config.attention).focus:
        chunk = min(config.focus_chunk_size, s)
        focus = 12 * b * (config.num_attention_heads / tp) * chunk * s
    return layers + around + logits + focus


@dataclass
class Memory:
    tp: int
    sp: bool
    zero_stage: int
    data_parallel: int
    micro_batch: int
    accumulation: int  # micro-batches per global batch and rank; 0 when the batch does not split
    params_per_gpu: float
    weights: float
    gradients: float
    optimizer: float
    activations: float
    total: float
    usable: float
    fits: bool
    note: str = ""

    def gb(self) -> dict:
        d = asdict(self)
        for key in ("weights", "gradients", "optimizer", "activations", "total", "usable"):
            d[key + "_gb"] = round(d.pop(key) / GB, 3)
        return d


def model_state_bytes(
    psi: float, zero_stage: int, data_parallel: int, mixed: bool, trained: Optional[float] = None
):
    """(weights, gradients, optimizer) bytes per GPU for Psi parameters on its TP rank, of which
    `trained` (default all) have gradients and optimizer state (a retrofit trains the routers)."""
    n = data_parallel
    t = psi if trained is None else trained
    if mixed:
        weights, grads, optim = 2 * psi, 2 * t, 12 * t
    else:
        weights, grads, optim = 4 * psi, 4 * t, 8 * t + (4 * t if zero_stage >= 1 else 0)
    if zero_stage >= 1:
        optim /= n
    if zero_stage >= 2:
        grads /= n
    if zero_stage >= 3:
        weights /= n
    return weights, grads, optim


def memory(
    config: RunConfig,
    world: int,
    tp: int,
    sp: bool,
    zero_stage: int,
    micro_batch: int,
    usable: float,
    materialized_attention: bool = False,
) -> Memory:
    from megatron_focus.model.gpt import padded_vocab_size

    dp = world // tp
    params = count_parameters(config, config.vocab_size, tp)
    psi = params.per_tp_rank(tp)
    mixed = bool(config.bf16 or config.fp16)
    trained = params.num_layers * params.router_per_layer if config.retrofit else None
    weights, grads, optim = model_state_bytes(psi, zero_stage, dp, mixed, trained)
    vocab = padded_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp)
    act = activation_bytes(config, vocab, micro_batch, tp, sp, materialized_attention)
    total = weights + grads + optim + act
    per_step = micro_batch * dp
    accumulation = (
        config.global_batch_size // per_step if config.global_batch_size % per_step == 0 else 0
    )
    note = ""
    if zero_stage == 3 and tp > 1:
        note = "ZeRO-3 runs with TP 1 only"
    elif zero_stage == 3 and config.retrofit:
        note = "a retrofit loads weights only, which ZeRO-3 does not support"
    elif not accumulation:
        note = (
            f"global batch {config.global_batch_size} does not split into micro-batch "
            f"{micro_batch} x {dp} data-parallel ranks"
        )
    return Memory(
        tp=tp,
        sp=sp,
        zero_stage=zero_stage,
        data_parallel=dp,
        micro_batch=micro_batch,
        accumulation=accumulation,
        params_per_gpu=psi / (dp if zero_stage == 3 else 1),
        weights=weights,
        gradients=grads,
        optimizer=optim,
        activations=act,
        total=total,
        usable=usable,
        fits=total <= usable and not note,
        note=note,
    )


def tp_options(config: RunConfig, world: int, gpus_per_node: int) -> List[int]:
    """TP sizes the flags allow: within a node, dividing heads and world, fitting query groups."""
    out = []
    tp = 1
    while tp <= gpus_per_node:
        if (
            world % tp == 0
            and config.model_config.splits_over(tp)
            and (tp == 1 or config.seq_length % tp == 0)
        ):
            out.append(tp)
        tp *= 2
    return out


# --- the plan -------------------------------------------------------------------------------------


@dataclass
class Plan:
    model: dict
    parameters: dict
    flops_per_token: float
    cluster: dict
    chosen: dict
    grid: List[dict] = field(default_factory=list)
    throughput: dict = field(default_factory=dict)
    fits: bool = True
    advice: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def peak_flops(cluster: Cluster) -> Optional[float]:
    from megatron_focus.model.flops import PEAK_BF16_FLOPS

    if cluster.peak_tflops:
        return cluster.peak_tflops * 1e12
    name = (cluster.gpu or "").upper()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k.upper() in name), None)


def make_plan(config: RunConfig, cluster: Cluster) -> Plan:
    from megatron_focus.model.flops import flops_per_token
    from megatron_focus.model.gpt import padded_vocab_size

    world = cluster.nodes * cluster.gpus_per_node
    tp = config.tensor_model_parallel_size
    reserved = (
        cluster.reserved_gb * GB
        if cluster.reserved_gb is not None
        else 0.1 * cluster.gpu_memory_gb * GB
    )
    usable = cluster.gpu_memory_gb * GB - reserved
    vocab = padded_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp)
    params = count_parameters(config, config.vocab_size, tp)
    per_token = flops_per_token(config, vocab)
    mat = cluster.materialized_attention

    chosen = memory(
        config,
        world,
        tp,
        config.sequence_parallel,
        config.zero_stage,
        config.micro_batch_size,
        usable,
        mat,
    )
    grid = []
    for t in tp_options(config, world, cluster.gpus_per_node):
        for sp in (False,) if t == 1 else (False, True):
            for stage in range(4):
                grid.append(
                    memory(config, world, t, sp, stage, config.micro_batch_size, usable, mat)
                )

    plan = Plan(
        model=_describe(config, vocab),
        parameters={
            "total": params.total,
            "embedding": params.embedding,
            "word_embedding": params.word_embedding,
            "position_embedding": params.position_embedding,
            "output_layer": params.output_layer,
            "non_embedding": params.non_embedding,
            "per_layer": params.per_layer,
            "router_per_layer": params.router_per_layer,
            "per_tp_rank": params.per_tp_rank(tp),
            "padded_vocab_size": vocab,
            "vocab_size": config.vocab_size,
        },
        flops_per_token=per_token,
        cluster={
            "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node,
            "gpus": world,
            "gpu_memory_gb": cluster.gpu_memory_gb,
            "reserved_gb": reserved / GB,
            "usable_gb": usable / GB,
            "gpu": cluster.gpu,
            "peak_tflops": (peak_flops(cluster) or 0) / 1e12 or None,
        },
        chosen=chosen.gb(),
        grid=[m.gb() for m in grid],
        throughput=_throughput(config, cluster, per_token, world),
        fits=chosen.fits,
    )
    if not chosen.fits:
        plan.advice = _advice(config, cluster, chosen, world, usable, mat)
    return plan


def _describe(config: RunConfig, vocab: int) -> dict:
    return {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "kv_channels": config.kv_channels,
        "num_query_groups": config.num_query_groups,
        "ffn_hidden_size": config.ffn_hidden_size,
        "swiglu": config.swiglu,
        "normalization": config.normalization,
        "position_embedding_type": config.position_embedding_type,
        "tied_embeddings": not config.untie_embeddings_and_output_weights,
        "bias_linear": config.add_bias_linear,
        "attention": config.attention,
        "seq_length": config.seq_length,
        "micro_batch_size": config.micro_batch_size,
        "global_batch_size": config.global_batch_size,
        "train_iters": config.train_iters,
        "precision": "bf16" if config.bf16 else "fp16" if config.fp16 else "fp32",
        "zero_stage": config.zero_stage,
        "tensor_model_parallel_size": config.tensor_model_parallel_size,
        "sequence_parallel": config.sequence_parallel,
        "padded_vocab_size": vocab,
    }


def _throughput(config: RunConfig, cluster: Cluster, per_token: float, world: int) -> dict:
    tokens = (
        cluster.train_tokens or config.train_iters * config.global_batch_size * config.seq_length
    )
    peak = peak_flops(cluster)
    out = {
        "train_tokens": tokens,
        "train_flops": tokens * per_token,
        "tokens_per_iteration": config.global_batch_size * config.seq_length,
        "assumed_mfu": cluster.assumed_mfu,
    }
    if peak:
        rate = cluster.assumed_mfu * peak * world / per_token  # tokens/s at the assumed MFU
        out["tokens_per_sec_at_assumed_mfu"] = rate
        out["days_at_assumed_mfu"] = tokens / rate / 86400
    if cluster.target_days:
        needed = tokens / (cluster.target_days * 86400)
        out["target_days"] = cluster.target_days
        out["tokens_per_sec_needed"] = needed
        out["tokens_per_sec_per_gpu_needed"] = needed / world
        out["tflops_per_gpu_needed"] = needed * per_token / world / 1e12
        if peak:
            out["mfu_needed"] = needed * per_token / world / peak
    return out


def _advice(
    config: RunConfig, cluster: Cluster, chosen: Memory, world: int, usable: float, mat: bool
) -> str:
    """What to change so that the run fits: one knob at a time, the closest alternatives first."""
    if chosen.note:
        head = chosen.note
    else:
        head = (
            f"needs {chosen.total / GB:.1f} GB per GPU (weights {chosen.weights / GB:.1f}, "
            f"gradients {chosen.gradients / GB:.1f}, optimizer {chosen.optimizer / GB:.1f}, "
            f"activations {chosen.activations / GB:.1f}) but {usable / GB:.1f} GB are usable "
            f"(--gpu-memory-gb {cluster.gpu_memory_gb:g} minus reserved)"
        )
    options = []
    tp, sp, stage, mbs = chosen.tp, chosen.sp, chosen.zero_stage, chosen.micro_batch
    for s in range(stage + 1, 4):
        if memory(config, world, tp, sp, s, mbs, usable, mat).fits:
            options.append(f"--zero-stage {s}")
            break
    if tp > 1 and not sp and memory(config, world, tp, True, stage, mbs, usable, mat).fits:
        options.append("--sequence-parallel")
    for t in tp_options(config, world, cluster.gpus_per_node):
        if t <= tp:
            continue
        stages = [st for st in dict.fromkeys((stage, 1, 2)) if st < 3]
        fit = next(
            (st for st in stages if memory(config, world, t, True, st, mbs, usable, mat).fits), None
        )
        if fit is not None:
            options.append(
                f"--tensor-model-parallel-size {t} --sequence-parallel"
                + (f" --zero-stage {fit}" if fit != stage else "")
            )
            break
    m = mbs // 2
    while m >= 1:
        if (
            config.global_batch_size % (m * (world // tp)) == 0
            and memory(config, world, tp, sp, stage, m, usable, mat).fits
        ):
            options.append(f"--micro-batch-size {m}")
            break
        m //= 2
    if not options:
        options.append("more GPUs (--nodes), a larger --gpu-memory-gb, or a smaller model")
    return f"does not fit: {head}. Fits with: " + "; or ".join(options)


# --- the table for people -------------------------------------------------------------------------


def _n(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def format_plan(plan: Plan) -> str:
    m, p, c, ch, th = plan.model, plan.parameters, plan.cluster, plan.chosen, plan.throughput
    heads = f"{m['num_attention_heads']} heads x {m['kv_channels']}"
    if m["num_query_groups"] != m["num_attention_heads"]:
        heads += f", {m['num_query_groups']} KV groups"
    lines = [
        f"model: {m['num_layers']} layers, hidden {m['hidden_size']}, {heads}, "
        f"FFN {m['ffn_hidden_size']} {'SwiGLU' if m['swiglu'] else 'GELU'}, {m['normalization']}, "
        f"{m['position_embedding_type']}, {'tied' if m['tied_embeddings'] else 'untied'} "
        f"embeddings, {'biases' if m['bias_linear'] else 'no biases'}, attention "
        f"{m['attention']}, vocab {p['vocab_size']} (padded {p['padded_vocab_size']})",
        f"parameters: total {_n(p['total'])} = embedding {_n(p['embedding'])} (word "
        f"{_n(p['word_embedding'])}, position {_n(p['position_embedding'])}) + output layer "
        f"{_n(p['output_layer'])} + non-embedding {_n(p['non_embedding'])} "
        f"({_n(p['per_layer'])} per "
        f"layer" + (f", router {_n(p['router_per_layer'])}" if p["router_per_layer"] else "") + ")",
        f"FLOPs per token (training, forward + backward): {plan.flops_per_token / 1e9:.2f} GFLOP",
        f"cluster: {c['nodes']} node(s) x {c['gpus_per_node']} GPUs = {c['gpus']} GPUs, "
        f"{c['gpu_memory_gb']:g} GB each, {c['usable_gb']:.1f} GB usable "
        f"({c['reserved_gb']:.1f} GB reserved)",
        "",
        f"memory per GPU (GB), micro-batch {m['micro_batch_size']} x {m['seq_length']} tokens, "
        f"{m['precision']}; total for ZeRO stage 0..3 ('!' = does not fit, '-' = not possible):",
        "  TP  SP   DP accum  params/GPU  activations |   ZeRO-0   ZeRO-1   ZeRO-2   ZeRO-3",
    ]
    rows = {}
    for g in plan.grid:
        rows.setdefault((g["tp"], g["sp"]), []).append(g)
    for (tp, sp), cells in rows.items():
        first = cells[0]
        totals = []
        for g in cells:
            if g["note"]:
                totals.append(f"{'-':>8}")
            else:
                totals.append(f"{g['total_gb']:7.1f}{' ' if g['fits'] else '!'}")
        chosen_row = tp == ch["tp"] and sp == ch["sp"]
        accum = str(first["accumulation"]) if first["accumulation"] else "-"
        lines.append(
            f"{'*' if chosen_row else ' '}{tp:3d}  {'on ' if sp else 'off'} "
            f"{first['data_parallel']:4d}"
            f" {accum:>5}  {_n(first['params_per_gpu']):>10}  {first['activations_gb']:11.1f} | "
            + " ".join(totals)
        )
    lines += [
        "",
        f"chosen (*): TP {ch['tp']}{' + SP' if ch['sp'] else ''}, ZeRO-{ch['zero_stage']}, DP "
        f"{ch['data_parallel']}, micro-batch {ch['micro_batch']} x {ch['accumulation'] or '?'} "
        f"accumulation steps: weights {ch['weights_gb']:.2f} + gradients {ch['gradients_gb']:.2f} "
        f"+ optimizer {ch['optimizer_gb']:.2f} + activations {ch['activations_gb']:.2f} = "
        f"{ch['total_gb']:.2f} GB of {ch['usable_gb']:.1f} usable: "
        + ("fits" if plan.fits else "DOES NOT FIT"),
        "",
        f"training: {_n(th['train_tokens'])} tokens "
        f"({_n(th['tokens_per_iteration'])} per iteration), "
        f"{th['train_flops']:.3g} FLOPs",
    ]
    if "days_at_assumed_mfu" not in th:
        lines.append(
            f"  (no dense bf16 peak known for --gpu {c['gpu']}: give --peak-tflops for "
            "the time and MFU)"
        )
    else:
        lines.append(
            f"  at {th['assumed_mfu']:.0%} MFU on {c['gpu']} ({c['peak_tflops']:g} TFLOP/s "
            f"peak): {_n(th['tokens_per_sec_at_assumed_mfu'])} tokens/s, "
            f"{th['days_at_assumed_mfu']:.2f} days"
        )
    if "target_days" in th:
        line = (
            f"  to finish in {th['target_days']:g} days: {_n(th['tokens_per_sec_needed'])} "
            f"tokens/s ({_n(th['tokens_per_sec_per_gpu_needed'])} per GPU, "
            f"{th['tflops_per_gpu_needed']:.0f} TFLOP/s per GPU)"
        )
        if "mfu_needed" in th:
            line += f" = {th['mfu_needed']:.1%} MFU"
            if th["mfu_needed"] > 1:
                line += "  -- impossible: use more GPUs or allow more days"
            elif th["mfu_needed"] > 0.55:
                line += "  -- above what dense training usually reaches (~40-55%)"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    import sys

    try:
        config, cluster = parse_plan_args(argv)
        plan = make_plan(config, cluster)
    except (PlanError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if cluster.json_path:
        with open(cluster.json_path, "w") as f:
            f.write(plan.to_json())
    if not plan.fits:
        print(f"error: {plan.advice}", file=sys.stderr)
        return 1
    return 0
