"""Train a SentencePiece tokenizer on jsonl / jsonl.gz / parquet / txt documents.

    python tools/train_tokenizer.py --input 'data/*.parquet' --vocab-size 32000 --output-prefix tok

writes tok.model (use with --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model).
"""

from megatron_focus import cli
from megatron_focus.data.sentencepiece_trainer import MODEL_TYPES, train_sentencepiece


def main() -> None:
    parser = cli.Parser(description=__doc__)
    parser.add_corpus_args("", "<prefix>.model and <prefix>.vocab", "train on")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    parser.add_argument(
        "--max-sentences",
        type=int,
        default=0,
        help="train on this many lines sampled uniformly (0: all); bounds memory on big corpora",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="print SentencePiece's own training log (some 300 lines; errors show without it)",
    )
    args = parser.parse_args()
    print(
        f"training a {args.vocab_size}-piece {args.model_type} SentencePiece tokenizer on "
        f"{' '.join(args.input)}",
        flush=True,
    )

    model = train_sentencepiece(
        args.input,
        args.output_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        json_keys=args.json_keys,
        max_sentences=args.max_sentences,
        seed=args.seed,
        quiet=not args.verbose,
    )
    print(f"wrote {model}")


if __name__ == "__main__":
    cli.run(main)
