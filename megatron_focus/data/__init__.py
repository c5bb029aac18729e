"""Data: tokenizers, corpora, preprocessing and datasets. This module itself stays light (the
flag checks import it)."""


def reads_data_files(args) -> bool:
    """Whether the run reads a dataset of its own (otherwise: the embedded corpus, mock data or
    MQAR)."""
    return bool(args.data_path or args.train_data_path)
