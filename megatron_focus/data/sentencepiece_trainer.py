"""Train a SentencePiece model on the same inputs the preprocessor reads.

The options make a tokenizer that round-trips text exactly (identity normalization, spaces
kept, unknown characters as bytes) and defines the ids GPT pretraining needs: eos is the
end-of-document token, and pad is its own id so Megatron never confuses padding with EOD.
"""

import os
from typing import Iterator, Sequence

import sentencepiece

from megatron_focus.data.readers import expand_inputs, iter_records

MODEL_TYPES = ("bpe", "unigram")


def _sentences(paths: Sequence[str], keys: Sequence[str]) -> Iterator[str]:
    # SentencePiece drops "sentences" over max_sentence_length bytes, so feed lines, not documents.
    # Newlines themselves are then encoded through byte fallback (<0x0A>), as in Llama's tokenizer.
    for texts in iter_records(paths, keys):
        for text in texts:
            for line in text.splitlines():
                if line.strip():
                    yield line


def train_sentencepiece(
    inputs: Sequence[str],
    output_prefix: str,
    *,
    vocab_size: int,
    model_type: str = "bpe",
    json_keys: Sequence[str] = ("text",),
    max_sentences: int = 0,
    seed: int = 1234,
    quiet: bool = False,
) -> str:
    """Train on `inputs` (paths or globs); returns the path of `<output_prefix>.model`.

    `max_sentences` > 0 trains on that many lines sampled uniformly (SentencePiece's
    input_sentence_size), bounding memory on large corpora; 0 uses every line.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"--model-type {model_type!r}: expected one of {', '.join(MODEL_TYPES)}")
    if vocab_size < 300:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small: 256 byte pieces plus 4 specials come first"
        )
    paths = expand_inputs(inputs, json_keys)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    sentencepiece.set_random_generator_seed(seed)  # sampling and shuffling repeat run to run
    try:
        _train(paths, json_keys, output_prefix, vocab_size, model_type, max_sentences, quiet)
    except RuntimeError as e:  # SentencePiece's C++ checks, e.g. "Vocabulary size is smaller
        detail = str(e).rsplit("] ", 1)[-1]  # than required_chars. 300 vs 346. ..."
        flag = f"--vocab-size {vocab_size}: " if "vocab" in detail.lower() else ""
        raise ValueError(
            f"{flag}SentencePiece cannot train on {', '.join(paths)}: {detail}"
        ) from None
    return f"{output_prefix}.model"


def _train(paths, json_keys, output_prefix, vocab_size, model_type, max_sentences, quiet):
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_sentences(paths, json_keys),
        model_prefix=output_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        character_coverage=0.9995,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        num_threads=os.cpu_count() or 1,
        minloglevel=2 if quiet else 0,
    )
