"""Exports are never silently wrong: over families x attention variants x window and QKV bias x
tokenizer kinds, an exported folder, as a user loads it (`AutoTokenizer`, `AutoModelForCausalLM`),

- computes `model(**tok(text))` as the native model computes those ids,
- generates with the cache, from `generate(**tok(text))`, the tokens that greedy decoding by
  native full forwards gives, past the window,
- encodes the training corpus as the training tokenizer did,

or the export is refused by name. The checkpoints hold random weights (no training run), with the
tokenizer recorded as a training run records it. Runs under whichever transformers is imported
(`.ci/run` runs the fast cases under 4.57 as well).
"""

import dataclasses
import json
import os

import pytest
import torch

from tiny_runs import LLAMA, byte_level_bpe

os.environ["HF_HUB_OFFLINE"] = "1"

SP, LLAMA2, HF_JSON, HF_FOLDER = "sentencepiece", "llama2", "hf-json", "hf-folder"
GQA = ["--group-query-attention", "--num-query-groups", "2"]
WINDOW = ["--window-size", "5,0"]  # 6 keys: the generation below runs well past them
FOCUS = ["--focus-window", "4", "--focus-groups", "4", "--focus-chunk-size", "16"]
QKV_BIAS = ["--add-qkv-bias"]
# name: (flags, tokenizer kind, the class it exports to, slow)
CASES = {
    "gpt2": ([], SP, "GPT2LMHeadModel", False),
    "gpt2-hf-json": ([], HF_JSON, "GPT2LMHeadModel", False),
    "gpt2-xsa-window": (
        ["--attention", "xsa", "--xsa-layers", "2"] + WINDOW,
        HF_JSON,
        "custom",
        False,
    ),
    "llama-llama2": (LLAMA + GQA, LLAMA2, "LlamaForCausalLM", False),
    "llama-window": (LLAMA + GQA + WINDOW, HF_FOLDER, "MistralForCausalLM", False),
    "llama-xsa-window": (LLAMA + GQA + ["--attention", "xsa"] + WINDOW, SP, "custom", False),
    # Qwen2's shape; transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer
    "qwen2-sentencepiece": (LLAMA + GQA + QKV_BIAS, SP, "custom", False),
    "qwen2-hf-folder": (LLAMA + GQA + QKV_BIAS, HF_FOLDER, "custom", False),
    "qwen2-xsa-window": (
        LLAMA + QKV_BIAS + ["--attention", "xsa"] + WINDOW,
        HF_JSON,
        "custom",
        False,
    ),
    "llama-focus": (LLAMA + GQA + ["--attention", "focus"] + FOCUS, SP, "custom", True),
    "gpt2-focus-xsa": (["--attention", "focus+xsa"] + FOCUS, HF_FOLDER, "custom", True),
}
TEXT = "Hello world, numbers 42"
NEW_TOKENS = 20
CORPUS_DOCS = 200


def _transformers_major() -> int:
    from transformers import __version__

    return int(__version__.split(".")[0])


def _bpe_folder(folder, with_config: bool) -> str:
    """A GPT-2 style byte-level BPE `tokenizer.json` (with Llama-3 style special tokens named in
    a `tokenizer_config.json` if `with_config`); returns what `--tokenizer-model` is given."""
    byte_level_bpe(folder, ["<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>"])
    if not with_config:
        return str(folder / "tokenizer.json")
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)  # a folder, as Megatron-LM's HuggingFaceTokenizer takes it


@pytest.fixture(scope="module")
def tokenizers_by_kind(embedded_cache, tmp_path_factory):
    """kind: (tokenizer_type, tokenizer_model)."""
    from megatron_focus.data.embedded import ensure_embedded_data

    root = tmp_path_factory.mktemp("tokenizers")
    sentencepiece = ensure_embedded_data(embedded_cache)[1]
    return {
        SP: ("GPTSentencePieceTokenizer", sentencepiece),
        LLAMA2: ("Llama2Tokenizer", sentencepiece),
        HF_JSON: ("HuggingFaceTokenizer", _bpe_folder(root / "json", with_config=False)),
        HF_FOLDER: ("HuggingFaceTokenizer", _bpe_folder(root / "folder", with_config=True)),
    }


def _random_checkpoint(save_dir: str, flags: list, tokenizer_type: str, tokenizer_model: str):
    """A checkpoint of the model of `flags` with random weights, its tokenizer recorded as a
    training run records it (by its absolute path)."""
    from megatron_focus import platform
    from megatron_focus.checkpoint import format as checkpoint_format
    from megatron_focus.checkpoint import tp_layout
    from megatron_focus.data.tokenizer import build_tokenizer
    from megatron_focus.hf import native
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    platform.init_distributed(1)
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model)
    args = parse_args(
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
        + ["--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "1"]
        + ["--train-iters", "1", "--lr", "1e-3", "--init-method-std", "0.2"]
        + flags
    )
    vocab = tokenizer.vocab_size
    platform.manual_seed(0)
    model = build_model(args, vocab)
    weights = tp_layout.merge([model.state_dict()], None, vocab)
    model_config = dataclasses.replace(args.model_config, vocab_size=vocab)
    tag_dir = native.write_checkpoint(save_dir, model_config, weights, progress=False)
    checkpoint_format.TokenizerRecord.of_run(
        vocab, tokenizer_type, {"tokenizer_model": tokenizer_model}
    ).write(tag_dir)
    return tokenizer


def _native_greedy(load_dir: str, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding by full forwards of the native model."""
    from megatron_focus.checkpoint import native

    tag_dir = native.checkpoint_tag_dir(load_dir)
    vocab_size, _ = native.checkpoint_vocabulary(tag_dir)
    _, model = native.load_native_model(tag_dir, vocab_size)
    with torch.no_grad():
        for _ in range(new_tokens):
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            logits = model(ids, positions, None)[..., :vocab_size]
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _corpus(embedded_cache):
    from megatron_focus.data.embedded import ensure_embedded_data
    from megatron_focus.data.readers import iter_records

    corpus = os.path.join(os.path.dirname(ensure_embedded_data(embedded_cache)[1]), "stdlib.jsonl")
    for i, (text,) in enumerate(iter_records([corpus], ["text"])):
        if i == CORPUS_DOCS:
            return
        yield text


def _export(name: str, tokenizers_by_kind, tmp_path):
    """`(checkpoint, HF folder or None if refused as expected, the training tokenizer)`."""
    from megatron_focus.hf import export_to_hf

    flags, kind, expected_class, _ = CASES[name]
    tokenizer_type, tokenizer_model = tokenizers_by_kind[kind]
    ckpt, hf = str(tmp_path / name / "ckpt"), str(tmp_path / name / "hf")
    ours = _random_checkpoint(ckpt, flags, tokenizer_type, tokenizer_model)
    if _transformers_major() < 5 and tokenizer_type != "HuggingFaceTokenizer":
        with pytest.raises(ValueError, match="needs transformers 5"):
            export_to_hf(ckpt, hf, progress=False)
        return ckpt, None, ours
    hf_class = export_to_hf(ckpt, hf, progress=False)  # no tokenizer flag: the recorded one
    custom = "MegatronFocusForCausalLM"
    assert hf_class == (custom if expected_class == "custom" else expected_class)
    return ckpt, hf, ours


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.slow] if case[3] else [])
        for name, case in CASES.items()
    ],
)
def test_export_is_exact_or_refused(name, tokenizers_by_kind, embedded_cache, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_focus.hf import native_logits

    ckpt, hf, ours = _export(name, tokenizers_by_kind, tmp_path)
    if hf is None:
        return
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).eval()
    inputs = tok(TEXT, return_tensors="pt")
    ids = inputs["input_ids"]
    assert ids[0].tolist() == ours.tokenize(TEXT)
    with torch.no_grad():
        logits = model(**inputs).logits
    torch.testing.assert_close(logits, native_logits(ckpt, ids), rtol=0, atol=1e-4)
    if type(model).__name__ == "MegatronFocusForCausalLM":  # the decoder alone: AutoModel,
        from transformers import AutoModel  # which serving engines build (docs/serving.md)

        decoder = AutoModel.from_pretrained(hf, trust_remote_code=True).eval()
        with torch.no_grad():
            hidden = decoder(ids).last_hidden_state
            torch.testing.assert_close(hidden, model.model(ids).last_hidden_state)

    model.generation_config.eos_token_id = None  # exactly NEW_TOKENS, no early stop
    generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
    assert generated.tolist() == _native_greedy(ckpt, ids, NEW_TOKENS).tolist()

    for text in _corpus(embedded_cache):
        assert tok(text)["input_ids"] == ours.tokenize(text), text[:80]
    assert tok.eos_token_id == ours.eod


# A folder holding transformers 4.57 (pip install --target; .ci/run makes one)
TRANSFORMERS4 = os.environ.get("MEGATRON_FOCUS_TRANSFORMERS4")


@pytest.mark.slow
@pytest.mark.skipif(
    not TRANSFORMERS4 or _transformers_major() < 5,
    reason="exports under transformers 5, loaded under MEGATRON_FOCUS_TRANSFORMERS4",
)
def test_exports_are_exact_in_transformers4(tokenizers_by_kind, tmp_path):
    """Folders exported under 5.x (SentencePiece tokenizers convert only there), loaded under
    4.57: `model(**tok(text))` and cached `generate(**tok(text))` as the native model."""
    from megatron_focus.hf import native_logits

    import hf_check

    names = [name for name, case in CASES.items() if not case[3]]
    exports = {name: _export(name, tokenizers_by_kind, tmp_path) for name in names}
    request = {
        "folders": [hf for _, hf, _ in exports.values()],
        "tokens": [list(range(16))],  # in every vocabulary
        "new_tokens": NEW_TOKENS,
        "text": TEXT,
    }
    result = hf_check.run_under(TRANSFORMERS4, request, tmp_path)
    assert result["transformers"].startswith("4.")
    for name, (ckpt, hf, ours) in exports.items():
        theirs = result["folders"][hf]
        assert theirs["ids"] == ours.tokenize(TEXT), name
        ids = torch.tensor([theirs["ids"]])
        outputs = theirs.get("soft", theirs.get("None"))  # the custom class's default mode
        logits = torch.tensor(outputs["text_logits"])
        torch.testing.assert_close(logits, native_logits(ckpt, ids), rtol=0, atol=1e-4)
        assert outputs["text_generated"] == _native_greedy(ckpt, ids, NEW_TOKENS).tolist(), name


def test_a_tokenizer_no_stock_class_loads_alike_is_refused_by_name(tmp_path, monkeypatch):
    """If no class's folder gives back the training tokenizer, the export stops and says why,
    having written nothing."""
    from megatron_focus.hf import export, export_to_hf

    folder = _bpe_folder(tmp_path / "tok", with_config=False)
    _random_checkpoint(str(tmp_path / "ckpt"), LLAMA + QKV_BIAS, "HuggingFaceTokenizer", folder)
    monkeypatch.setattr(
        export, "mismatch_as_loaded", lambda *args: "AutoTokenizer loads X, which encodes ..."
    )
    with pytest.raises(ValueError, match="tokenizer.json: AutoTokenizer loads X.*not exported"):
        export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)
    assert not (tmp_path / "hf").exists()
