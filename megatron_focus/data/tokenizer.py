"""Tokenizers for preprocessing and for GPTDataset.

Megatron-Core 0.16.1 types `GPTDatasetConfig.tokenizer` as `MegatronTokenizerBase` and reads
only `.vocab_size`, `.eod`, `.pad` and `.unique_identifiers` (which keys the dataset index
cache) from it. The classes below subclass that base and keep the legacy tokenizer interface
(`tokenize`, `detokenize`, `vocab`, `vocab_size`, `eod`, `eos`, `pad`) so that Megatron-LM-style
code works with them. They wrap the sentencepiece and HF `tokenizers` libraries directly,
because Megatron's own wrappers rewrite whitespace (sentencepiece) or need `transformers` (HF).
"""

import json
import os
from collections import OrderedDict
from typing import Optional

import sentencepiece
import tokenizers
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_focus.data.choices import TOKENIZER_TYPES
from megatron_focus.data.paths import check_tokenizer_files

# Without a `tokenizer_config.json` naming its eos token, tried in order: the first one in the
# vocabulary marks document ends.
HF_EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>")
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
GPT2_EOD = "<|endoftext|>"  # GPT2BPETokenizer's end of document, as Megatron-LM's


class _Tokenizer(MegatronTokenizerBase):
    """What the backends share: identity for the dataset cache, and no chat template.

    `adds_bos`: `tokenize` opens every text with the bos token (Megatron-LM's Llama2Tokenizer).
    """

    adds_bos = False

    def __init__(self, tokenizer_type: str, model_path: str) -> None:
        super().__init__(model_path, config={})
        self.tokenizer_type = tokenizer_type

    @property
    def unique_identifiers(self) -> OrderedDict:
        # GPTDataset hashes this into its cache file names: a different tokenizer gets fresh
        # indices.
        return OrderedDict(
            tokenizer_type=self.tokenizer_type, tokenizer_model=os.path.abspath(self.path)
        )

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.tokenizer_type} is a pretraining tokenizer: no chat template"
        )

    def __repr__(self) -> str:
        return f"{self.tokenizer_type}({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


class SentencePieceTokenizer(_Tokenizer):
    """A SentencePiece .model; its eos piece is the end-of-document token."""

    def __init__(self, tokenizer_type: str, model_path: str) -> None:
        super().__init__(tokenizer_type, model_path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:
            raise ValueError(
                f"--tokenizer-model {model_path}: not a SentencePiece model ({e}); a "
                "Hugging Face tokenizer.json goes with --tokenizer-type "
                "HuggingFaceTokenizer"
            ) from None
        if self._sp.eos_id() < 0:
            raise ValueError(
                f"{model_path} defines no eos piece (eos_id=-1); it is needed as the "
                "end-of-document token: retrain it with eos_id >= 0"
            )

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod

    @property
    def bos(self) -> Optional[int]:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer: a SentencePiece model whose bos piece opens every
    document, and whose eos piece ends it."""

    adds_bos = True

    def __init__(self, tokenizer_type: str, model_path: str) -> None:
        super().__init__(tokenizer_type, model_path)
        if self.bos is None:
            raise ValueError(
                f"{model_path} defines no bos piece (bos_id=-1): Llama2Tokenizer "
                "opens documents with it; use SentencePieceTokenizer"
            )

    def tokenize(self, text: str) -> list[int]:
        return [self.bos] + super().tokenize(text)


def special_token_names(config_path: str) -> dict:
    """`{"bos": str, "eos": str, "pad": str}` as far as an HF `tokenizer_config.json` names them
    (a plain string or an AddedToken dict)."""
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_path}: not a readable tokenizer config ({e})") from None
    names = {}
    for role in ("bos", "eos", "pad"):
        token = config.get(f"{role}_token") if isinstance(config, dict) else None
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            names[role] = token
    return names


class HuggingFaceTokenizer(_Tokenizer):
    """A `tokenizer.json` from the HF `tokenizers` library (no `transformers` needed).

    Its special tokens are those the `tokenizer_config.json` beside it names (as `AutoTokenizer`
    reads them: Llama-3's `<|end_of_text|>`, Qwen's `<|endoftext|>`); without one, the first of
    `HF_EOD_TOKENS` in the vocabulary ends documents and `<pad>` pads, if present.
    """

    def __init__(
        self, tokenizer_type: str, model_path: str, backend: Optional[tokenizers.Tokenizer] = None
    ) -> None:
        super().__init__(tokenizer_type, model_path)
        try:
            self._tok = backend or tokenizers.Tokenizer.from_file(model_path)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ValueError(
                f"--tokenizer-model {model_path}: not a Hugging Face tokenizer.json "
                f"({e}); a SentencePiece .model goes with --tokenizer-type "
                "SentencePieceTokenizer"
            ) from None
        config = os.path.join(os.path.dirname(model_path), HF_TOKENIZER_CONFIG)
        self.config_path = config if os.path.isfile(config) else None
        names = special_token_names(config) if self.config_path else {}
        ids = {role: self._tok.token_to_id(token) for role, token in names.items()}
        for role, token in names.items():
            if ids[role] is None:
                raise ValueError(
                    f"{config} names {token!r} as its {role} token, but "
                    f"{model_path} has no such token"
                )
        if "eos" in ids:
            self._eod = ids["eos"]
        else:
            found = [
                self._tok.token_to_id(t)
                for t in HF_EOD_TOKENS
                if self._tok.token_to_id(t) is not None
            ]
            if not found:
                raise ValueError(
                    f"{model_path} has none of the end-of-document tokens "
                    f"{HF_EOD_TOKENS} and no {HF_TOKENIZER_CONFIG} naming its eos"
                )
            self._eod = found[0]
        self._pad = ids.get("pad", self._tok.token_to_id("<pad>"))
        self._bos = ids.get("bos")

    def tokenize(self, text: str) -> list[int]:
        # No post-processor BOS/EOS: document ends are marked by EOD (preprocess --append-eod).
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad if self._pad is not None else self._eod

    @property
    def bos(self) -> Optional[int]:
        return self._bos

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE from `--vocab-file` (vocab.json)
    and `--merge-file` (merges.txt), `<|endoftext|>` ending documents (and, in text, read as
    that one token, as Megatron-Core's GPT-2 tokenizer does)."""

    def __init__(self, tokenizer_type: str, vocab_file: str, merge_file: str) -> None:
        from tokenizers import decoders, models, pre_tokenizers

        backend = tokenizers.Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        if backend.token_to_id(GPT2_EOD) is None:
            raise ValueError(f"--vocab-file {vocab_file} has no {GPT2_EOD} token")
        backend.add_special_tokens([GPT2_EOD])
        self.merge_file = merge_file
        super().__init__(tokenizer_type, vocab_file, backend)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            **super().unique_identifiers, merge_file=os.path.abspath(self.merge_file)
        )


class NullTokenizer(_Tokenizer):
    """Megatron-LM's NullTokenizer, for data tokenized elsewhere and synthetic runs: a text is
    space-separated ids; `--vocab-size` ids, and the one after them ends documents."""

    def __init__(self, tokenizer_type: str, vocab_size: int) -> None:
        super().__init__(tokenizer_type, f"null-{vocab_size}")
        self._ids = vocab_size

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(tokenizer_type=self.tokenizer_type, vocab_size=self._ids)

    @property
    def vocab_size(self) -> int:
        return self._ids + 1

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary of strings")

    @property
    def eod(self) -> int:
        return self._ids

    eos = pad = eod

    @property
    def bos(self) -> Optional[int]:
        return None


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    vocab_size: Optional[int] = None,
) -> _Tokenizer:
    """Megatron-LM's tokenizer flags -> a tokenizer: `--tokenizer-model` for SentencePiece and
    HF models, `--vocab-file/--merge-file` for GPT2BPETokenizer, `--vocab-size` for
    NullTokenizer."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"unknown --tokenizer-type {tokenizer_type!r}; valid types: "
            f"{', '.join(TOKENIZER_TYPES)}"
        )
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ValueError(
                "--tokenizer-type NullTokenizer needs --vocab-size (the ids before "
                "the end-of-document id)"
            )
        return NullTokenizer(tokenizer_type, vocab_size)
    check_tokenizer_files(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(tokenizer_type, vocab_file, merge_file)
    path = str(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer" and os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    cls = {"HuggingFaceTokenizer": HuggingFaceTokenizer, "Llama2Tokenizer": Llama2Tokenizer}.get(
        tokenizer_type, SentencePieceTokenizer
    )
    return cls(tokenizer_type, path)


def tokenizer_flags(args) -> dict:
    """`build_tokenizer`'s keyword arguments from parsed flags."""
    return {
        "tokenizer_model": args.tokenizer_model,
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
        "vocab_size": args.vocab_size,
    }
