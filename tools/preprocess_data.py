"""Tokenize jsonl / jsonl.gz / parquet documents into Megatron .bin/.idx (Megatron-LM's flags).

    python tools/preprocess_data.py --input 'data/*.parquet' --output-prefix data/fineweb \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod \
        --workers 8

writes data/fineweb_text_document.{bin,idx}; pass data/fineweb_text_document as --data-path.
Every flag of Megatron-LM's tools/preprocess_data.py is known: done as there, or said (below) to
have no effect here, or refused by name before any work.
"""

from megatron_focus import cli
from megatron_focus.config import compat
from megatron_focus.data.choices import TOKENIZER_TYPES


def build_parser() -> cli.Parser:
    parser = cli.Parser(description=__doc__)
    parser.add_corpus_args(", read in sorted order", "<prefix>_<key>_document.bin/.idx", "tokenize")
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
    parser.add_argument(
        "--split-sentences",
        action="store_true",
        help="split each document into sentences with NLTK's punkt (--lang), each sentence a "
        "sequence of its document, into <prefix>_<key>_sentence.bin/.idx, as Megatron-LM; in one "
        "run (Megatron-LM's first run only writes the split text). Needs NLTK (pip install nltk): "
        "refused without it",
    )
    parser.add_argument(
        "--keep-newlines",
        action="store_true",
        help="with --split-sentences: a sentence keeps the whitespace and newlines that follow "
        "it, as Megatron-LM. Without --split-sentences it changes nothing, as in Megatron-LM: "
        "a whole document keeps its newlines",
    )
    parser.add_argument("--lang", default="english", help="punkt's language, for --split-sentences")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenizer processes (all of them, however many --partitions)",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="the documents in the order Megatron-LM's --partitions N writes them: document k "
        "(over all inputs) to partition k mod N, the partitions one after another; the output is "
        "byte for byte Megatron-LM's. No partition files are written next to the input",
    )
    parser.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="with --partitions: partitions of consecutive documents, so the input's order (the "
        "output of --partitions 1), as Megatron-LM; without --partitions, no change",
    )
    parser.add_argument(
        "--log-interval", type=int, default=1000, help="documents between progress updates"
    )
    compat.add_classified_args(parser, compat.PREPROCESS_SPEC, compat.classify_preprocessing)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    compat.refuse(args, compat.PREPROCESS_SPEC, compat.classify_preprocessing)
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
        partitions=args.partitions,
        keep_sequential_samples=args.keep_sequential_samples,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        lang=args.lang,
    )
    for prefix in stats.prefixes:
        print(f"wrote {prefix}.bin/.idx")
    print(
        f"{stats.docs} documents, {stats.tokens} tokens, {stats.empty_skipped} empty documents "
        "skipped"
    )


if __name__ == "__main__":
    cli.run(main)
