"""tools/preprocess_data.py knows every flag of Megatron-LM's tools/preprocess_data.py: honoured,
said to have no effect, or refused by name before any work; its output is Megatron-LM's, with
--partitions and --split-sentences too. tools/train_tokenizer.py is quiet unless --verbose."""

import argparse
import collections
import json
import os
import re
import runpy
import subprocess
import sys

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_focus.config import compat
from megatron_focus.data import preprocess as preprocess_module
from megatron_focus.data.preprocess import preprocess
from megatron_focus.data.sentencepiece_trainer import train_sentencepiece
from megatron_focus.data.tokenizer import build_tokenizer

from tiny_runs import write_docs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = "tools/preprocess_data.py"
SP = "GPTSentencePieceTokenizer"
SPEC = compat.PREPROCESS_SPEC
ACTIONS = compat.megatron_lm_actions(SPEC)
# Megatron-LM's flags that work here as there (the tool's own parser defines them)
HONOURED = {
    "--input", "--output-prefix", "--json-keys", "--tokenizer-type", "--tokenizer-model",
    "--vocab-file", "--merge-file", "--vocab-size", "--append-eod", "--split-sentences",
    "--keep-newlines", "--lang", "--workers", "--partitions", "--keep-sequential-samples",
    "--log-interval", "--help", "-h",
}  # fmt: skip


def build_parser():
    return runpy.run_path(os.path.join(ROOT, TOOL))["build_parser"]()


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A 400-piece SentencePiece model trained on a few stdlib module docstrings (< 1 s)."""
    tmp = tmp_path_factory.mktemp("sp")
    texts = [m.__doc__ for m in (argparse, collections, json)]
    corpus = write_docs(tmp / "train.jsonl", texts * 3)
    return train_sentencepiece([corpus], str(tmp / "tok"), vocab_size=400, quiet=True)


DOCS = [f"document {i}: " + "alpha beta gamma. " * (1 + i % 4) for i in range(23)]
DOCS[5] = ""  # an empty document keeps its place among the partitions, as in Megatron-LM


def _bytes(prefix):
    return open(f"{prefix}.bin", "rb").read(), open(f"{prefix}.idx", "rb").read()


def _tool(*args):
    return subprocess.run(
        [sys.executable, TOOL, *map(str, args)], cwd=ROOT, capture_output=True, text=True
    )


# --- every flag classified ----------------------------------------------------------------------


def test_every_megatron_lm_preprocessing_flag_is_honoured_no_effect_or_refused():
    flags = [flag for names, _ in ACTIONS for flag in names]
    assert len(ACTIONS) == 29 and len(flags) == 30  # --help -h: one action
    actions = {o: a for a in build_parser()._actions for o in a.option_strings}
    assert [flag for flag in flags if flag not in actions] == []
    kinds = {}
    for flag in flags:
        kind, why = compat.classify_preprocessing(flag) or ("honoured", "")
        kinds[flag] = kind
        if kind != "honoured":
            assert actions[flag].help.startswith(("no effect: ", "refused")), flag
            assert why in actions[flag].help
    assert {flag for flag, kind in kinds.items() if kind == "honoured"} == HONOURED
    assert kinds["--tokenizer-hf-use-fast"] == "no effect"
    assert kinds["--tokenizer-hf-include-special-tokens"] == "refused"
    assert kinds["--vocab-extra-ids"] == kinds["--padded-vocab-size"] == "no effect"


# Megatron-LM's _add_tokenizer_args, which both tools' parsers call
TOKENIZER_FLAGS = [
    "--vocab-size", "--padded-vocab-size", "--vocab-file", "--merge-file", "--vocab-extra-ids",
    "--tokenizer-type", "--tokenizer-model", "--tokenizer-metadata", "--tokenizer-special-tokens",
    "--legacy-tokenizer", "--tiktoken-pattern", "--tiktoken-num-special-tokens",
    "--tiktoken-special-tokens", "--tokenizer-sentencepiece-legacy", "--tokenizer-hf-use-fast",
    "--tokenizer-hf-include-special-tokens", "--trust-remote-code",
]  # fmt: skip


def test_the_record_holds_the_tokenizer_flags_as_pretrain_gpts_record_does():
    """Both records hold the tokenizer flags alike (one function of Megatron-LM's adds them);
    the others are preprocess_data.py's own."""
    pretrain = {names[0]: keywords for names, keywords in compat.megatron_lm_actions()}
    recorded = {names[0]: keywords for names, keywords in ACTIONS}
    assert [flag for flag in TOKENIZER_FLAGS if recorded[flag] != pretrain[flag]] == []
    assert sorted(set(recorded) - set(TOKENIZER_FLAGS)) == sorted(
        ["--help", "--input", "--json-keys", "--split-sentences", "--keep-newlines",
         "--append-eod", "--lang", "--output-prefix", "--workers", "--partitions",
         "--log-interval", "--keep-sequential-samples"]
    )  # fmt: skip


def test_no_family_names_a_flag_the_tool_implements():
    caught = [o for o in HONOURED if compat.classify_preprocessing(o) is not None]
    assert caught == []
    named = {p for key in compat.PREPROCESS_NO_EFFECT for p in key.split()}
    flags = {flag for names, _ in ACTIONS for flag in names}
    assert named <= flags


def _given(names, keywords):
    """Words that give a flag a value other than Megatron-LM's default."""
    if keywords.get("action") == "store_true":
        return [names[0]]
    return [names[0], *(["a", "b"] if keywords.get("nargs") == "+" else ["7"])]


REFUSED = [
    (names, kw)
    for names, kw in ACTIONS
    if (compat.classify_preprocessing(names[0]) or ("",))[0] == "refused"
]


@pytest.mark.parametrize("names, keywords", REFUSED, ids=[n[0] for n, _ in REFUSED])
def test_each_refused_flag_is_refused_by_name(names, keywords):
    base = ["--input", "x", "--output-prefix", "y", "--tokenizer-type", SP]
    args = build_parser().parse_args(base + _given(names, keywords))
    with pytest.raises(ValueError, match=f"^{names[0]}") as refused:
        compat.refuse(args, SPEC, compat.classify_preprocessing)
    assert "tokenizers here are --tokenizer-type's" in str(refused.value)
    compat.refuse(build_parser().parse_args(base), SPEC, compat.classify_preprocessing)


def test_refused_flags_stop_the_tool_in_one_line_before_any_work(sp_model, tmp_path):
    docs = write_docs(tmp_path / "in.jsonl", DOCS)
    given = [word for names, kw in REFUSED for word in _given(names, kw)]
    out = _tool("--input", docs, "--output-prefix", tmp_path / "out" / "o", "--tokenizer-type",
                SP, "--tokenizer-model", sp_model, *given)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: ") and all(names[0] in line for names, _ in REFUSED), line
    assert os.listdir(tmp_path) == ["in.jsonl"]  # nothing written


@pytest.mark.slow
def test_flags_with_no_effect_leave_the_output_as_it_is(sp_model, tmp_path):
    """The no-effect flags at values other than Megatron-LM's defaults, and the flags that
    change nothing without their companion (--keep-newlines, --lang without --split-sentences;
    --keep-sequential-samples without --partitions), as in Megatron-LM: the same bytes."""
    docs = write_docs(tmp_path / "in.jsonl", DOCS)
    no_effect = [
        word
        for names, kw in ACTIONS
        if (compat.classify_preprocessing(names[0]) or ("",))[0] == "no effect"
        for word in _given(names, kw)
    ]
    assert "--tokenizer-hf-use-fast" in no_effect and "--vocab-extra-ids" in no_effect
    common = ["--input", docs, "--tokenizer-type", SP, "--tokenizer-model", sp_model,
              "--append-eod"]  # fmt: skip
    plain = _tool(*common, "--output-prefix", tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-2000:]
    extra = [*no_effect, "--keep-newlines", "--lang", "german", "--keep-sequential-samples"]
    out = _tool(*common, "--output-prefix", tmp_path / "extra", *extra)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _bytes(tmp_path / "extra_text_document") == _bytes(tmp_path / "plain_text_document")


# --- --partitions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "partitions, workers", [(3, 1), (4, 2), pytest.param(40, 1, marks=pytest.mark.slow)]
)
def test_partitions_write_megatron_lms_document_order(sp_model, tmp_path, partitions, workers):
    """Megatron-LM's --partitions N deals document k (over all inputs) to partition k mod N and
    concatenates the partitions' datasets: the bytes of one partition over the documents in
    that order. --keep-sequential-samples keeps the input's order: one partition's bytes."""
    first, second = DOCS[:10], DOCS[10:]  # two inputs: the count runs on across them
    inputs = [
        write_docs(tmp_path / "in_a.jsonl", first),
        write_docs(tmp_path / "in_b.jsonl", second),
    ]
    dealt = [DOCS[k] for p in range(partitions) for k in range(p, len(DOCS), partitions)]
    assert dealt != DOCS or partitions > len(DOCS)
    expected = preprocess(
        [write_docs(tmp_path / "dealt.jsonl", dealt)], str(tmp_path / "one"), SP, sp_model,
        append_eod=True,
    ).prefixes[0]  # fmt: skip
    run = dict(append_eod=True, partitions=partitions, workers=workers)
    got = preprocess(inputs, str(tmp_path / "parts"), SP, sp_model, **run)
    assert (got.docs, got.empty_skipped) == (len(DOCS) - 1, 1)
    assert _bytes(got.prefixes[0]) == _bytes(expected)
    in_order = preprocess(inputs, str(tmp_path / "seq"), SP, sp_model, append_eod=True)
    sequential = preprocess(
        inputs, str(tmp_path / "seqparts"), SP, sp_model, keep_sequential_samples=True, **run
    )
    assert _bytes(sequential.prefixes[0]) == _bytes(in_order.prefixes[0])
    assert (_bytes(in_order.prefixes[0]) == _bytes(expected)) == (partitions > len(DOCS))
    written = os.listdir(tmp_path)  # no partition or temporary files left
    assert len(written) == 3 + 4 * 2
    assert all(n.endswith((".jsonl", "_document.bin", "_document.idx")) for n in written)


@pytest.mark.slow
def test_partitions_through_the_tool(sp_model, tmp_path):
    docs = write_docs(tmp_path / "in.jsonl", DOCS)
    common = ["--input", docs, "--tokenizer-type", SP, "--tokenizer-model", sp_model]
    for name, extra in (("one", []), ("three", ["--partitions", "3", "--workers", "3"])):
        out = _tool(*common, "--output-prefix", tmp_path / name, *extra)
        assert out.returncode == 0, out.stderr[-2000:]
    ids = [IndexedDataset(str(tmp_path / f"{n}_text_document")) for n in ("one", "three")]
    order = [k for p in range(3) for k in range(p, len(DOCS), 3) if DOCS[k]]
    written = [k for k in range(len(DOCS)) if DOCS[k]]
    assert [ids[1][i].tolist() for i in range(len(order))] == [
        ids[0][written.index(k)].tolist() for k in order
    ]
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["in.jsonl", *(f"{n}_text_document.{s}" for n in ("one", "three") for s in ("bin", "idx"))]
    )


# --- --split-sentences --------------------------------------------------------------------------


def test_split_sentences_without_nltk_is_refused_by_name_before_any_work(sp_model, tmp_path):
    docs = write_docs(tmp_path / "in.jsonl", DOCS)
    code = (
        "import runpy, sys\n"
        "sys.modules['nltk'] = None  # as if NLTK were not installed\n"
        f"sys.argv = [{TOOL!r}] + sys.argv[1:]\n"
        f"runpy.run_path({TOOL!r}, run_name='__main__')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "--input", docs, "--output-prefix", tmp_path / "o",
         "--tokenizer-type", SP, "--tokenizer-model", sp_model, "--split-sentences"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    torch_log = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d")  # torch's C++ log lines
    assert [line for line in out.stderr.strip().splitlines() if not torch_log.match(line)] == [
        "error: --split-sentences: splits with NLTK's punkt, and NLTK is not installed "
        "(pip install nltk)"
    ]
    assert os.listdir(tmp_path) == ["in.jsonl"]


class BarSplitter:
    """A stand-in for punkt: sentences end at '|' (kept), as punkt's pieces of a text."""

    def __init__(self):
        self.calls = []

    def tokenize(self, text):
        self.calls.append(text)
        return [s + "|" if i < text.count("|") else s for i, s in enumerate(text.split("|"))]


def test_split_sentences_writes_each_sentence_as_a_sequence(sp_model, tmp_path, monkeypatch):
    """Megatron-LM's sentence datasets: <prefix>_<key>_sentence, one sequence per sentence
    that has tokens, the EOD in the last; the splitter sees at most SPLIT_CHARS at once. The
    splitter is a stand-in (NLTK's punkt may not be installed): this checks the layout."""
    splitter = BarSplitter()
    monkeypatch.setattr(preprocess_module, "sentence_splitter", lambda *args: splitter)
    monkeypatch.setattr(preprocess_module, "SPLIT_CHARS", 30)
    docs = ["One.| Two.|| Three", "", "no split here", "a|" * 20]
    corpus = write_docs(tmp_path / "in.jsonl", docs)
    stats = preprocess(
        [corpus], str(tmp_path / "out"), SP, sp_model, append_eod=True, split_sentences=True
    )
    assert stats.prefixes == [str(tmp_path / "out_text_sentence")]
    assert (stats.docs, stats.empty_skipped) == (3, 1)
    # the last document is split in two pieces, 30 and 10 characters: 15 + 5 sentences (and
    # one empty, after the first piece's last "|", which has no tokens)
    assert splitter.calls == ["One.| Two.|| Three", "no split here", "a|" * 15, "a|" * 5]
    tok = build_tokenizer(SP, sp_model)
    assert tok.tokenize("|") and not tok.tokenize("")
    sentences = [["One.|", " Two.|", "|", " Three"], ["no split here"], ["a|"] * 20]
    expected, documents = [], [0]
    for doc in sentences:
        expected += [tok.tokenize(s) for s in doc]
        expected[-1].append(tok.eod)
        documents.append(len(expected))
    dataset = IndexedDataset(stats.prefixes[0])
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert dataset.document_indices.tolist() == documents == [0, 4, 5, 25]


def test_keep_newlines_is_megatron_lms_punkt_change():
    """With --keep-newlines, a sentence keeps the whitespace after its end (Megatron-LM's pattern
    for punkt); without, punkt's own. Punkt's parameters here are empty (no abbreviations), so
    the test needs NLTK but none of its data."""
    punkt = pytest.importorskip("nltk.tokenize.punkt")
    text = "Dr. Smith went home. He was tired.\n\nThen  he slept!  Why? Because."
    kept = preprocess_module.punkt_splitter(punkt.PunktParameters(), True).tokenize(text)
    plain = preprocess_module.punkt_splitter(punkt.PunktParameters(), False).tokenize(text)
    assert kept == ["Dr. ", "Smith went home. ", "He was tired.\n\n", "Then  he slept!  ",
                    "Why? ", "Because."]  # fmt: skip
    assert plain == [s.strip() for s in kept]


def test_split_sentences_without_punkt_data_is_refused_by_name(monkeypatch, tmp_path):
    nltk = pytest.importorskip("nltk")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    monkeypatch.setattr(nltk, "download", lambda *args, **kwargs: False)
    with pytest.raises(ValueError, match=r"^--split-sentences --lang english: NLTK's punkt"):
        preprocess_module.sentence_splitter("english", False)


# --- tools/train_tokenizer.py -------------------------------------------------------------------


def test_train_tokenizer_is_quiet_unless_verbose(tmp_path):
    corpus = write_docs(tmp_path / "c.jsonl", [m.__doc__ for m in (argparse, collections, json)])
    common = ["tools/train_tokenizer.py", "--input", corpus, "--vocab-size", "400"]
    quiet = subprocess.run(
        [sys.executable, *common, "--output-prefix", tmp_path / "q"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stderr == "" and quiet.stdout.splitlines() == [
        f"training a 400-piece bpe SentencePiece tokenizer on {corpus}",
        f"wrote {tmp_path / 'q'}.model",
    ]
    verbose = subprocess.run(
        [sys.executable, *common, "--output-prefix", tmp_path / "v", "--verbose"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert verbose.returncode == 0 and len(verbose.stderr.splitlines()) > 100
