"""Megatron-LM's `args` as Megatron-LM (core_v0.16.1) pickles them into a checkpoint, built
without this trainer's names: its own parser (megatron_lm_flags.txt: every action with its
destination and default) and what its `validate_args` and tokenizer derive, each written once
below with where it comes from."""

import argparse
import math

import torch

from megatron_focus.config import compat

# Model flags of Megatron-LM's own launch scripts, shrunk (the sizes; the rest as shipped, but
# for their precision: the CPU computes in fp32).
# examples/gpt3/train_gpt3_175b_distributed.sh: GPT-3's defaults (LayerNorm, GELU, biases,
# learned positions, tied output, no GQA).
GPT3 = [
    "--num-layers", "2",
    "--hidden-size", "64",
    "--num-attention-heads", "4",
    "--seq-length", "32",
    "--max-position-embeddings", "32",
    "--init-method-std", "0.006",
]  # fmt: skip
# examples/llama/train_llama3_8b_h100_fp8.sh (its default LayerNorm, zero-centred).
LLAMA3_8B = [
    "--num-layers", "2",
    "--hidden-size", "64",
    "--ffn-hidden-size", "224",
    "--num-attention-heads", "4",
    "--group-query-attention",
    "--num-query-groups", "2",
    "--kv-channels", "16",
    "--seq-length", "32",
    "--max-position-embeddings", "32",
    "--position-embedding-type", "rope",
    "--rotary-base", "1000000",
    "--rotary-percent", "1.0",
    "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0",
    "--swiglu",
    "--init-method-std", "0.0134",
    "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
]  # fmt: skip
# The same with RMSNorm and another epsilon (Llama's own norm, as its HF conversions set it).
LLAMA3_RMSNORM = LLAMA3_8B + ["--normalization", "RMSNorm", "--norm-epsilon", "0.01"]
SCRIPTS = {"gpt3": GPT3, "llama3-8b": LLAMA3_8B, "llama3-rmsnorm": LLAMA3_RMSNORM}

# Megatron-LM's check_checkpoint_args (training/checkpointing.py): what a continued run compares
# with the checkpoint's record (a torch_dist one, with --vocab-file or --tokenizer-model given).
CHECKED_ON_LOAD = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "add_position_embedding",
    "max_position_embeddings",
    "make_vocab_size_divisible_by",
    "tokenizer_type",
)
# Megatron-LM's load_args_from_checkpoint (--use-checkpoint-args): the model fields it takes,
# and the TransformerConfig names core_v0.16 records the norm under.
TAKEN_BY_USE_CHECKPOINT_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "seq_length",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "max_position_embeddings",
    "position_embedding_type",
    "add_position_embedding",
    "use_rotary_position_embeddings",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "add_bias_linear",
    "add_qkv_bias",
    "squared_relu",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "normalization",
    "apply_query_key_layer_scaling",
    "attention_dropout",
    "hidden_dropout",
    "padded_vocab_size",
    "layernorm_epsilon",
    "layernorm_zero_centered_gamma",
)


def parser() -> argparse.ArgumentParser:
    """Megatron-LM's pretrain_gpt.py parser, from its recorded actions."""
    p = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    for flags, keywords in compat.megatron_lm_actions():
        p.add_argument(*flags, **compat.argparse_keywords(keywords))
    return p


def record(argv: list, vocab_size: int) -> argparse.Namespace:
    """The args Megatron-LM saves for `argv`, its tokenizer holding `vocab_size` ids."""
    args = parser().parse_args(argv)
    # validate_args
    args.encoder_num_layers = args.num_layers
    args.encoder_seq_length = args.seq_length
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (
            int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu else 4 * args.hidden_size
        )
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float
    if args.add_bias_linear:
        args.add_qkv_bias = True
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    # build_tokenizer: _vocab_size_with_padding
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = int(math.ceil(vocab_size / multiple) * multiple)
    return args


def transformer_config(args: argparse.Namespace):
    """Megatron-LM's core_transformer_config_from_args: every TransformerConfig field the args
    name, then its translations; on the CPU its CUDA fusions off, and the norm's zero-centred
    scale left to the caller (Megatron-Core's local norm refuses it: fold 1 into the weights)."""
    import dataclasses

    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    text = {  # types that are Megatron-LM's own functions: text here, left at the default
        keywords.get("dest", flags[0][2:].replace("-", "_"))
        for flags, keywords in compat.megatron_lm_actions()
        if keywords.get("type", "str") not in compat.TYPES
    }
    # MoE knobs stay at TransformerConfig's defaults: the model is dense (a record with experts
    # is refused on load), and newer releases refuse the 0.16 parser's MoE dispatch defaults.
    kw = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TransformerConfig)
        if hasattr(args, f.name) and f.init and f.name not in text and not f.name.startswith("moe_")
    }
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    kw["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    kw.update(
        layernorm_zero_centered_gamma=False,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        fp16=False,
        bf16=False,
        params_dtype=torch.float,
        pipeline_dtype=torch.float,
    )
    return TransformerConfig(**kw)


def gpt_model(args: argparse.Namespace):
    """pretrain_gpt.py's model_provider for `args` (Megatron-Core's local layer spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=transformer_config(args),
        transformer_layer_spec=get_gpt_layer_local_spec(
            normalization=args.normalization, qk_layernorm=args.qk_layernorm
        ),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
    )


def save(model, folder: str, args: argparse.Namespace, iteration: int = 7) -> None:
    """Collective: as Megatron-LM's `save_checkpoint` writes a torch_dist checkpoint of `model`
    with the record `args` (no optimizer: its state is not read here)."""
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    tag_dir = os.path.join(folder, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(tag_dir)
    dist.barrier()
    state = {
        "model": model.sharded_state_dict(),
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
    }
    dist_checkpointing.save(state, tag_dir)
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()
