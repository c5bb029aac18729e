"""Tokenize jsonl / jsonl.gz / parquet documents into Megatron .bin/.idx (Megatron-LM's flags).

    python tools/preprocess_data.py --input 'data/*.parquet' --output-prefix data/fineweb \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod \
        --workers 8

writes data/fineweb_text_document.{bin,idx}; pass data/fineweb_text_document as --data-path.
"""

from megatron_focus import cli
from megatron_focus.choices import TOKENIZER_TYPES


def main() -> None:
    parser = cli.Parser(description=__doc__)
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files or globs: .jsonl, .jsonl.gz, .parquet, .txt",
    )
    parser.add_argument(
        "--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx"
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="fields (parquet columns) to tokenize"
    )
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument(
        "--tokenizer-model", help="SentencePiece .model, or HF tokenizer.json / its folder"
    )
    parser.add_argument("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json")
    parser.add_argument("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt")
    parser.add_argument(
        "--vocab-size", type=int, help="NullTokenizer: ids before the end-of-document id"
    )
    parser.add_argument(
        "--append-eod",
        action="store_true",
        help="end each document with EOD (as Megatron-LM: off unless given; GPT pretraining "
        "wants it)",
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument(
        "--log-interval", type=int, default=1000, help="documents between progress updates"
    )
    args = parser.parse_args()
    from megatron_focus.data.preprocess import preprocess  # after parsing: --help stays fast

    stats = preprocess(
        args.input,
        args.output_prefix,
        args.tokenizer_type,
        args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        append_eod=args.append_eod,
        json_keys=args.json_keys,
        workers=args.workers,
        log_interval=args.log_interval,
    )
    for prefix in stats.prefixes:
        print(f"wrote {prefix}.bin/.idx")
    print(
        f"{stats.docs} documents, {stats.tokens} tokens, {stats.empty_skipped} empty documents "
        "skipped"
    )


if __name__ == "__main__":
    cli.run(main)
