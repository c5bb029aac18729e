"""Hugging Face interop: exported models compute what the native ones do, imports are exact.

Trained checkpoints (both families, standard and XSA, ZeRO-3, TP=2) are exported and compared
with the native model on the same tokens, and with the validation loss the training run itself
reported. HF models built from small configs (nothing is downloaded) go HF -> native -> HF.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from test_parallel import LLAMA
from test_training import _argv

os.environ["HF_HUB_OFFLINE"] = "1"

TOKENS = torch.randint(0, 4000, (2, 32), generator=torch.Generator().manual_seed(0))
GQA = ["--group-query-attention", "--num-query-groups", "2"]
XSA = ["--attention", "xsa"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# name: (flags, ranks, the HF class it exports to)
TRAINED = {
    "gpt2-zero3": (["--zero-stage", "3"], 1, "GPT2LMHeadModel"),
    "gpt2-xsa": (XSA + ["--xsa-layers", "2"], 1, "MegatronFocusForCausalLM"),
    "llama": (LLAMA + GQA, 1, "LlamaForCausalLM"),
    "llama-xsa": (LLAMA + GQA + XSA, 1, "MegatronFocusForCausalLM"),
    "llama-xsa-tp2": (LLAMA + GQA + XSA + TP2, 2, "MegatronFocusForCausalLM"),
}


def _train_and_batches(argv):
    """Train, then return the losses and the micro-batches of the first step and the validation."""
    from megatron_focus.arguments import parse_args
    from megatron_focus.training import trainer

    args = parse_args(argv)
    history = trainer.pretrain(args)
    train, valid = trainer._datasets(args, trainer._tokenizer(args, rank0=True))
    micro_batches = range(args.global_batch_size // args.micro_batch_size)  # one data-parallel rank
    history["train_batches"] = [trainer._micro_batch(train, 0, m, args) for m in micro_batches]
    history["valid_batches"] = [trainer._micro_batch(valid, 0, m, args) for m in micro_batches]
    return history


def _hf_loss(model, batches) -> float:
    """The trainer's loss (masked token mean per micro-batch, averaged) from an HF model."""
    losses = []
    with torch.no_grad():
        for batch in batches:
            logits = model(batch["tokens"]).logits
            per_token = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
            mask = batch["loss_mask"].float()
            losses.append(((per_token * mask).sum() / mask.sum()).item())
    return sum(losses) / len(losses)


def _load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()


@pytest.fixture(scope="module")
def trained(embedded_cache, tmp_path_factory):
    """Each TRAINED case: its checkpoint, HF export and training history."""
    from megatron_focus.hf import export_to_hf

    out = {}
    for name, (flags, ranks, _) in TRAINED.items():
        root = tmp_path_factory.mktemp(name)
        ckpt, hf = str(root / "ckpt"), str(root / "hf")
        history = run_distributed(_train_and_batches, ranks,
                                  _argv(embedded_cache, *flags, "--save", ckpt, iters=3))
        out[name] = {"ckpt": ckpt, "hf": hf, "history": history,
                     "class": export_to_hf(ckpt, hf, max_shard_size="100KB", progress=False)}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAINED))
def test_export_computes_what_the_native_model_computes(trained, name):
    from megatron_focus.hf import native_logits

    case = trained[name]
    assert case["class"] == TRAINED[name][2]
    model = _load_hf(case["hf"])
    assert type(model).__name__ == TRAINED[name][2]
    with torch.no_grad():
        diff = (model(TOKENS).logits - native_logits(case["ckpt"], TOKENS)).abs().max().item()
    assert diff < 1e-4
    # Independent of how the checkpoint is read back: the loss the training run reported.
    iteration, valid_loss = case["history"]["validation"][-1]
    assert iteration == 3
    assert _hf_loss(model, case["history"]["valid_batches"]) == pytest.approx(valid_loss, rel=1e-5)


@pytest.mark.slow
def test_tensor_parallel_export_equals_one_process_export(trained):
    from safetensors.torch import load_file

    def tensors(hf):
        out = {}
        for name in os.listdir(hf):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(hf, name)))
        return out

    tp1, tp2 = tensors(trained["llama-xsa"]["hf"]), tensors(trained["llama-xsa-tp2"]["hf"])
    assert tp1.keys() == tp2.keys()
    for name in tp1:
        torch.testing.assert_close(tp2[name], tp1[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-zero3", "llama-xsa"])
def test_exported_models_are_causal(trained, name):
    model = _load_hf(trained[name]["hf"])
    changed = TOKENS.clone()
    changed[:, 20:] = (changed[:, 20:] + 7) % 4000
    with torch.no_grad():
        before, after = model(TOKENS).logits, model(changed).logits
    torch.testing.assert_close(after[:, :20], before[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, 20:], before[:, 20:])


@pytest.mark.slow
def test_generate_with_cache_equals_argmax_of_full_forwards(trained):
    model = _load_hf(trained["gpt2-xsa"]["hf"])
    prompt = TOKENS[:, :8]
    model.generation_config.eos_token_id = None  # exactly 10 tokens, no early stop
    generated = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    tokens = prompt
    with torch.no_grad():
        for _ in range(10):
            next_token = model(tokens, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    assert torch.equal(generated, tokens)


@pytest.mark.slow
def test_exported_tokenizer_encodes_as_training_did(trained, embedded_cache):
    from transformers import AutoTokenizer

    from megatron_focus.data.embedded import TOKENIZER_TYPE, ensure_embedded_data
    from megatron_focus.data.readers import iter_records
    from megatron_focus.data.tokenizer import build_tokenizer

    hf = trained["llama"]["hf"]
    assert os.path.isfile(os.path.join(hf, "tokenizer.model"))
    ours = build_tokenizer(TOKENIZER_TYPE, ensure_embedded_data(embedded_cache)[1])
    theirs = AutoTokenizer.from_pretrained(hf)
    corpus = os.path.join(os.path.dirname(ensure_embedded_data(embedded_cache)[0]), "stdlib.jsonl")
    for i, (text,) in enumerate(iter_records([corpus], ["text"])):
        if i == 300:
            break
        assert theirs(text)["input_ids"] == ours.tokenize(text)
    assert theirs.eos_token_id == ours.eod


# --- HF -> native -> HF --------------------------------------------------------------------------

def _hf_model(name: str):
    """A small HF model of each kind the importer reads."""
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                              MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig
    from megatron_focus.hf.modeling_megatron_focus import MegatronFocusForCausalLM

    small = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4)
    return {
        "llama-gqa-untied": lambda: LlamaForCausalLM(LlamaConfig(
            **small, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
        "llama-biases-tied": lambda: LlamaForCausalLM(LlamaConfig(
            **small, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**small, num_key_value_heads=2,
                                                    sliding_window=None, head_dim=32)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**small, num_key_value_heads=2)),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=200, n_embd=64, n_layer=2, n_head=4,
                                           n_positions=32, activation_function="gelu")),
        # GPT-2 family with RoPE and GQA: no stock class, standard attention in the custom one
        "custom-gpt2-rope-gqa": lambda: MegatronFocusForCausalLM(MegatronFocusConfig(
            **small, num_key_value_heads=2, position_embedding_type="rope")),
        "custom-llama-xsa-layer-2": lambda: MegatronFocusForCausalLM(MegatronFocusConfig(
            **small, num_key_value_heads=1, normalization="RMSNorm", activation="swiglu",
            bias=False, position_embedding_type="rope", tie_word_embeddings=False,
            layer_attention=["standard", "xsa"])),
    }[name]()


HF_MODELS = ["llama-gqa-untied", "llama-biases-tied", "mistral", "qwen2", "gpt2",
             "custom-gpt2-rope-gqa", "custom-llama-xsa-layer-2"]


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_to_native_to_hf(name, tmp_path):
    from safetensors.torch import load_file

    from megatron_focus.hf import export_to_hf, import_from_hf, native_logits

    torch.manual_seed(0)
    model = _hf_model(name).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms and biases away from their 1 / 0 initialisation
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "hf")
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    import_from_hf(str(tmp_path / "hf"), ckpt, tensor_model_parallel_size=2, progress=False)

    tokens = TOKENS[:, :16] % 200
    with torch.no_grad():
        reference = model(tokens).logits
    assert (native_logits(ckpt, tokens) - reference).abs().max() < 1e-4

    # Mistral and Qwen2 come back as the Llama that computes the same (Qwen2's absent biases: 0)
    hf_class = export_to_hf(ckpt, back, progress=False)
    assert hf_class == ("LlamaForCausalLM" if name in ("mistral", "qwen2") else type(model).__name__)
    original, exported = (load_file(os.path.join(d, "model.safetensors"))
                          for d in (tmp_path / "hf", back))
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    added = exported.keys() - original.keys()
    assert added == (set() if name != "qwen2" else {
        f"model.layers.{i}.{m}.bias" for i in range(2)
        for m in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")})
    assert all(not exported[k].any() for k in added)


@pytest.mark.slow
def test_imported_model_trains_from_the_hf_loss(embedded_cache, tmp_path):
    """`pretrain_gpt.py --load` of an import (TP=2): its first loss is the HF model's, then it trains."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_focus.hf import export_to_hf, import_from_hf

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    model.save_pretrained(tmp_path / "hf")
    ckpt, trained, back = (str(tmp_path / d) for d in ("ckpt", "trained", "back"))
    flags = import_from_hf(str(tmp_path / "hf"), ckpt, tensor_model_parallel_size=2,
                           progress=False)
    history = run_distributed(_train_and_batches, 2, _argv(
        embedded_cache, *flags, "--tensor-model-parallel-size", "2", "--load", ckpt,
        "--save", trained, iters=3))
    assert history["losses"][0] == pytest.approx(_hf_loss(model, history["train_batches"]),
                                                 rel=1e-5)
    # The optimizer started from the imported weights (DeepSpeed's fp32 copy was refreshed):
    # three small Adam steps away from them, not back to a fresh initialisation.
    export_to_hf(trained, back, progress=False)
    exported = _load_hf(back).state_dict()
    moved = max((exported[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert 0 < moved < 1e-2


# --- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, message", [
    ({"model_type": "gpt2", "activation_function": "gelu_new"}, "tanh approximation"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                 "factor": 2.0}}, "RoPE scaling"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window 4096"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "bert"}, "not supported"),
])
def test_inexact_hf_models_are_refused(config, message, tmp_path):
    import json

    from transformers import AutoConfig

    from megatron_focus.hf import import_from_hf

    model_type = config.pop("model_type")
    AutoConfig.for_model(model_type, **config).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == model_type
    with pytest.raises(NotImplementedError, match=message):
        import_from_hf(str(tmp_path), str(tmp_path / "ckpt"), progress=False)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written


def test_unmapped_settings_are_refused():
    from megatron_focus.hf.architecture import Architecture

    model_args = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
        num_query_groups=4, kv_channels=16, normalization="LayerNorm", norm_epsilon=1e-5,
        swiglu=False, add_bias_linear=True, position_embedding_type="learned_absolute",
        rotary_base=10000, rotary_percent=1.0, max_position_embeddings=32,
        untie_embeddings_and_output_weights=False, attention="standard", xsa_layers=None)
    Architecture.from_model_args(model_args, 200)
    with pytest.raises(NotImplementedError, match="Focus is not mapped yet"):
        Architecture.from_model_args({**model_args, "attention": "focus"}, 200)
    with pytest.raises(NotImplementedError, match="partial rotary"):
        Architecture.from_model_args({**model_args, "rotary_percent": 0.5}, 200)
    with pytest.raises(ValueError, match="lacks norm_epsilon"):
        Architecture.from_model_args({k: v for k, v in model_args.items()
                                      if k != "norm_epsilon"}, 200)


def test_hf_tokenizer_json_is_exported(tmp_path):
    """A GPT-2-style byte-level BPE `tokenizer.json` comes out encoding as the training one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from megatron_focus.data.tokenizer import build_tokenizer
    from megatron_focus.hf.tokenizer import PROBES, save_hf_tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(PROBES * 10, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tmp_path / "tokenizer.json"))
    ours = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))
    ids = save_hf_tokenizer(ours, str(tmp_path / "hf"))
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert ids == {"eos_token_id": ours.eod, "pad_token_id": ours.pad}
    assert theirs.eos_token_id == ours.eod
    for text in ("Hello world, numbers 42", "unseen: Zürich ☃"):
        assert theirs(text)["input_ids"] == ours.tokenize(text)
