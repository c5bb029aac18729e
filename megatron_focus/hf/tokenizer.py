"""Tokenizers across the two formats.

Export writes the checkpoint's tokenizer as an HF fast tokenizer (`tokenizer.json`, loadable with
`AutoTokenizer`): an HF `tokenizer.json` as it is, a SentencePiece `.model` converted by
transformers' SentencePiece converter (offline) and also copied as `tokenizer.model`. The result
must encode probe texts exactly as the training tokenizer did, or the export stops. Import finds
the HF folder's tokenizer file and keeps a copy with the native checkpoint.
"""

import copy
import json
import os
import shutil
from typing import Optional, Tuple

SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# Texts that exercise what tokenizers disagree on: leading and repeated spaces, newlines and tabs,
# digits, bytes outside the vocabulary (byte fallback), end-of-text.
PROBES = (
    "Hello world",
    " leading space",
    "two  spaces and   three",
    "line one\nline two\n\n\tindent",
    "numbers 12345 and 3.14159",
    "x1y22z333",
    "unicode: naïve café, 中文, emoji 😀",
    "trailing ",
    "def f(x):\n    return x ** 2  # square",
)


def _sentencepiece_to_fast(model_path: str):
    """A `tokenizers.Tokenizer` that follows the SentencePiece model's own normalizer settings."""
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
        raise ValueError(
            f"converting the SentencePiece model {model_path} to an HF tokenizer "
            "needs transformers 5 (4.x's converter encodes differently); export "
            "under transformers 5: the folder loads under 4.57+ as well"
        )
    proto = import_protobuf().ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    # legacy=True: the dummy prefix "▁" is added even when the text starts with a space, as
    # SentencePiece does.
    return SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)


def save_hf_tokenizer(tokenizer, out_dir: str, max_length: int) -> dict:
    """Write `tokenizer` (megatron_focus.data.tokenizer) to `out_dir`; returns its special ids.

    `max_length`: the model's positions, so that `truncation=True` cuts prompts to what the model
    can read. A tokenizer without a bos token of its own begins sequences with its end-of-document
    token, as GPT-2's does: that token is what precedes every document the model was trained on.
    A chat template of the imported tokenizer's config is kept. One that opens every text with its
    bos token (Llama2Tokenizer) does so in HF too (with `add_special_tokens`, the default).
    """
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from megatron_focus.data.tokenizer import HuggingFaceTokenizer

    is_sentencepiece = not isinstance(tokenizer, HuggingFaceTokenizer)
    fast = (
        _sentencepiece_to_fast(tokenizer.path)
        if is_sentencepiece
        else copy.deepcopy(tokenizer.backend)
    )
    if tokenizer.adds_bos:
        bos_piece = fast.id_to_token(tokenizer.bos)
        fast.post_processor = TemplateProcessing(
            single=f"{bos_piece} $A", special_tokens=[(bos_piece, tokenizer.bos)]
        )
    for text in PROBES:
        ours = tokenizer.tokenize(text)
        theirs = fast.encode(text, add_special_tokens=tokenizer.adds_bos).ids
        if ours != theirs:
            raise ValueError(
                f"the HF tokenizer made from {tokenizer.path} encodes {text!r} as "
                f"{theirs}, the training tokenizer as {ours}: not exported"
            )
    bos = tokenizer.bos if tokenizer.bos is not None else tokenizer.eod
    ids = dict(zip(SPECIAL_TOKEN_IDS, (bos, tokenizer.eod, tokenizer.pad)))
    specials = {f"{name[:-3]}": fast.id_to_token(i) for name, i in ids.items()}
    extra = {}
    if is_sentencepiece:
        import sentencepiece

        model = sentencepiece.SentencePieceProcessor(model_file=tokenizer.path)
        specials["unk_token"] = fast.id_to_token(model.unk_id())
        shutil.copyfile(tokenizer.path, os.path.join(out_dir, "tokenizer.model"))
    elif tokenizer.config_path is not None:
        with open(tokenizer.config_path) as f:
            template = json.load(f).get("chat_template")
        if template is not None:
            extra["chat_template"] = template
    PreTrainedTokenizerFast(
        tokenizer_object=fast,
        model_max_length=max_length,
        # not 4.x's default, which adds token_type_ids: GPT-2 would add their embeddings, and
        # generate() refuses them
        model_input_names=["input_ids", "attention_mask"],
        **specials,
        **extra,
    ).save_pretrained(out_dir)
    _name_portable_class(os.path.join(out_dir, "tokenizer_config.json"))
    return ids


def mismatch_as_loaded(tokenizer, folder: str, config) -> Optional[str]:
    """How the tokenizer that `AutoTokenizer` loads from `folder` (beside a model of `config`)
    encodes a probe otherwise than `tokenizer` did in training; None if it encodes them all alike.

    transformers 5 ignores the folder's tokenizer class for some model types (Qwen2's: its own
    `Qwen2Tokenizer`, whose pre-tokenizer is Qwen's whatever the vocabulary).
    """
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(folder, config=config)
    for text in PROBES:
        ours, theirs = tokenizer.tokenize(text), loaded(text)["input_ids"]
        if ours != theirs:
            return (
                f"AutoTokenizer loads {type(loaded).__name__}, which encodes {text!r} as "
                f"{theirs}, the training tokenizer as {ours}"
            )
    return None


def _name_portable_class(config_path: str) -> None:
    """transformers 5 names its fast tokenizer class `TokenizersBackend`, which 4.x lacks;
    `PreTrainedTokenizerFast`, the same class to 5.x, loads on both."""
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def find_hf_tokenizer(hf_dir: str) -> Tuple[Optional[str], Optional[str]]:
    """`(tokenizer_type, path)` of an HF folder's tokenizer, or `(None, None)` if it has none."""
    for name, kind in (
        ("tokenizer.json", "HuggingFaceTokenizer"),
        ("tokenizer.model", "SentencePieceTokenizer"),
    ):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            return kind, path
    return None, None
