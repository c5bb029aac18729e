"""What the data and tokenizer flags name, checked on the file system alone: no library is
imported, so a wrong path is refused as the flags are validated, in a fraction of a second,
before anything heavy loads (the tokenizer's and the dataset's own checks run again when they
are built, and read the files)."""

import os
from typing import Optional


def check_tokenizer_files(
    tokenizer_type: str,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
) -> None:
    """The files a tokenizer type reads exist (NullTokenizer reads none)."""
    if tokenizer_type == "NullTokenizer":
        return
    if tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if path is None or not os.path.isfile(path):
                raise FileNotFoundError(
                    f"--tokenizer-type GPT2BPETokenizer needs {flag}: "
                    f"{path or 'not given'}" + (": no such file" if path else "")
                )
        return
    if tokenizer_model is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    path = str(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer" and os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model {path}: no such file (type {tokenizer_type})")


def check_data_prefix(prefix: str, flag: str = "--data-path") -> None:
    """A dataset prefix names a .bin/.idx pair (the one given with its suffix is told so)."""
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    if not missing:
        return
    stem, suffix = os.path.splitext(prefix)
    if suffix in (".bin", ".idx") and os.path.isfile(stem + ".bin"):
        raise FileNotFoundError(
            f"{flag} {prefix}: a data path is the prefix of the .bin/.idx pair, without the "
            f"suffix: {flag} {stem}"
        )
    raise FileNotFoundError(
        f"{flag} {prefix}: missing {' and '.join(missing)}; a data path is the prefix of a "
        ".bin/.idx pair from tools/preprocess_data.py, e.g. <out>_text_document"
    )


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def is_prefix(path: str) -> bool:
    return os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx")


def check_blend_words(paths: list, flag: str = "--data-path") -> None:
    """`heavy p1 light p2`: words where a blend's weights go (the prefixes after them exist)."""
    if not paths or is_number(paths[0]):
        return
    for i in range(0, len(paths) - 1, 2):
        if not is_prefix(paths[i]) and is_prefix(paths[i + 1]):
            raise ValueError(
                f"{flag} {paths[i]}: neither a blend weight (a number) nor a data prefix (no "
                f"{paths[i]}.bin/.idx); a blend alternates weights and prefixes: w1 p1 w2 p2 ..."
            )


def data_prefixes(paths, flag: str = "--data-path") -> list:
    """The prefixes of a `--data-path` (`p1 p2 ...` or a blend `w1 p1 w2 p2 ...`): what is no
    number; words where weights go refused as such."""
    check_blend_words(list(paths or ()), flag)
    return [entry for entry in paths or () if not is_number(entry)]
