"""Data pipeline: tokenizers, preprocessing, indexed-dataset checks, GPT datasets, embedded data."""

import argparse
import collections
import glob
import gzip
import inspect
import json
import os
import textwrap
import time

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_focus.data.corpus import write_stdlib_corpus
from megatron_focus.data.datasets import build_datasets
from megatron_focus.data.embedded import ensure_embedded_data
from megatron_focus.data.indexed import check_indexed_dataset
from megatron_focus.data.preprocess import preprocess
from megatron_focus.data.sentencepiece_trainer import train_sentencepiece
from megatron_focus.data.tokenizer import TOKENIZER_TYPES, build_tokenizer

from distributed import run_distributed
from tiny_runs import gpt2_bpe_files, write_docs

SP = "GPTSentencePieceTokenizer"
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "Line one.\nLine two,  with two spaces.\n\n  Indented line.",
    "Unicode: naïve café, 東京, ☃ and numbers 12345.",
    "x",
]


def _read_back(prefix):
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A 400-piece SentencePiece model trained on a few stdlib module docstrings (< 1 s)."""
    tmp = tmp_path_factory.mktemp("sp")
    texts = [m.__doc__ for m in (argparse, collections, json, textwrap, gzip)]
    corpus = write_docs(tmp / "train.jsonl", texts * 3)
    return train_sentencepiece([corpus], str(tmp / "tok"), vocab_size=400, quiet=True)


@pytest.fixture(scope="module")
def sp_data(sp_model, tmp_path_factory):
    """Two preprocessed datasets of a few hundred short documents each."""
    tmp = tmp_path_factory.mktemp("data")
    prefixes = []
    for name, words in (("a", "alpha beta gamma delta"), ("b", "one two three four five")):
        docs = [f"{name} document {i}: {words} " * (1 + i % 5) for i in range(300)]
        corpus = write_docs(tmp / f"{name}.jsonl", docs)
        prefixes += preprocess([corpus], str(tmp / name), SP, sp_model, append_eod=True).prefixes
    return prefixes


# --- tokenizers ---------------------------------------------------------------------------------


def test_sentencepiece_tokenizer(sp_model):
    tok = build_tokenizer(SP, sp_model)
    assert (tok.vocab_size, tok.eod, tok.pad) == (400, 2, 3)
    for text in DOCS:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.unique_identifiers["tokenizer_model"] == os.path.abspath(sp_model)


def test_unknown_tokenizer_type_and_missing_model(sp_model):
    with pytest.raises(ValueError, match="valid types: " + ", ".join(TOKENIZER_TYPES)):
        build_tokenizer("BertWordPieceLowerCase", sp_model)
    with pytest.raises(FileNotFoundError, match="nope.model"):
        build_tokenizer(SP, "nope.model")


def _hf_tokenizer(path, special_tokens):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS * 10, trainer=trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    return tok


def _openai_gpt2_encode(vocab_file, merges_file, text):
    """OpenAI's GPT-2 encoder (encoder.py), written out: the reference Megatron-LM's
    GPT2BPETokenizer follows; `<|endoftext|>` in text is that one token, as in Megatron-Core."""
    import regex

    byte_values = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = byte_values[:], 0
    for b in range(256):
        if b not in byte_values:
            byte_values.append(b)
            chars.append(256 + n)
            n += 1
    byte_to_char = dict(zip(byte_values, map(chr, chars)))
    encoder = json.load(open(vocab_file))
    merges = [tuple(line.split()) for line in open(merges_file).read().split("\n")[1:] if line]
    ranks = dict(zip(merges, range(len(merges))))

    def bpe(word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [
                (ranks.get(pair, float("inf")), i) for i, pair in enumerate(zip(parts, parts[1:]))
            ]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            first, second = parts[i], parts[i + 1]
            merged, j = [], 0
            while j < len(parts):  # merge every occurrence of the pair, left to right
                if j < len(parts) - 1 and (parts[j], parts[j + 1]) == (first, second):
                    merged.append(first + second)
                    j += 2
                else:
                    merged.append(parts[j])
                    j += 1
            parts = merged
        return parts

    pattern = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )
    ids = []
    for i, piece in enumerate(text.split("<|endoftext|>")):
        if i:
            ids.append(encoder["<|endoftext|>"])
        for token in regex.findall(pattern, piece):
            ids += [encoder[p] for p in bpe("".join(byte_to_char[b] for b in token.encode()))]
    return ids


def test_gpt2_bpe_tokenizer_encodes_as_openais_gpt2(tmp_path):
    from megatron_focus.hf.tokenizer import PROBES

    vocab, merges = gpt2_bpe_files(tmp_path)
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert ours.eod == json.load(open(vocab))["<|endoftext|>"]
    for text in PROBES + ("two docs<|endoftext|>joined", "  spaces\n\n\tand tabs"):
        assert ours.tokenize(text) == _openai_gpt2_encode(vocab, merges, text), text
        assert ours.detokenize(ours.tokenize(text)) == text
    with pytest.raises(FileNotFoundError, match="needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab)


def test_llama2_and_null_tokenizers_as_megatron_lm(sp_model):
    """Llama2Tokenizer: SentencePiece with its bos piece opening every text; NullTokenizer:
    Megatron-Core's (space-separated ids, one id after --vocab-size ends documents)."""
    import sentencepiece
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    llama = build_tokenizer("Llama2Tokenizer", sp_model)
    reference = sentencepiece.SentencePieceProcessor(model_file=sp_model, add_bos=True)
    for text in ("Hello world", " two  spaces\n", ""):
        assert llama.tokenize(text) == reference.encode(text)
    assert llama.eod == reference.eos_id()
    # megatron-core 0.18 made the last of the vocab-size ids end documents (its `eod_id=`); the
    # trainer keeps Megatron-LM 0.16's convention, which data tokenized with it depends on
    legacy = "eod_id" not in inspect.signature(NullTokenizer).parameters
    theirs = NullTokenizer(1000) if legacy else NullTokenizer(1001, eod_id=1000)
    ours = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eod)
    assert ours.tokenize("5 17 999") == theirs.text_to_ids("5 17 999") == [5, 17, 999]
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "Llama2Tokenizer"])
def test_megatron_tokenizers_train_and_export(kind, sp_model, tmp_path, run_tool):
    """preprocess_data.py, pretrain_gpt.py and convert_to_hf.py with Megatron-LM's tokenizer
    flags; the exported tokenizer encodes as the training one (Llama2's bos included)."""
    from transformers import AutoTokenizer

    from megatron_focus.hf.tokenizer import PROBES

    if kind == "GPT2BPETokenizer":
        vocab, merges = gpt2_bpe_files(tmp_path)
        flags = ["--vocab-file", vocab, "--merge-file", merges]
    else:
        flags = ["--tokenizer-model", sp_model]
    docs = write_docs(
        tmp_path / "docs.jsonl", [f"{text} {i}" for i in range(40) for text in PROBES]
    )
    out = run_tool(
        "tools/preprocess_data.py",
        "--input",
        docs,
        "--output-prefix",
        tmp_path / "data",
        "--tokenizer-type",
        kind,
        *flags,
        "--append-eod",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    out = run_tool(
        "pretrain_gpt.py",
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "2",
        "--eval-iters",
        "1",
        "--split",
        "90,10,0",
        "--data-path",
        tmp_path / "data_text_document",
        "--tokenizer-type",
        kind,
        *flags,
        "--data-cache-path",
        tmp_path / "cache",
        "--save",
        tmp_path / "ckpt",
        "--num-workers",
        "0",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    out = run_tool(
        "tools/convert_to_hf.py", "--load", tmp_path / "ckpt", "--save-dir", tmp_path / "hf"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ours = build_tokenizer(
        kind,
        **(
            {"vocab_file": vocab, "merge_file": merges}
            if kind == "GPT2BPETokenizer"
            else {"tokenizer_model": sp_model}
        ),
    )
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in PROBES:
        assert theirs(text)["input_ids"] == ours.tokenize(text), text


def test_huggingface_tokenizer_json(tmp_path):
    hf = _hf_tokenizer(tmp_path / "hf", ["<pad>", "<|endoftext|>"])
    for model in (tmp_path / "hf", tmp_path / "hf" / "tokenizer.json"):  # folder or file
        tok = build_tokenizer("HuggingFaceTokenizer", str(model))
        assert tok.eod == hf.token_to_id("<|endoftext|>") and tok.pad == hf.token_to_id("<pad>")
        assert tok.vocab_size == hf.get_vocab_size()
        for text in DOCS:
            assert tok.detokenize(tok.tokenize(text)) == text

    corpus = write_docs(tmp_path / "docs.jsonl", DOCS)
    stats = preprocess(
        [corpus],
        str(tmp_path / "out"),
        "HuggingFaceTokenizer",
        str(tmp_path / "hf"),
        append_eod=True,
    )
    expected = [tok.tokenize(d) + [tok.eod] for d in DOCS if d]
    assert _read_back(stats.prefixes[0]) == expected

    _hf_tokenizer(tmp_path / "no_eod", ["<pad>"])
    with pytest.raises(ValueError, match="end-of-document tokens"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "no_eod"))


# --- preprocessing ------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".parquet"])
def test_preprocess_round_trip(sp_model, tmp_path, suffix):
    corpus = write_docs(tmp_path / f"docs{suffix}", DOCS)
    stats = preprocess([corpus], str(tmp_path / "out"), SP, sp_model, append_eod=True)

    tok = build_tokenizer(SP, sp_model)
    expected = [tok.tokenize(d) + [tok.eod] for d in DOCS if d]
    assert stats.prefixes == [str(tmp_path / "out_text_document")]
    assert _read_back(stats.prefixes[0]) == expected
    assert (stats.docs, stats.empty_skipped, stats.tokens) == (
        len(expected),
        1,
        sum(map(len, expected)),
    )
    assert IndexedDataset(stats.prefixes[0]).index.dtype == np.uint16
    assert sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(corpus), "out_text_document.bin", "out_text_document.idx"]
    )  # no temporaries left


def test_preprocess_globs_keys_workers_and_no_eod(sp_model, tmp_path):
    for i in range(3):
        write_docs(tmp_path / f"shard{i}.jsonl", [f"shard {i} doc {j}" for j in range(40)])
    one = preprocess(
        [str(tmp_path / "shard*.jsonl")], str(tmp_path / "one"), SP, sp_model, append_eod=False
    )
    two = preprocess(
        [str(tmp_path / "shard*.jsonl")],
        str(tmp_path / "two"),
        SP,
        sp_model,
        append_eod=False,
        workers=2,
        log_interval=7,
    )
    tok = build_tokenizer(SP, sp_model)
    expected = [tok.tokenize(f"shard {i} doc {j}") for i in range(3) for j in range(40)]
    assert (
        _read_back(one.prefixes[0]) == _read_back(two.prefixes[0]) == expected
    )  # sorted glob order, no EOD


def test_files_left_by_a_killed_preprocessing_run_are_removed(sp_model, tmp_path, capsys):
    """Those of a process that is gone; a running one's (here the parent's pid) are its own."""
    import subprocess
    import sys

    docs = write_docs(tmp_path / "in.jsonl", ["one doc", "two docs"])
    prefix = str(tmp_path / "out_text_document")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    stale = [f"{prefix}.tmp{gone}.bin", f"{prefix}.tmp{gone}.idx"]
    running = f"{prefix}.tmp{os.getppid()}.bin"
    for path in stale + [running]:
        open(path, "wb").write(b"partial")
    preprocess([docs], str(tmp_path / "out"), SP, sp_model, append_eod=True)
    assert "left by an interrupted run" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["in.jsonl", "out_text_document.bin", "out_text_document.idx", os.path.basename(running)]
    )


def test_empty_documents_are_skipped_and_counted(sp_model, tmp_path):
    corpus = write_docs(tmp_path / "docs.jsonl", ["", "hello", "", ""])
    stats = preprocess([corpus], str(tmp_path / "out"), SP, sp_model, append_eod=True)
    assert (stats.docs, stats.empty_skipped) == (1, 3)
    assert len(_read_back(stats.prefixes[0])) == 1

    only_empty = write_docs(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(ValueError, match="no non-empty documents"):
        preprocess([only_empty], str(tmp_path / "none"), SP, sp_model, append_eod=True)
    assert not any(name.startswith("none") for name in os.listdir(tmp_path))


def test_missing_text_field_is_a_clear_error(sp_model, tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"content": "oops"}) + "\n")
    with pytest.raises(
        ValueError, match=r"bad\.jsonl:2: record has no 'text' field \(fields: content\)"
    ):
        preprocess([str(corpus)], str(tmp_path / "out"), SP, sp_model, append_eod=True)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # nothing half-written

    table = write_docs(tmp_path / "bad.parquet", ["a", "b"], key="content")
    with pytest.raises(ValueError, match=r"bad\.parquet: no column 'text' \(columns: content\)"):
        preprocess([table], str(tmp_path / "out"), SP, sp_model, append_eod=True)
    with pytest.raises(FileNotFoundError, match="missing_\\*.jsonl"):
        preprocess(
            [str(tmp_path / "missing_*.jsonl")],
            str(tmp_path / "out"),
            SP,
            sp_model,
            append_eod=True,
        )


# --- indexed dataset checks ---------------------------------------------------------------------


@pytest.fixture
def small_prefix(sp_model, tmp_path):
    corpus = write_docs(tmp_path / "docs.jsonl", DOCS)
    return preprocess([corpus], str(tmp_path / "out"), SP, sp_model, append_eod=True).prefixes[0]


def test_check_accepts_good_data_and_reports_missing_files(small_prefix):
    check_indexed_dataset(small_prefix, 400)
    with pytest.raises(FileNotFoundError, match=r"missing .*nope\.bin and .*nope\.idx"):
        check_indexed_dataset(os.path.join(os.path.dirname(small_prefix), "nope"), 400)


@pytest.mark.parametrize("keep_bytes", [20, -8])
def test_truncated_idx_is_a_clear_error(small_prefix, keep_bytes):
    idx = small_prefix + ".idx"
    data = open(idx, "rb").read()
    open(idx, "wb").write(data[:keep_bytes])
    with pytest.raises(
        ValueError,
        match=r"out_text_document\.idx is truncated or (corrupt: \d+ bytes|not a Megatron index)",
    ):
        check_indexed_dataset(small_prefix, 400)


def test_truncated_bin_is_a_clear_error(small_prefix):
    os.truncate(small_prefix + ".bin", os.path.getsize(small_prefix + ".bin") - 2)
    with pytest.raises(
        ValueError, match=r"out_text_document\.bin has \d+ bytes but .* describes \d+"
    ):
        check_indexed_dataset(small_prefix, 400)


def test_vocab_smaller_than_data_is_a_clear_error(small_prefix):
    largest = max(max(doc) for doc in _read_back(small_prefix))
    check_indexed_dataset(small_prefix, largest + 1)
    with pytest.raises(
        ValueError,
        match=f"vocabulary {largest} is smaller than the data's largest token id {largest}",
    ):
        check_indexed_dataset(small_prefix, largest)


# --- GPT datasets -------------------------------------------------------------------------------


def _check_samples(dataset, seq_length):
    for i in range(0, len(dataset), max(1, len(dataset) // 7)):
        sample = dataset[i]
        assert sample["tokens"].shape == sample["labels"].shape == (seq_length,)
        assert "attention_mask" not in sample  # create_attention_mask=False
        assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
        assert torch.equal(sample["position_ids"], torch.arange(seq_length))


def test_build_datasets_single_prefix(sp_model, sp_data, tmp_path):
    tok = build_tokenizer(SP, sp_model)
    train, valid, test = build_datasets(
        sp_data[:1], "90,5,5", 16, 1234, tok, (50, 5, 5), str(tmp_path)
    )
    assert len(train) >= 50 and len(valid) >= 5 and len(test) >= 5
    for dataset in (train, valid, test):
        _check_samples(dataset, 16)
    # The training tokens are exactly the training documents' tokens, in some order.
    data = IndexedDataset(sp_data[0])
    first_doc = data[int(train.document_index[0])].tolist()
    assert tok.eod in first_doc and first_doc[-1] == tok.eod

    _, none_valid, none_test = build_datasets(
        sp_data[:1], "1", 16, 1234, tok, (50, 5, 5), str(tmp_path)
    )
    assert none_valid is None and none_test is None


def test_per_split_data_paths_as_megatron(sp_model, sp_data, tmp_path):
    """--train-data-path / --valid-data-path: each split is its data whole, the samples of that
    data given alone to its split (--split 1,0,0 / 0,1,0); no --test-data-path, no test split."""
    tok = build_tokenizer(SP, sp_model)
    train, valid, test = build_datasets(
        None,
        None,
        16,
        1234,
        tok,
        (40, 6, 0),
        str(tmp_path),
        per_split=[sp_data[:1], sp_data[1:2], None],
    )
    alone_train, _, _ = build_datasets(
        sp_data[:1], "1,0,0", 16, 1234, tok, (40, 0, 0), str(tmp_path)
    )
    _, alone_valid, _ = build_datasets(
        sp_data[1:2], "0,1,0", 16, 1234, tok, (0, 6, 0), str(tmp_path)
    )
    assert test is None and len(train) == len(alone_train) and len(valid) == len(alone_valid)
    for ours, alone in ((train, alone_train), (valid, alone_valid)):
        for i in range(len(ours)):
            assert torch.equal(ours[i]["tokens"], alone[i]["tokens"])
    with pytest.raises(ValueError, match="--valid-data-path x: neither a blend weight"):
        build_datasets(
            None,
            None,
            16,
            1,
            tok,
            (4, 2, 0),
            str(tmp_path),
            per_split=[sp_data[:1], ["x", sp_data[1]], None],
        )


def test_build_datasets_blend_with_weights(sp_model, sp_data, tmp_path):
    tok = build_tokenizer(SP, sp_model)
    blend = ["0.25", sp_data[0], "0.75", sp_data[1]]
    had_group = torch.distributed.is_initialized()  # normally not: this exercises the no-group path
    train, valid, _ = build_datasets(blend, "98,1,1", 16, 1234, tok, (400, 8, 8), str(tmp_path))
    assert torch.distributed.is_initialized() == had_group
    assert len(train) >= 400
    _check_samples(train, 16)
    share = np.bincount(np.asarray(train.dataset_index[:400]), minlength=2) / 400
    assert abs(share[1] - 0.75) < 0.02
    # Cache hit the second time: same samples.
    again, _, _ = build_datasets(blend, "98,1,1", 16, 1234, tok, (400, 8, 8), str(tmp_path))
    assert torch.equal(again[17]["tokens"], train[17]["tokens"])


def test_build_datasets_under_initialized_gloo_group(sp_model, sp_data, tmp_path):
    tok = build_tokenizer(SP, sp_model)
    owns_group = not torch.distributed.is_initialized()
    if owns_group:
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    try:
        train, _, _ = build_datasets(
            ["1", sp_data[0], "1", sp_data[1]], "98,1,1", 16, 7, tok, (60, 4, 4), str(tmp_path)
        )
        _check_samples(train, 16)
        assert torch.distributed.is_initialized()  # the caller's group is left alone
    finally:
        if owns_group:
            torch.distributed.destroy_process_group()


def _build_on_rank(sp_model, data_path, cache_dir):
    torch.distributed.init_process_group("gloo")
    tok = build_tokenizer(SP, sp_model)
    train, _, _ = build_datasets(data_path, "98,1,1", 16, 7, tok, (60, 4, 4), cache_dir)
    tokens = torch.stack([train[i]["tokens"] for i in range(len(train))])
    gathered = [torch.empty_like(tokens) for _ in range(2)]
    torch.distributed.all_gather(gathered, tokens)
    return [g.tolist() for g in gathered]


@pytest.mark.slow
def test_build_datasets_on_two_ranks(sp_model, sp_data, tmp_path):
    rank0, rank1 = run_distributed(
        _build_on_rank, 2, sp_model, ["1", sp_data[0], "1", sp_data[1]], str(tmp_path)
    )
    assert rank0 == rank1 and len(rank0) >= 60


def _build_alone(sp_model, data_path, cache_dir):
    tok = build_tokenizer(SP, sp_model)
    train, _, _ = build_datasets(data_path, "98,1,1", 16, 11, tok, (3000, 4, 4), cache_dir)
    return [train[i]["tokens"].tolist() for i in (0, 1234, 2999)]


def test_two_jobs_building_one_index_cache_at_once(sp_model, sp_data, tmp_path):
    """Each builds under the cache folder's lock; the later one reads whole files."""
    import concurrent.futures
    import multiprocessing

    blend = ["1", sp_data[0], "1", sp_data[1]]
    with concurrent.futures.ProcessPoolExecutor(
        2, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        jobs = [pool.submit(_build_alone, sp_model, blend, str(tmp_path)) for _ in range(2)]
        first, second = (job.result(timeout=300) for job in jobs)
    assert first == second


def test_damaged_index_cache_is_rebuilt_and_a_pickled_one_refused(sp_model, sp_data, tmp_path):
    tok = build_tokenizer(SP, sp_model)

    def build():
        train, _, _ = build_datasets(sp_data[:1], "98,1,1", 16, 3, tok, (50, 4, 4), str(tmp_path))
        return [train[i]["tokens"].tolist() for i in range(len(train))]

    fresh = build()
    shuffle = sorted(glob.glob(str(tmp_path / "*shuffle_index.npy")))[0]
    with open(shuffle, "r+b") as f:  # as a build killed mid-write leaves it
        f.truncate(os.path.getsize(shuffle) // 2)
    with pytest.warns(UserWarning, match="is damaged .* rebuilding its set"):
        assert build() == fresh
    np.save(shuffle, np.array([{"code": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="holds pickled objects"):
        build()


def test_eod_mask_loss_and_reset_position_ids_as_megatron(sp_model, sp_data, tmp_path):
    """Megatron's --eod-mask-loss and --reset-position-ids: end-of-document tokens leave the
    loss, and positions restart after each one."""
    tok = build_tokenizer(SP, sp_model)
    plain, _, _ = build_datasets(sp_data[:1], "1", 64, 3, tok, (20, 0, 0), str(tmp_path))
    masked, _, _ = build_datasets(
        sp_data[:1],
        "1",
        64,
        3,
        tok,
        (20, 0, 0),
        str(tmp_path),
        reset_position_ids=True,
        eod_mask_loss=True,
    )
    ends = 0
    for i in range(20):
        a, b = plain[i], masked[i]
        assert torch.equal(a["tokens"], b["tokens"]) and a["loss_mask"].all()
        eod = b["tokens"] == tok.eod
        ends += int(eod.sum())
        assert torch.equal(b["loss_mask"] == 0, eod)
        expected, position = [], 0
        for t in b["tokens"].tolist():
            expected.append(position)
            position = 0 if t == tok.eod else position + 1
        assert b["position_ids"].tolist() == expected
    assert ends > 10


def test_mock_data_needs_no_files(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    train, valid, _ = build_datasets(None, "969,30,1", 32, 1, tok, (16, 4, 0), str(tmp_path))
    assert len(train) >= 16 and len(valid) >= 4
    assert int(train[0]["tokens"].max()) <= tok.vocab_size and train[0]["tokens"].shape == (32,)


def test_build_datasets_rejects_bad_splits(sp_model, tmp_path):
    tok = build_tokenizer(SP, sp_model)
    corpus = write_docs(tmp_path / "tiny.jsonl", [f"doc {i}" for i in range(50)])
    prefix = preprocess([corpus], str(tmp_path / "tiny"), SP, sp_model, append_eod=True).prefixes[0]
    # 50 documents * 1/1000 rounds to none: Megatron would loop forever asking for test samples.
    with pytest.raises(ValueError, match="gives the test split none of the 50 documents"):
        build_datasets([prefix], "969,30,1", 16, 1, tok, (10, 2, 2), str(tmp_path))
    with pytest.raises(
        ValueError, match="gives the test split none"
    ):  # even when no test samples are asked
        build_datasets([prefix], "969,30,1", 16, 1, tok, (10, 2, 0), str(tmp_path))
    build_datasets([prefix], "969,31,0", 16, 1, tok, (10, 2, 2), str(tmp_path))
    for bad in ("abc", "0,0,0", "1,2,3,4"):
        with pytest.raises(ValueError, match="--split"):
            build_datasets([prefix], bad, 16, 1, tok, (10, 2, 2), str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--data-path"):
        build_datasets([prefix + "_typo"], "98,1,1", 16, 1, tok, (10, 2, 2), str(tmp_path))


# --- embedded default data ----------------------------------------------------------------------


def test_embedded_data_builds_once_and_is_deterministic(tmp_path):
    start = time.time()
    prefix, model = ensure_embedded_data(str(tmp_path))
    built = time.time() - start
    start = time.time()
    assert ensure_embedded_data(str(tmp_path)) == (prefix, model)
    assert time.time() - start < 0.1 < built  # cache hit
    assert sorted(os.listdir(tmp_path)) == ["embedded-v1"]  # no temporaries left

    tok = build_tokenizer(SP, model)
    assert (tok.vocab_size, tok.eod, tok.pad) == (4096, 2, 3)
    check_indexed_dataset(prefix, tok.vocab_size)
    data = IndexedDataset(prefix)
    corpus = os.path.join(os.path.dirname(prefix), "stdlib.jsonl")
    first = json.loads(open(corpus).readline())["text"]
    assert tok.detokenize(data[0][:-1]) == first and data[0][-1] == tok.eod

    assert write_stdlib_corpus(str(tmp_path / "again.jsonl")) == len(data)
    assert open(tmp_path / "again.jsonl", "rb").read() == open(corpus, "rb").read()
