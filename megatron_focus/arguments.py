"""Command-line flags, named and defaulted as in Megatron-LM's `pretrain_gpt.py`.

A Megatron-LM user's launch script carries over: the same flag means the same thing. What this
project adds is grouped under "megatron-focus". `validate_args` refuses bad combinations before
anything is built, with a message that says which flag to change.
"""

import argparse
import os
from typing import List, Optional

ATTENTION_VARIANTS = ("standard", "xsa", "focus", "focus+xsa")
IMPLEMENTED_ATTENTION = ("standard",)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4 x hidden, or the SwiGLU-equivalent 8/3 x hidden rounded to 64")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--kv-channels", type=int, default=None, help="head dim; default hidden/heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="size of the learned position table; default --seq-length")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--attention", choices=ATTENTION_VARIANTS, default="standard",
                   help="core attention variant (megatron-focus)")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with a GPU, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="megatron-focus: GPT pretraining with Focus and XSA attention",
        allow_abbrev=False,
    )
    _add_model_args(p)
    _add_parallel_args(p)
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    validate_args(args)
    return args


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None) -> None:
    """Fill derived defaults and refuse what cannot run, before any model is built."""
    if world_size is None:  # as a launcher (torchrun, deepspeed) tells it
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tp = args.tensor_model_parallel_size
    if args.attention not in IMPLEMENTED_ATTENTION:
        raise ValueError(
            f"--attention {args.attention} is not implemented yet; available: "
            f"{', '.join(IMPLEMENTED_ATTENTION)}"
        )
    if args.hidden_size % args.num_attention_heads and args.kv_channels is None:
        raise ValueError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}; set --kv-channels explicitly"
        )
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.num_attention_heads % tp:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} does not divide "
            f"--num-attention-heads {args.num_attention_heads}"
        )
    if args.num_query_groups % tp and tp % args.num_query_groups:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} must be a multiple or a divisor of "
            f"--tensor-model-parallel-size {tp}"
        )
    if args.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.sequence_parallel and args.seq_length % tp:
        raise ValueError(
            f"--sequence-parallel splits --seq-length {args.seq_length} over "
            f"{tp} tensor-parallel ranks: it must be divisible"
        )
    if world_size % tp:
        raise ValueError(f"world size {world_size} is not divisible by TP size {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if (args.position_embedding_type == "learned_absolute"
            and args.seq_length > args.max_position_embeddings):
        raise ValueError(
            f"--seq-length {args.seq_length} is longer than the learned position table "
            f"(--max-position-embeddings {args.max_position_embeddings})"
        )
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Megatron-LM's rule: keep the MLP's parameter count that of a 4h GELU MLP.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
