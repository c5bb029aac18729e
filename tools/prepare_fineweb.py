"""FineWeb parquet shards -> a tokenized Megatron dataset with a held-out validation split.

Download a FineWeb sample first (sample/10BT is tens of GB of parquet; sample/100BT is the XSA
paper's FineWeb-100BT):

    hf download HuggingFaceFW/fineweb --repo-type dataset \
        --include "sample/10BT/*" --local-dir fineweb

GPT-2's tokenizer (the XSA paper's; get its tokenizer.json with
`hf download openai-community/gpt2 tokenizer.json --local-dir gpt2`):

    python tools/prepare_fineweb.py --input 'fineweb/sample/10BT/*.parquet' \
        --output-prefix data/fineweb-gpt2 \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model gpt2/tokenizer.json --workers 16

or a SentencePiece tokenizer trained here on the training shards (as tools/train_tokenizer.py):

    python tools/prepare_fineweb.py --input 'fineweb/sample/10BT/*.parquet' \
        --output-prefix data/fineweb-sp32k --train-tokenizer --vocab-size 32000 --workers 16

Validation. The last `--valid-shards` shards (default 1, in sorted order) are held out: no
tokenizer is trained on them, and they are written last into the one dataset, so their documents
form one contiguous block at its end. Megatron's `--split` cuts a dataset into train/valid/test by
document position, so the split "TRAIN_DOCS,VALID_DOCS,0" (document counts as weights) makes the
validation split exactly the held-out shards and the test split empty. The tool prints it and
writes it to `<prefix>_text_document.split`, where examples/pretrain.sh picks it up.

Writes:
    <prefix>_text_document.{bin,idx}          train shards, then the held-out shards: --data-path
    <prefix>_text_document.split              the --split that makes the held-out shards validation
    <prefix>_text_document.json               shards, document and token counts, the split
    <prefix>-valid_text_document.{bin,idx}    the held-out shards alone (for evaluation tools)
    <prefix>-tokenizer.model                  with --train-tokenizer

Tokenization is tools/preprocess_data.py's (`megatron_focus.data.preprocess`, EOD appended to
every document, empty documents skipped and counted); tokenizer training is
tools/train_tokenizer.py's.
"""

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_focus import cli  # noqa: E402
from megatron_focus.data.choices import TOKENIZER_TYPES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.Parser(description=__doc__)
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="parquet shards (files or globs), e.g. 'fineweb/sample/10BT/*.parquet'",
    )
    p.add_argument("--output-prefix", required=True, help="e.g. data/fineweb-gpt2")
    p.add_argument(
        "--valid-shards",
        type=int,
        default=1,
        help="hold out this many of the last shards (sorted) as validation (default 1)",
    )
    p.add_argument("--json-keys", nargs="+", default=["text"], help="column to tokenize")
    tok = p.add_argument_group("tokenizer: an existing one, or --train-tokenizer")
    tok.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    tok.add_argument(
        "--tokenizer-model",
        default=None,
        help="HF tokenizer.json (or its folder) or SentencePiece .model",
    )
    tok.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="train a SentencePiece tokenizer on the training shards first",
    )
    tok.add_argument("--vocab-size", type=int, default=32000, help="with --train-tokenizer")
    tok.add_argument(
        "--tokenizer-sentences",
        type=int,
        default=2_000_000,
        help="with --train-tokenizer: lines sampled to train on (0 = all)",
    )
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--log-interval", type=int, default=10000)
    args = p.parse_args(argv)
    if len(args.json_keys) != 1:
        p.error("--json-keys: give one column (the dataset gets one document per row)")
    if args.train_tokenizer == bool(args.tokenizer_model):
        p.error("give --tokenizer-model (with --tokenizer-type) or --train-tokenizer, not both")
    if args.tokenizer_model and not args.tokenizer_type:
        p.error(
            "--tokenizer-model needs --tokenizer-type (HuggingFaceTokenizer for a tokenizer.json)"
        )
    return args


def split_shards(patterns, valid_shards: int):
    """(train shards, held-out shards): sorted, de-duplicated, the last `valid_shards` held out."""
    shards = sorted({path for pattern in patterns for path in glob.glob(str(pattern))})
    missing = [pattern for pattern in patterns if not glob.glob(str(pattern))]
    if missing:
        raise FileNotFoundError(f"--input {' '.join(missing)}: no such file")
    if valid_shards < 0:
        raise ValueError("--valid-shards must be >= 0")
    if valid_shards >= len(shards):
        raise ValueError(
            f"{len(shards)} shard(s) cannot hold out --valid-shards {valid_shards} and "
            "keep any for training: give more shards (FineWeb's are ~2 GB each)"
        )
    if valid_shards == 0:
        return shards, []
    return shards[:-valid_shards], shards[-valid_shards:]


def prepare(args: argparse.Namespace) -> dict:
    from megatron_focus.data.preprocess import preprocess
    from megatron_focus.data.sentencepiece_trainer import train_sentencepiece

    train_shards, valid_shards = split_shards(args.input, args.valid_shards)
    key = args.json_keys[0]
    if args.train_tokenizer:
        args.tokenizer_type = "GPTSentencePieceTokenizer"
        print(
            f"training a {args.vocab_size}-piece SentencePiece tokenizer on "
            f"{len(train_shards)} training shard(s)",
            flush=True,
        )
        args.tokenizer_model = train_sentencepiece(
            train_shards,
            f"{args.output_prefix}-tokenizer",
            vocab_size=args.vocab_size,
            json_keys=[key],
            max_sentences=args.tokenizer_sentences,
        )

    common = dict(
        append_eod=True, json_keys=[key], workers=args.workers, log_interval=args.log_interval
    )
    valid_docs, valid_tokens, valid_prefix = 0, 0, None
    if valid_shards:
        stats = preprocess(
            valid_shards,
            f"{args.output_prefix}-valid",
            args.tokenizer_type,
            args.tokenizer_model,
            **common,
        )
        valid_docs, valid_tokens, valid_prefix = stats.docs, stats.tokens, stats.prefixes[0]
    # One dataset, held-out shards last: `--split` then cuts exactly at their first document.
    stats = preprocess(
        train_shards + valid_shards,
        args.output_prefix,
        args.tokenizer_type,
        args.tokenizer_model,
        **common,
    )
    prefix = stats.prefixes[0]
    train_docs = stats.docs - valid_docs
    split = f"{train_docs},{valid_docs},0" if valid_shards else "969,30,1"
    manifest = {
        "data_path": prefix,
        "split": split,
        "tokenizer_type": args.tokenizer_type,
        "tokenizer_model": os.path.abspath(args.tokenizer_model),
        "train_shards": train_shards,
        "valid_shards": valid_shards,
        "train_documents": train_docs,
        "valid_documents": valid_docs,
        "train_tokens": stats.tokens - valid_tokens,
        "valid_tokens": valid_tokens,
        "empty_documents_skipped": stats.empty_skipped,
        "valid_data_path": valid_prefix,
    }
    with open(f"{prefix}.split", "w") as f:
        f.write(split + "\n")
    with open(f"{prefix}.json", "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main(argv=None) -> None:
    manifest = prepare(parse_args(argv))
    print(
        f"wrote {manifest['data_path']}.bin/.idx: {manifest['train_documents']} training documents "
        f"({manifest['train_tokens']} tokens) then {manifest['valid_documents']} held-out "
        f"({manifest['valid_tokens']} tokens)"
    )
    if manifest["valid_shards"]:
        print(f"held out: {' '.join(manifest['valid_shards'])}")
    print(
        "train with:\n"
        f"  --data-path {manifest['data_path']} --split {manifest['split']} \\\n"
        f"  --tokenizer-type {manifest['tokenizer_type']} --tokenizer-model "
        f"{manifest['tokenizer_model']}"
    )


if __name__ == "__main__":
    cli.run(main)
