"""The zero-download default dataset: stdlib docstrings, a SentencePiece tokenizer trained on
them, and the tokenized `.bin/.idx`, built once per cache directory in a few seconds.

The build happens in a private temporary directory that is renamed into place as a whole, so a
crashed or concurrent build never leaves a half-built cache that looks valid.
"""

import os
import shutil
import tempfile

from megatron_focus.data.corpus import write_stdlib_corpus
from megatron_focus.data.preprocess import output_prefix_for, preprocess
from megatron_focus.data.sentencepiece_trainer import train_sentencepiece
from megatron_focus.outputs import honour_umask

NAME = "embedded-v1"  # bump when the recipe below changes, so old caches are not reused
VOCAB_SIZE = 4096  # ~3.5 chars/token on this corpus; small enough for a tiny model's embedding
TOKENIZER_TYPE = "GPTSentencePieceTokenizer"
# Where runs given no --data-cache-path keep it (and the dataset index caches).
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "megatron-focus")


def embedded_paths(cache_dir: str) -> tuple[str, str]:
    """`(data_prefix, tokenizer_model_path)` of the embedded data in `cache_dir`, built or not."""
    final = os.path.join(os.path.abspath(cache_dir), NAME)
    return (
        output_prefix_for(os.path.join(final, "stdlib"), "text"),
        os.path.join(final, "tokenizer.model"),
    )


def ensure_embedded_data(cache_dir: str) -> tuple[str, str]:
    """Returns `(data_prefix, tokenizer_model_path)`, building them on first use."""
    final = os.path.join(os.path.abspath(cache_dir), NAME)
    prefix, model = embedded_paths(cache_dir)
    if os.path.isdir(final):
        return prefix, model

    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{NAME}.tmp", dir=cache_dir)
    try:
        print(f"[embedded data] building {final} (one-time)")
        corpus = os.path.join(tmp, "stdlib.jsonl")
        docs = write_stdlib_corpus(corpus)
        print(
            f"[embedded data] {docs} stdlib docstrings; training a {VOCAB_SIZE}-piece "
            "SentencePiece BPE"
        )
        tmp_model = train_sentencepiece(
            [corpus], os.path.join(tmp, "tokenizer"), vocab_size=VOCAB_SIZE, quiet=True
        )
        stats = preprocess(
            [corpus], os.path.join(tmp, "stdlib"), TOKENIZER_TYPE, tmp_model, append_eod=True
        )
        print(f"[embedded data] {stats.docs} documents, {stats.tokens} tokens")
        honour_umask(tmp)  # mkdtemp makes it owner-only
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):  # not a lost race with another process: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return prefix, model
