"""What a run reads, from its flags: the tokenizer and the train / validation datasets (the
embedded corpus, Megatron datasets, mock data or MQAR). Shared by the trainer and
tools/eval_ppl.py, so an evaluation reads exactly the samples training validated on."""

import argparse
import os

import torch.distributed as dist

from megatron_focus.data import reads_data_files
from megatron_focus.data.datasets import build_datasets
from megatron_focus.data.embedded import DEFAULT_CACHE, embedded_paths, ensure_embedded_data
from megatron_focus.data.embedded import TOKENIZER_TYPE as EMBEDDED_TOKENIZER_TYPE
from megatron_focus.data.mqar import MQARDataset, MQARVocabulary
from megatron_focus.data.tokenizer import build_tokenizer, tokenizer_flags


def _embedded(args: argparse.Namespace) -> bool:
    """The zero-download default: no data files, mock data or MQAR named."""
    return not reads_data_files(args) and not args.mock_data and not args.mqar


def data_prefixes(args: argparse.Namespace) -> list:
    """`--data-path`, or the embedded corpus's."""
    if _embedded(args):
        return [embedded_paths(args.data_cache_path or DEFAULT_CACHE)[0]]
    return args.data_path


def tokenizer_choice(args: argparse.Namespace) -> tuple:
    """`(tokenizer_type, build_tokenizer's files and sizes)`: the flags', or the embedded
    corpus's SentencePiece model."""
    if _embedded(args):
        model_file = embedded_paths(args.data_cache_path or DEFAULT_CACHE)[1]
        return EMBEDDED_TOKENIZER_TYPE, {**tokenizer_flags(args), "tokenizer_model": model_file}
    return args.tokenizer_type, tokenizer_flags(args)


def tokenizer_for(args: argparse.Namespace, rank0: bool):
    if args.mqar:
        return MQARVocabulary(args.mqar_vocab_size)
    if _embedded(args):  # rank 0 builds the cache, the others wait and reuse it
        if rank0:
            ensure_embedded_data(args.data_cache_path or DEFAULT_CACHE)
        dist.barrier()
    tokenizer_type, flags = tokenizer_choice(args)
    return build_tokenizer(tokenizer_type, **flags)


def datasets_for(args: argparse.Namespace, tokenizer):
    # as many training samples as Megatron-LM builds: --train-samples, or whole batches
    train_samples = args.train_samples or args.train_iters * args.global_batch_size
    valid_samples = args.eval_iters * args.global_batch_size if args.eval_iters else 0
    if args.mqar:

        def mqar(samples, split):
            return MQARDataset(
                samples,
                args.seq_length,
                args.mqar_pairs,
                args.mqar_vocab_size,
                args.mqar_min_distance,
                args.seed,
                split,
                args.mqar_queries,
                args.mqar_packed,
            )

        return (
            mqar(train_samples, "train"),
            mqar(valid_samples, "valid") if valid_samples else None,
        )
    cache = os.path.join(args.data_cache_path or DEFAULT_CACHE, "indices")
    per_split = (
        [args.train_data_path, args.valid_data_path, args.test_data_path]
        if args.train_data_path
        else None
    )
    train, valid, _ = build_datasets(
        None if args.mock_data or per_split else data_prefixes(args),
        args.split,
        args.seq_length,
        args.seed,
        tokenizer,
        (train_samples, valid_samples, 0),
        cache,
        reset_position_ids=args.reset_position_ids,
        eod_mask_loss=args.eod_mask_loss,
        reset_attention_mask=args.reset_attention_mask,
        per_split=per_split,
    )
    return train, valid if valid_samples else None
