"""Hugging Face interop: exported models compute what the native ones do, imports are exact.

Trained checkpoints (both families, standard, XSA and Focus, ZeRO-3, TP=2) are exported and
compared with the native model on the same tokens, and with the validation loss the training run
itself reported; Focus in both of its modes, and generating with its incremental routing. HF
models built from small configs (nothing is downloaded) go HF -> native -> HF.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from megatron_focus.hf.families import rope_fields

from distributed import run_distributed
from tiny_runs import LLAMA, byte_level_bpe, tiny_argv

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
    # Sliding-window attention (8 keys of the 32 tokens): Mistral's
    "llama-window": (LLAMA + GQA + ["--window-size", "7,0"], 1, "MistralForCausalLM"),
    # zero-centred norm scales (exported as 1 + weight), Llama 3.1's RoPE scaling
    "llama-1p-rope-scaling": (
        LLAMA + GQA + ["--apply-layernorm-1p", "--use-rope-scaling", "--rotary-base", "500000"],
        1,
        "LlamaForCausalLM",
    ),
    # no stock class: query/key norms, squared ReLU, no positions (NoPE)
    "gpt2-qk-norm-relu2-nope-tp2": (
        ["--qk-layernorm", "--squared-relu", "--position-embedding-type", "none"] + TP2,
        2,
        "MegatronFocusForCausalLM",
    ),
}
# Focus with a window of 4 keys on 32 tokens: most pairs are distant, so the router decides them.
FOCUS = ["--focus-window", "4", "--focus-groups", "4", "--focus-chunk-size", "16"]
FOCUS_ONLY, FOCUS_XSA = ["--attention", "focus"] + FOCUS, ["--attention", "focus+xsa"] + FOCUS
TRAINED_FOCUS = {
    "gpt2-focus": (FOCUS_ONLY, 1, "MegatronFocusForCausalLM"),
    "gpt2-focus-xsa-layer-2": (FOCUS_XSA + ["--xsa-layers", "2"], 1, "MegatronFocusForCausalLM"),
    "llama-focus": (LLAMA + GQA + FOCUS_ONLY, 1, "MegatronFocusForCausalLM"),
    "llama-focus-xsa": (LLAMA + GQA + FOCUS_XSA, 1, "MegatronFocusForCausalLM"),
    "llama-focus-xsa-tp2": (LLAMA + GQA + FOCUS_XSA + TP2, 2, "MegatronFocusForCausalLM"),
    # The paper's gate, an ablation option
    "gpt2-focus-sigmoid-gate": (
        FOCUS_ONLY + ["--focus-gate", "sigmoid", "--focus-gate-scale", "3"],
        1,
        "MegatronFocusForCausalLM",
    ),
    # The first 3 tokens kept for every query
    "llama-focus-sinks": (
        LLAMA + GQA + FOCUS_ONLY + ["--focus-sink-tokens", "3"],
        1,
        "MegatronFocusForCausalLM",
    ),
}


def _train_and_batches(argv):
    """Train, then return the losses and the micro-batches of the first step and the validation."""
    from megatron_focus.data.loader import micro_batches
    from megatron_focus.data.sources import datasets_for, tokenizer_for
    from megatron_focus.training import trainer
    from megatron_focus.training.arguments import parse_args

    args = parse_args(argv)
    history = trainer.pretrain(args)
    train, valid = datasets_for(args, tokenizer_for(args, rank0=True))
    for name, data in (
        ("train_batches", train),
        ("valid_batches", valid),
    ):  # one data-parallel rank
        history[name] = list(
            micro_batches(data, 0, args.global_batch_size, args.micro_batch_size, 1, 0)
        )
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


def _train_and_export(cases, cache, tmp_path_factory):
    """Each case: its checkpoint, HF export and training history."""
    from megatron_focus.hf import export_to_hf

    out = {}
    for name, (flags, ranks, _) in cases.items():
        root = tmp_path_factory.mktemp(name)
        ckpt, hf = str(root / "ckpt"), str(root / "hf")
        history = run_distributed(
            _train_and_batches, ranks, tiny_argv(cache, *flags, "--save", ckpt, iters=3)
        )
        out[name] = {
            "ckpt": ckpt,
            "hf": hf,
            "history": history,
            "class": export_to_hf(ckpt, hf, max_shard_size="100KB", progress=False),
        }
    return out


@pytest.fixture(scope="module")
def trained(embedded_cache, tmp_path_factory):
    return _train_and_export(TRAINED, embedded_cache, tmp_path_factory)


@pytest.fixture(scope="module")
def trained_focus(embedded_cache, tmp_path_factory):
    return _train_and_export(TRAINED_FOCUS, embedded_cache, tmp_path_factory)


def _safetensors(hf) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in os.listdir(hf):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(hf, name)))
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
    tp1 = _safetensors(trained["llama-xsa"]["hf"])
    tp2 = _safetensors(trained["llama-xsa-tp2"]["hf"])
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


# --- Focus ---------------------------------------------------------------------------------------


def _focus_logits(model, tokens, mode, top_k=2):
    model.set_focus_mode(mode, top_k)
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAINED_FOCUS))
def test_focus_export_computes_what_the_native_model_computes(trained_focus, name):
    """Soft gate and hard top-k rule (the native packed sparse dispatch) alike, routers included."""
    from megatron_focus.hf import native_logits

    case = trained_focus[name]
    assert case["class"] == TRAINED_FOCUS[name][2]
    model = _load_hf(case["hf"])
    assert type(model).__name__ == TRAINED_FOCUS[name][2]
    config = model.config
    assert (
        config.focus_groups,
        config.focus_window,
        config.focus_top_k,
        config.focus_attention_mode,
    ) == (4, 4, 2, "soft")
    assert config.focus_gate == ("sigmoid" if name.endswith("sigmoid-gate") else "log")
    assert config.layer_attention == {
        "gpt2-focus": ["focus", "focus"],
        "gpt2-focus-xsa-layer-2": ["focus", "focus+xsa"],
        "llama-focus": ["focus", "focus"],
        "gpt2-focus-sigmoid-gate": ["focus", "focus"],
        "llama-focus-sinks": ["focus", "focus"],
    }.get(name, ["focus+xsa", "focus+xsa"])
    assert config.focus_sink_tokens == (3 if name.endswith("sinks") else 0)
    routers = [k for k in model.state_dict() if ".router." in k]
    assert len(routers) == 4  # W_g and the centroids of each layer

    soft = _focus_logits(model, TOKENS, "soft")
    assert (soft - native_logits(case["ckpt"], TOKENS)).abs().max().item() < 1e-4
    iteration, valid_loss = case["history"]["validation"][-1]  # the run validates in soft mode
    assert iteration == 3
    assert _hf_loss(model, case["history"]["valid_batches"]) == pytest.approx(valid_loss, rel=1e-5)

    for top_k in (2, 1) if name == "llama-focus-xsa" else (2,):
        sparse = _focus_logits(model, TOKENS, "sparse", top_k)
        native = native_logits(
            case["ckpt"], TOKENS, focus_attention_mode="sparse", focus_top_k=top_k
        )
        assert (sparse - native).abs().max().item() < 1e-4
        assert not torch.allclose(sparse, soft, atol=1e-3)  # the rule removed distant pairs


@pytest.mark.slow
def test_tensor_parallel_focus_export_equals_one_process_export(trained_focus):
    tp1 = _safetensors(trained_focus["llama-focus-xsa"]["hf"])
    tp2 = _safetensors(trained_focus["llama-focus-xsa-tp2"]["hf"])
    assert tp1.keys() == tp2.keys()
    assert any(".router." in name for name in tp1)
    for name in tp1:
        torch.testing.assert_close(tp2[name], tp1[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["soft", "sparse"])
@pytest.mark.parametrize("name", ["gpt2-focus-xsa-layer-2", "llama-focus-xsa"])
def test_focus_exports_are_causal(trained_focus, name, mode):
    model = _load_hf(trained_focus[name]["hf"])
    changed = TOKENS.clone()
    changed[:, 20:] = (changed[:, 20:] + 7) % 4000
    before, after = _focus_logits(model, TOKENS, mode), _focus_logits(model, changed, mode)
    torch.testing.assert_close(after[:, :20], before[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, 20:], before[:, 20:])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sparse", "soft"])
@pytest.mark.parametrize("name", ["gpt2-focus-xsa-layer-2", "llama-focus-xsa"])
def test_focus_generate_routes_incrementally_as_a_full_forward(trained_focus, name, mode):
    """generate() with the cache == greedy full forwards; cached assignments == a full pass's."""
    from transformers import DynamicCache

    model = _load_hf(trained_focus[name]["hf"])
    model.set_focus_mode(mode)
    model.generation_config.eos_token_id = None  # exactly 20 tokens, no early stop
    prompt, new = TOKENS[:, :8], 20  # 28 tokens, window 4: most pairs distant
    out = model.generate(
        prompt, max_new_tokens=new, do_sample=False, use_cache=True, return_dict_in_generate=True
    )
    tokens = prompt
    with torch.no_grad():
        for _ in range(new):
            next_token = model(tokens, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
        assert torch.equal(out.sequences, tokens)

        full = DynamicCache(config=model.config)  # one forward over every token the cache saw
        model(tokens[:, :-1], cache=full)
    for layer, (step, whole) in enumerate(zip(out.cache.layers, full.layers)):
        assert step.sums.shape[:2] == whole.sums.shape[:2] == (2, 8 + new - 1), layer
        torch.testing.assert_close(step.sums, whole.sums, rtol=0, atol=1e-5)
        if mode == "soft":
            torch.testing.assert_close(step.log_g, whole.log_g, rtol=0, atol=1e-5)
            assert torch.equal(step.groups, whole.groups)
            continue
        # sparse: each key filed under the same group, in position order, as one pass files it
        assert step.buckets.counts == whole.buckets.counts, layer
        for row, counts in enumerate(step.buckets.counts):
            for bucket, n in filter(lambda held: held[1], enumerate(counts)):
                one, other = step.buckets.stores[bucket], whole.buckets.stores[bucket]
                assert torch.equal(one[2][row, :n], other[2][row, :n])
                torch.testing.assert_close(one[0][row, :, :n], other[0][row, :, :n])


def _custom_focus_model(**overrides):
    """A small random Focus model of the Llama family (RoPE, GQA), XSA on its second layer."""
    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig
    from megatron_focus.hf.modeling_megatron_focus import MegatronFocusForCausalLM

    config = dict(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        normalization="RMSNorm",
        activation="swiglu",
        bias=False,
        position_embedding_type="rope",
        tie_word_embeddings=False,
        layer_attention=["focus", "focus+xsa"],
        focus_groups=4,
        focus_window=4,
        focus_tau=0.5,
        focus_sinkhorn_iters=3,
    )
    return MegatronFocusForCausalLM(MegatronFocusConfig(**{**config, **overrides}))


def _every_variant_model(**overrides):
    """`_custom_focus_model` with four layers: standard, XSA, Focus, Focus + XSA."""
    return _custom_focus_model(
        num_hidden_layers=4, layer_attention=["standard", "xsa", "focus", "focus+xsa"], **overrides
    )


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("mode", ["soft", "sparse"])
def test_generate_left_padded_batch_equals_each_sequence(mode, sinks):
    """Padding is no token to the router, nor a sink: left-padded batches generate as each
    sequence alone, in every attention variant."""
    torch.manual_seed(0)
    model = _every_variant_model(focus_sink_tokens=sinks).eval()
    model.set_focus_mode(mode)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    long, short = TOKENS[0, :10] % 200, TOKENS[1, :6] % 200
    batch = torch.stack([long, torch.cat([torch.zeros(4, dtype=torch.long), short])])
    mask = (torch.arange(10) >= torch.tensor([[0], [4]])).long()
    together = model.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False)
    for row, prompt in enumerate((long, short)):
        alone = model.generate(prompt[None], max_new_tokens=12, do_sample=False)
        assert torch.equal(together[row, -12:], alone[0, -12:])


@pytest.mark.parametrize("mode", ["soft", "sparse"])
def test_routing_state_follows_beam_search_and_crop(mode):
    """The routing state is per token, as keys and values: beams reorder it, crop cuts it."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    model = _every_variant_model().eval()
    model.set_focus_mode(mode)
    model.generation_config.eos_token_id = None
    prompt, tokens = TOKENS[:, :6] % 200, TOKENS[:, :20] % 200
    beams = {
        cached: model.generate(
            prompt, max_new_tokens=10, num_beams=3, do_sample=False, use_cache=cached
        )
        for cached in (True, False)
    }
    assert torch.equal(beams[True], beams[False])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        whole = model(tokens, cache=cache).logits
        cache.crop(-5)
        assert cache.layers[3].get_seq_length() == cache.layers[3].sums.shape[1] == 15
        again = model(tokens[:, 15:], cache=cache).logits
    torch.testing.assert_close(again, whole[:, 15:], rtol=0, atol=1e-5)


@pytest.mark.skipif(
    int(__import__("transformers").__version__.split(".")[0]) >= 5,
    reason="transformers 5 generates with a static cache (tests/hf/test_static_cache.py)",
)
def test_a_static_cache_is_refused_clearly_under_transformers_4():
    """Its StaticLayer takes positions this model does not pass: refused before any compute."""
    model = _every_variant_model().eval()
    with pytest.raises(ValueError, match="static cache needs transformers 5"):
        model.generate(TOKENS[:1, :6] % 200, max_new_tokens=2, do_sample=False,
                       cache_implementation="static")  # fmt: skip


@pytest.mark.parametrize("mode", ["soft", "sparse"])
def test_assisted_generation_crops_to_greedy(mode, monkeypatch):
    """Prompt-lookup decoding drafts tokens and crops the rejected ones from the cache (in
    sparse mode from the groups' keys too, and the window's rebuilt): greedy's tokens."""
    from megatron_focus.hf import modeling_megatron_focus as hf

    torch.manual_seed(0)
    model = _every_variant_model().eval()
    model.set_focus_mode(mode)
    model.generation_config.eos_token_id = 199  # transformers 4's lookup needs one
    crops, layer = [], hf.FocusSparseCacheLayer if mode == "sparse" else hf.FocusCacheLayer
    crop = layer.crop
    monkeypatch.setattr(layer, "crop", lambda *a: crops.append(a[1]) or crop(*a))
    prompt = (TOKENS[:1, :6] % 200).repeat(1, 4)  # repeats: lookup finds drafts
    greedy = model.generate(prompt, max_new_tokens=24, do_sample=False)
    assisted = model.generate(
        prompt, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3
    )
    assert torch.equal(assisted, greedy)
    assert any(crops), "no draft was rejected: the crop went untested"


def test_sparse_cache_expands_and_selects_rows():
    """Batch expansion and selection (contrastive search, beams) copy every row's buckets:
    rows decoded apart afterwards are each a full forward."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    model = _every_variant_model().eval()
    model.set_focus_mode("sparse")
    prompt, ends = TOKENS[:1, :20] % 200, torch.tensor([[5], [7], [9]])
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, cache=cache)
        cache.batch_repeat_interleave(3)
        cache.batch_select_indices(torch.tensor([0, 2]))
        step = model(ends[[0, 2]], cache=cache).logits[:, -1]
        whole = model(torch.cat([prompt.expand(2, -1), ends[[0, 2]]], 1)).logits[:, -1]
    torch.testing.assert_close(step, whole, rtol=0, atol=1e-5)


def test_a_cache_goes_on_in_its_own_mode():
    """Soft mode's cache holds no groups' buckets, sparse mode's no keys beyond the window: a
    cache filled in one mode is refused by name in the other."""
    from transformers import DynamicCache

    model = _every_variant_model().eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(TOKENS[:, :8] % 200, cache=cache)
        model.set_focus_mode("sparse")
        with pytest.raises(ValueError, match="soft mode; sparse mode needs a new cache"):
            model(TOKENS[:, 8:9] % 200, cache=cache)


@pytest.mark.parametrize("mode", ["soft", "sparse"])
def test_cache_given_as_past_key_values_is_used(mode):
    """`past_key_values=`, as callers of the stock classes pass it, continues the sequence."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    model = _every_variant_model().eval()
    model.set_focus_mode(mode)
    tokens = TOKENS[:, :12] % 200
    with torch.no_grad():
        whole = model(tokens).logits
        first = model(tokens[:, :9], use_cache=True)
        rest = model(tokens[:, 9:], past_key_values=first.past_key_values, use_cache=True)
        torch.testing.assert_close(rest.logits, whole[:, 9:], rtol=0, atol=1e-5)
        assert rest.past_key_values.get_seq_length() == 12
        with pytest.raises(ValueError, match="not both"):
            model(
                tokens[:, 9:],
                cache=DynamicCache(config=model.config),
                past_key_values=DynamicCache(config=model.config),
            )


@pytest.mark.parametrize("mode", ["soft", "sparse"])
def test_sampled_generation_scores_are_the_full_forward_logits(mode):
    """Sampling with the cache: each step's logits equal a full forward's over the sequence so
    far, and the same seed samples the same tokens without the cache."""
    torch.manual_seed(0)
    model = _every_variant_model().eval()
    model.set_focus_mode(mode)
    model.generation_config.eos_token_id = None
    prompt, new = TOKENS[:, :6] % 200, 10
    runs = {}
    for cached in (True, False):
        torch.manual_seed(1)
        runs[cached] = model.generate(
            prompt,
            max_new_tokens=new,
            do_sample=True,
            top_k=0,
            use_cache=cached,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    with torch.no_grad():
        full = model(runs[True].sequences[:, :-1], use_cache=False).logits[:, -new:]
    torch.testing.assert_close(torch.stack(runs[True].logits, 1), full, rtol=0, atol=1e-5)


def test_focus_mode_chosen_from_a_folder_or_a_generate_call(tmp_path):
    """A stack that only passes a folder and keyword arguments chooses the Focus rule: config
    overrides at load, the generation config, or generate's own keywords (then undone)."""
    from transformers import GenerationConfig

    torch.manual_seed(0)
    model = _every_variant_model().eval()
    cls = type(model)
    model.generation_config.eos_token_id = None
    prompt = TOKENS[:, :6] % 200
    expected = {}
    for mode, top_k in (("soft", 2), ("sparse", 1)):
        model.set_focus_mode(mode, top_k)
        expected[mode] = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert not torch.equal(expected["soft"], expected["sparse"])  # the rule matters here
    model.set_focus_mode("soft", 2)
    model.save_pretrained(tmp_path / "soft")

    def generate(**kwargs):
        return model.generate(prompt, max_new_tokens=8, do_sample=False, **kwargs)

    assert torch.equal(generate(focus_attention_mode="sparse", focus_top_k=1), expected["sparse"])
    assert torch.equal(
        model.generate(
            prompt,
            generation_config=GenerationConfig(
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                focus_attention_mode="sparse",
                focus_top_k=1,
            ),
        ),
        expected["sparse"],
    )
    assert (model.config.focus_attention_mode, model.config.focus_top_k) == ("soft", 2)
    assert torch.equal(generate(), expected["soft"])

    loaded = cls.from_pretrained(
        tmp_path / "soft", focus_attention_mode="sparse", focus_top_k=1
    ).eval()
    assert (loaded.config.focus_attention_mode, loaded.config.focus_top_k) == ("sparse", 1)
    model.generation_config = GenerationConfig(focus_attention_mode="sparse", focus_top_k=1)
    model.save_pretrained(tmp_path / "sparse")  # generation_config.json holds the rule
    loaded = cls.from_pretrained(tmp_path / "sparse").eval()
    assert loaded.config.focus_attention_mode == "soft"
    assert torch.equal(
        loaded.generate(prompt, max_new_tokens=8, do_sample=False), expected["sparse"]
    )


@pytest.mark.parametrize(
    "backend",
    [
        "sdpa",
        # On the CPU, torch 2.13's compiled FlexAttention aborts the process (heap corruption) for
        # any score_mod that reads a tensor, as transformers' flex_attention_forward does with a
        # mask; benchmarks/gpu_session.sh runs this case on a GPU.
        pytest.param(
            "flex_attention",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="compiled FlexAttention with a score mask: GPU",
            ),
        ),
    ],
)
def test_attention_backends_compute_what_eager_computes(backend):
    """attn_implementation reaches every layer's softmax through transformers' attention
    interface (a registered backend counts its calls) and changes no logit: every variant,
    both Focus modes, a left-padded batch, and decoding with the cache. The sparse rule's
    layers compute their kept pairs themselves (partial attentions merged by log-sum-exp,
    which no backend returns)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []

    def counted(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return ALL_ATTENTION_FUNCTIONS[backend](module, *args, **kwargs)

    AttentionInterface.register("counted", counted)
    torch.manual_seed(0)
    device = "cuda" if backend == "flex_attention" else "cpu"
    model = _every_variant_model().eval().to(device)
    tokens = (TOKENS[:, :12] % 200).to(device)
    mask = (torch.arange(12) >= torch.tensor([[0], [3]])).long().to(device)
    with torch.no_grad():
        for mode in ("soft", "sparse"):
            model.set_focus_mode(mode)
            logits = {}
            for name in ("eager", "counted"):
                model.set_attn_implementation(name)
                whole = model(tokens, attention_mask=mask).logits
                first = model(tokens[:, :9], attention_mask=mask[:, :9], use_cache=True)
                rest = model(
                    tokens[:, 9:],
                    attention_mask=mask,
                    past_key_values=first.past_key_values,
                    use_cache=True,
                ).logits
                logits[name] = torch.cat([whole, first.logits, rest], dim=1)
            torch.testing.assert_close(logits["counted"], logits["eager"], rtol=0, atol=1e-5)
    focus_layers = sum(kind.startswith("focus") for kind in model.config.layer_attention)
    assert sorted(set(calls)) == [0, 1, 2, 3] and len(calls) == 3 * 4 + 3 * (4 - focus_layers)


@pytest.mark.parametrize("backend", ["sdpa", "flex_attention"])
def test_a_batch_mask_is_copied_per_row_for_flex_alone(backend, monkeypatch):
    """The standard and XSA layers hand the attention function a broadcast view of one row's
    additive mask (no copy per batch row); flex_attention, which reads the mask as a tensor of
    its own, gets one contiguous mask per row from every layer. The function under the
    backend's name records the masks and computes eager attention (compiled FlexAttention with a
    mask aborts on this CPU: see above), so the logits are eager's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from megatron_focus.hf.modeling_megatron_focus import eager_attention_forward

    masks = []

    def recording(module, q, k, v, mask, **kwargs):
        masks.append((module.layer_idx, mask))
        return eager_attention_forward(module, q, k, v, mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, backend, recording)
    torch.manual_seed(0)
    model = _every_variant_model().eval()
    tokens = torch.cat([TOKENS, TOKENS.flip(0)])[:, :12] % 200  # a batch of 4
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(tokens).logits
        model.config._attn_implementation = backend
        logits = model(tokens).logits
    assert [layer for layer, _ in masks] == [0, 1, 2, 3]  # Focus's soft gate: a mask per row
    for layer, mask in masks:
        assert mask.shape == (4, 1, 12, 12)
        if backend == "flex_attention":
            assert mask.is_contiguous(), layer
        elif layer < 2:  # the standard and the XSA layer: one row's causal mask
            assert mask.stride(0) == 0, layer
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


# Four variants x both families, Mistral's window and Llama 3.1's RoPE: what a serving stack
# pinned to transformers 4 (vLLM, TGI, lm-evaluation-harness) loads.
IN_TRANSFORMERS4 = [
    "gpt2-zero3",
    "gpt2-xsa",
    "llama",
    "llama-xsa",
    "llama-window",
    "llama-1p-rope-scaling",
    "gpt2-focus",
    "gpt2-focus-xsa-layer-2",
    "llama-focus",
    "llama-focus-xsa",
]
# A folder holding transformers 4.57 (pip install --target; .ci/run makes one)
TRANSFORMERS4 = os.environ.get("MEGATRON_FOCUS_TRANSFORMERS4")


@pytest.mark.slow
@pytest.mark.skipif(not TRANSFORMERS4, reason="MEGATRON_FOCUS_TRANSFORMERS4 is not set")
def test_exports_load_and_generate_alike_in_transformers4(trained, trained_focus, tmp_path):
    """Each export, with its tokenizer, gives under transformers 4.57 the logits, greedy
    generations (with and without the cache) and token ids it gives under 5.x."""
    import hf_check

    folders = [{**trained, **trained_focus}[name]["hf"] for name in IN_TRANSFORMERS4]
    request = {
        "folders": folders,
        "tokens": TOKENS[:, :24].tolist(),
        "new_tokens": 6,
        "text": "Hello world, and a second sentence.",
    }
    result = hf_check.run_under(TRANSFORMERS4, request, tmp_path)
    assert result["transformers"].startswith("4.")
    tokens = torch.tensor(request["tokens"])
    for folder in folders:
        theirs = result["folders"][folder]
        ours = hf_check.check(folder, tokens, request["text"], request["new_tokens"])
        assert theirs["class"] == ours["class"] and theirs["ids"] == ours["ids"], folder
        for mode in ours.keys() - {"class", "ids"}:
            for logits in ("logits", "text_logits"):
                torch.testing.assert_close(
                    torch.tensor(theirs[mode][logits]),
                    torch.tensor(ours[mode][logits]),
                    rtol=0,
                    atol=1e-5,
                )
            assert theirs[mode]["text_generated"] == ours[mode]["text_generated"], folder
            generated = theirs[mode]["generated"]
            assert generated["true"] == generated["false"] == ours[mode]["generated"][True], (
                folder,
                mode,
            )


def test_focus_mode_and_settings_are_checked():
    model = _custom_focus_model().eval()
    with pytest.raises(ValueError, match="focus_attention_mode='hard'"):
        model.set_focus_mode("hard")
    with pytest.raises(ValueError, match="focus_top_k=5"):
        model.set_focus_mode("sparse", top_k=5)
    assert (model.config.focus_attention_mode, model.config.focus_top_k) == ("soft", 2)
    model.config.focus_attention_mode = "dense"  # set directly: refused at the next forward
    with pytest.raises(ValueError, match="focus_attention_mode='dense'"):
        model(TOKENS[:, :8] % 200)


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
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig
    from megatron_focus.hf.modeling_megatron_focus import MegatronFocusForCausalLM

    small = dict(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    return {
        "llama-gqa-untied": lambda: LlamaForCausalLM(
            LlamaConfig(
                **small,
                num_key_value_heads=2,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
                **rope_fields({"rope_type": "default", "rope_theta": 500000.0}),
            )
        ),
        "llama-biases-tied": lambda: LlamaForCausalLM(
            LlamaConfig(**small, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
        ),
        "mistral": lambda: MistralForCausalLM(
            MistralConfig(**small, num_key_value_heads=2, sliding_window=None, head_dim=32)
        ),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**small, num_key_value_heads=2)),
        # Mistral-7B-v0.1's shape of window: 8 keys, on 16 tokens
        "mistral-window": lambda: MistralForCausalLM(
            MistralConfig(**small, num_key_value_heads=2, sliding_window=8, head_dim=16)
        ),
        "gpt2": lambda: GPT2LMHeadModel(
            GPT2Config(
                vocab_size=200,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=32,
                activation_function="gelu",
            )
        ),
        # the real GPT-2's activation (tanh GELU): --openai-gelu
        "gpt2-gelu-new": lambda: GPT2LMHeadModel(
            GPT2Config(vocab_size=200, n_embd=64, n_layer=2, n_head=4, n_positions=32)
        ),
        "custom-gpt2-rope-gelu-tanh": lambda: MegatronFocusForCausalLM(
            MegatronFocusConfig(**small, position_embedding_type="rope", activation="gelu_tanh")
        ),
        # GPT-2 family with RoPE and GQA: no stock class, standard attention in the custom one
        "custom-gpt2-rope-gqa": lambda: MegatronFocusForCausalLM(
            MegatronFocusConfig(**small, num_key_value_heads=2, position_embedding_type="rope")
        ),
        "custom-llama-xsa-layer-2": lambda: MegatronFocusForCausalLM(
            MegatronFocusConfig(
                **small,
                num_key_value_heads=1,
                normalization="RMSNorm",
                activation="swiglu",
                bias=False,
                position_embedding_type="rope",
                tie_word_embeddings=False,
                layer_attention=["standard", "xsa"],
            )
        ),
        # XSA with a sliding window of 8 keys, on 16 tokens: the custom model's window
        "custom-llama-xsa-window": lambda: MegatronFocusForCausalLM(
            MegatronFocusConfig(
                **small,
                num_key_value_heads=2,
                normalization="RMSNorm",
                activation="swiglu",
                bias=False,
                position_embedding_type="rope",
                layer_attention=["xsa", "xsa"],
                sliding_window=8,
            )
        ),
        # a Qwen2 retrofitted with XSA: the QKV bias alone
        "custom-qwen2-xsa": lambda: MegatronFocusForCausalLM(
            MegatronFocusConfig(
                **small,
                num_key_value_heads=2,
                normalization="RMSNorm",
                activation="swiglu",
                bias=False,
                qkv_bias=True,
                position_embedding_type="rope",
                layer_attention=["xsa", "xsa"],
            )
        ),
        # Focus (routers replicated over TP=2), XSA on the second layer
        "custom-llama-focus-xsa-layer-2": _custom_focus_model,
        # Llama 3.1's RoPE scaling (head size 16, base 5e5: every band of the scaling is used)
        "llama31-rope-scaling": lambda: LlamaForCausalLM(
            LlamaConfig(**small, num_key_value_heads=2, **rope_fields(LLAMA31_ROPE))
        ),
        "custom-gpt2-qk-norm-relu2-nope": lambda: MegatronFocusForCausalLM(
            MegatronFocusConfig(
                **small, qk_norm=True, activation="relu2", position_embedding_type="none"
            )
        ),
        "custom-llama-xsa-qk-norm-rope-scaling": lambda: MegatronFocusForCausalLM(
            MegatronFocusConfig(
                **small,
                normalization="RMSNorm",
                activation="swiglu",
                bias=False,
                position_embedding_type="rope",
                rotary_base=500000.0,
                qk_norm=True,
                llama3_rope_scaling={
                    k: v for k, v in LLAMA31_ROPE.items() if k not in ("rope_type", "rope_theta")
                },
                layer_attention=["xsa", "xsa"],
            )
        ),
    }[name]()


LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


HF_MODELS = [
    "llama-gqa-untied",
    "llama-biases-tied",
    "mistral",
    "mistral-window",
    "qwen2",
    "gpt2",
    "gpt2-gelu-new",
    "custom-gpt2-rope-gelu-tanh",
    "custom-gpt2-rope-gqa",
    "custom-llama-xsa-layer-2",
    "custom-llama-xsa-window",
    "custom-qwen2-xsa",
    "custom-llama-focus-xsa-layer-2",
    "llama31-rope-scaling",
    "custom-gpt2-qk-norm-relu2-nope",
    "custom-llama-xsa-qk-norm-rope-scaling",
]


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

    if "rope-scaling" in name:  # its effect on 16 positions is small: check it is recorded
        with open(os.path.join(ckpt, "iter_0000000", "model_args.json")) as f:
            assert json.load(f)["use_rope_scaling"]
    tokens = TOKENS[:, :16] % 200
    with torch.no_grad():
        reference = model(tokens).logits
    assert (native_logits(ckpt, tokens) - reference).abs().max() < 1e-4

    # Each comes back as its own class, but a Mistral without a window: the Llama it computes
    hf_class = export_to_hf(ckpt, back, progress=False)
    assert hf_class == ("LlamaForCausalLM" if name == "mistral" else type(model).__name__)
    original, exported = (
        load_file(os.path.join(d, "model.safetensors")) for d in (tmp_path / "hf", back)
    )
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    if name == "mistral-window":
        with open(os.path.join(back, "config.json")) as f:
            assert json.load(f)["sliding_window"] == 8
    if name.startswith("custom-"):  # the family it extends, named
        with open(os.path.join(back, "config.json")) as f:
            assert json.load(f)["family"] == (
                "mistral" if name.endswith("-window") else name.split("-")[1]
            )
    # the special ids the original config gave, where they name a token (GPT-2's 50256 does not)
    with open(tmp_path / "hf" / "config.json") as f, open(tmp_path / "back" / "config.json") as g:
        before, after = json.load(f), json.load(g)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        kept = before.get(key) if isinstance(before.get(key), int) and before[key] < 200 else None
        assert after.get(key) == kept, key
    for key in SHAPE_FIELDS:  # and every field that says what the model computes
        if key in before:
            assert after.get(key) == before[key], key


SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "n_embd",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "n_inner",
    "hidden_act",
    "activation_function",
    "rms_norm_eps",
    "layer_norm_epsilon",
    "norm_eps",
    "max_position_embeddings",
    "n_positions",
    "tie_word_embeddings",
    "sliding_window",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "llama3_rope_scaling",
    "attention_bias",
    "mlp_bias",
    "layer_attention",
    "normalization",
    "activation",
    "bias",
    "qkv_bias",
    "qk_norm",
    "position_embedding_type",
    "rotary_base",
) + tuple(
    f"focus_{name}"
    for name in ("groups", "dim", "window", "tau", "sinkhorn_iters", "gate_scale", "gate")
)


def test_llama31_rope_frequencies_agree_three_ways():
    """Megatron-Core's scaled RoPE frequencies (--use-rope-scaling), transformers' "llama3" ones
    and the exported custom model's: the same, in every band of the scaling."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_focus.hf.modeling_megatron_focus import llama3_scaled

    dim = 64
    for base in (10000.0, 500000.0):
        plain = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        megatron = RotaryEmbedding(
            dim,
            1.0,
            rotary_base=base,
            rope_scaling=True,
            rope_scaling_factor=8.0,
            use_cpu_initialization=True,
        ).inv_freq
        config = LlamaConfig(
            hidden_size=dim * 2,
            num_attention_heads=2,
            max_position_embeddings=8192,
            **rope_fields({**LLAMA31_ROPE, "rope_theta": base}),
        )
        hf, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        ours = llama3_scaled(plain, LLAMA31_ROPE)
        assert not torch.equal(ours, plain)
        torch.testing.assert_close(megatron, hf, rtol=1e-6, atol=0)
        torch.testing.assert_close(ours, hf, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_imported_model_trains_from_the_hf_loss(embedded_cache, tmp_path):
    """`pretrain_gpt.py --load` of an import (TP=2): its first loss is the HF model's, then it
    trains."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_focus.hf import export_to_hf, import_from_hf

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=4096,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).eval()
    model.save_pretrained(tmp_path / "hf")
    ckpt, trained, back = (str(tmp_path / d) for d in ("ckpt", "trained", "back"))
    flags = import_from_hf(str(tmp_path / "hf"), ckpt, tensor_model_parallel_size=2, progress=False)
    history = run_distributed(
        _train_and_batches,
        2,
        tiny_argv(
            embedded_cache,
            *flags,
            "--tensor-model-parallel-size",
            "2",
            "--load",
            ckpt,
            "--save",
            trained,
            iters=3,
        ),
    )
    assert history["losses"][0] == pytest.approx(
        _hf_loss(model, history["train_batches"]), rel=1e-5
    )
    # The optimizer started from the imported weights (DeepSpeed's fp32 copy was refreshed):
    # three small Adam steps away from them, not back to a fresh initialisation.
    export_to_hf(trained, back, progress=False)
    exported = _load_hf(back).state_dict()
    moved = max((exported[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert 0 < moved < 1e-2


@pytest.mark.slow
def test_focus_retrofit_of_an_imported_model(embedded_cache, tmp_path):
    """`convert_from_hf --attention focus` writes the base model; `pretrain_gpt.py --retrofit
    --load` adds fresh routers and trains only them; the result exports as a Focus model."""
    import json
    import math

    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_focus.hf import export_to_hf, import_from_hf, native_logits

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=4096,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).eval()
    model.save_pretrained(tmp_path / "hf")
    ckpt, retrofitted, back = (str(tmp_path / d) for d in ("ckpt", "retrofitted", "back"))
    flags = import_from_hf(str(tmp_path / "hf"), ckpt, attention="focus", progress=False)
    assert flags[flags.index("--attention") + 1] == "focus" and flags[-1] == "--retrofit"
    tag = os.path.join(ckpt, "iter_0000000")
    with open(os.path.join(tag, "model_args.json")) as f:
        assert json.load(f)["attention"] == "standard"  # as an import with --attention standard
    shard = torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=False)
    assert not any(".router." in name for name in shard["module"])

    history = run_distributed(
        _train_and_batches,
        1,
        tiny_argv(embedded_cache, *flags, *FOCUS, "--load", ckpt, "--save", retrofitted, iters=3),
    )
    assert len(history["losses"]) == 3 and all(math.isfinite(x) for x in history["losses"])
    assert export_to_hf(retrofitted, back, progress=False) == "MegatronFocusForCausalLM"
    hf_model = _load_hf(back)
    exported = hf_model.state_dict()
    assert len([name for name in exported if ".router." in name]) == 4
    # The checkpoint holds the routers only; read through its base, it runs as the export does.
    tokens = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    diff = (hf_model(tokens).logits - native_logits(retrofitted, tokens)).abs().max().item()
    assert diff < 1e-4
    for name, tensor in model.state_dict().items():  # every original weight frozen, bit for bit
        assert torch.equal(exported[name], tensor), name


def test_focus_ties_route_alike_in_export_and_native_dispatch(tmp_path, forbid_topk):
    """Exact ties everywhere (duplicated centroids tie groups 2j and 2j + 1 in every token's
    assignment; token 0's is uniform): for every top-k of K = 8, the HF model keeps the pairs the
    native sparse dispatch keeps, and neither asks torch.topk."""
    from megatron_focus.hf import import_from_hf, native_logits

    torch.manual_seed(0)
    model = _custom_focus_model(focus_groups=8).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            centroids = layer.self_attn.router.centroids
            centroids[1::2] = centroids[0::2]
    model.save_pretrained(tmp_path / "hf")
    ckpt = str(tmp_path / "ckpt")
    import_from_hf(str(tmp_path / "hf"), ckpt, progress=False)
    forbid_topk()
    tokens = TOKENS[:, :24] % 200
    logits = {}
    for top_k in range(1, 9):
        logits[top_k] = _focus_logits(model, tokens, "sparse", top_k)
        native = native_logits(ckpt, tokens, focus_attention_mode="sparse", focus_top_k=top_k)
        assert (logits[top_k] - native).abs().max().item() < 1e-4, top_k
    # The tied partner of a top-1 group is nobody's top-1: top-2 keeps what top-1 keeps.
    torch.testing.assert_close(logits[2], logits[1], rtol=0, atol=1e-6)
    assert not torch.allclose(logits[3], logits[1], atol=1e-4)


def test_focus_model_imports_as_focus_only(tmp_path):
    from megatron_focus.hf import import_from_hf

    _custom_focus_model().save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="would drop them"):
        import_from_hf(
            str(tmp_path / "hf"), str(tmp_path / "ckpt"), attention="xsa", progress=False
        )


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "gpt2", "activation_function": "relu"}, "'relu': only the exact GELU"),
        (
            {
                "model_type": "llama",
                **rope_fields({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
            },
            "RoPE scaling",
        ),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "bert"}, "not supported"),
    ],
)
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


def test_an_unknown_hf_layer_kind_is_refused_by_name():
    """A layer kind the importer does not know (a newer modeling file's, say) is refused, not
    imported as standard attention."""
    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig
    from megatron_focus.hf.families import from_hf_config

    config = MegatronFocusConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    config.layer_attention = ["standard", "mamba"]
    with pytest.raises(
        ValueError,
        match=r"layer_attention 'mamba': a layer kind the importer does not know; "
        r"it knows standard, xsa, focus, focus\+xsa",
    ):
        from_hf_config(config)


def _exportable(record, vocab_size, **settings):
    """The model a record describes, as the HF export takes it (refused where it cannot)."""
    from megatron_focus.hf.architecture import check_exportable
    from megatron_focus.model.config import ModelConfig

    model = ModelConfig.from_record(record, vocab_size, **settings)
    check_exportable(model)
    return model


def test_unmapped_settings_are_refused():
    from megatron_focus.model.config import ModelConfig

    model_args = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=4,
        num_query_groups=4,
        kv_channels=16,
        normalization="LayerNorm",
        norm_epsilon=1e-5,
        swiglu=False,
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
        rotary_base=10000,
        rotary_percent=1.0,
        max_position_embeddings=32,
        untie_embeddings_and_output_weights=False,
        attention="standard",
        xsa_layers=None,
        openai_gelu=False,
    )
    _exportable(model_args, 200)
    focus = dict(
        focus_groups=4,
        focus_dim=16,
        focus_window=4,
        focus_tau=0.1,
        focus_sinkhorn_iters=10,
        focus_gate_scale=1.0,
    )  # as saved before focus_gate
    recorded = ModelConfig.completed({**model_args, **focus, "attention": "focus"})
    arch = _exportable(recorded, 200, focus_top_k=1)
    focus = arch.settings
    assert (focus.window, focus.top_k, focus.attention_mode, focus.gate) == (4, 1, "soft", "log")
    assert ModelConfig.completed({**recorded, "focus_gate": "sigmoid"})["focus_gate"] == "sigmoid"
    with pytest.raises(ValueError, match="lacks focus_window, focus_tau"):  # an older checkpoint
        _exportable({**model_args, "attention": "focus", "focus_groups": 4, "focus_dim": 16}, 200)
    with pytest.raises(NotImplementedError, match="partial rotary"):
        _exportable({**model_args, "rotary_percent": 0.5}, 200)
    with pytest.raises(ValueError, match="lacks norm_epsilon"):
        _exportable({k: v for k, v in model_args.items() if k != "norm_epsilon"}, 200)


def test_hf_tokenizer_json_is_exported(tmp_path):
    """A GPT-2-style byte-level BPE `tokenizer.json` comes out encoding as the training one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from megatron_focus.data.tokenizer import build_tokenizer
    from megatron_focus.hf.tokenizer import PROBES, save_hf_tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        PROBES * 10,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    bpe.save(str(tmp_path / "tokenizer.json"))
    ours = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))
    ids = save_hf_tokenizer(ours, str(tmp_path / "hf"), max_length=64)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    # no bos of its own: sequences begin with the end-of-document token, as GPT-2's do
    eod = ours.eod
    assert ids == {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": ours.pad}
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (eod, eod, eod)
    for text in ("Hello world, numbers 42", "unseen: Zürich ☃"):
        assert theirs(text)["input_ids"] == ours.tokenize(text)
    assert theirs.model_max_length == 64
    assert len(theirs(" ".join(PROBES * 5), truncation=True)["input_ids"]) == 64


def _bpe_with_config(folder, config: dict):
    """A byte-level BPE `tokenizer.json` with Llama-3's special tokens, and `config` beside it."""
    special = ["<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"]
    bpe = byte_level_bpe(folder, special)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return bpe


def test_hf_tokenizer_config_names_the_special_tokens(tmp_path):
    """Llama-3 style: `tokenizer_config.json` names bos, eos and pad (a string or an AddedToken),
    though `<|endoftext|>` is also in the vocabulary; export keeps them and the chat template."""
    from transformers import AutoTokenizer

    from megatron_focus.data.tokenizer import build_tokenizer
    from megatron_focus.hf.tokenizer import save_hf_tokenizer

    template = "{% for m in messages %}{{ m['content'] }}<|end_of_text|>{% endfor %}"
    bpe = _bpe_with_config(
        tmp_path / "tok",
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": {"content": "<|end_of_text|>"},
            "pad_token": "<|finetune_right_pad_id|>",
            "chat_template": template,
        },
    )
    ours = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tok"))
    ids = [
        bpe.token_to_id(t)
        for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>")
    ]
    assert [ours.bos, ours.eod, ours.pad] == ids
    save_hf_tokenizer(ours, str(tmp_path / "hf"), max_length=128)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert [theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id] == ids
    assert theirs.chat_template == template
    assert (
        theirs.apply_chat_template([{"role": "user", "content": "Hello world"}], tokenize=False)
        == "Hello world<|end_of_text|>"
    )


def test_imported_tokenizer_config_survives_export(tmp_path):
    """HF -> native -> HF keeps the tokenizer's bos/eos/pad, in the tokenizer and the config."""
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from megatron_focus.hf import export_to_hf, import_from_hf

    bpe = _bpe_with_config(
        tmp_path / "hf", {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    )
    bos, eos = bpe.token_to_id("<|begin_of_text|>"), bpe.token_to_id("<|end_of_text|>")
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=400,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            bos_token_id=bos,
            eos_token_id=eos,
        )
    ).save_pretrained(tmp_path / "hf")
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), progress=False)
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    config, tokenizer = (
        cls.from_pretrained(tmp_path / "back") for cls in (AutoConfig, AutoTokenizer)
    )
    assert (config.bos_token_id, config.eos_token_id) == (bos, eos)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (bos, eos)


def test_hf_tokenizer_config_naming_an_absent_token_is_refused(tmp_path):
    from megatron_focus.data.tokenizer import build_tokenizer

    _bpe_with_config(tmp_path / "tok", {"eos_token": "<|eot_id|>"})
    with pytest.raises(ValueError, match="names '<\\|eot_id\\|>' as its eos token"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tok" / "tokenizer.json"))


def _tree(folder) -> dict:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_tools_never_write_over_a_folder_that_holds_files(tmp_path, monkeypatch):
    """Import into an existing run and export into another model's folder are refused before
    any weight is read; a failed export leaves nothing; --overwrite replaces only at the end."""
    from megatron_focus.hf import export, export_to_hf, import_from_hf

    _hf_model("llama-gqa-untied").save_pretrained(tmp_path / "hf")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    import_from_hf(str(tmp_path / "hf"), str(ckpt), progress=False)
    (out / "other-model").mkdir(parents=True)
    (out / "other-model" / "config.json").write_text("{}")
    before = {folder: _tree(folder) for folder in (ckpt, out)}
    with pytest.raises(FileExistsError, match="is not empty.*--overwrite"):
        import_from_hf(str(tmp_path / "hf"), str(ckpt), progress=False)
    with pytest.raises(FileExistsError, match="is not empty.*--overwrite"):
        export_to_hf(str(ckpt), str(out), progress=False)

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export, "_model_holding", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export_to_hf(str(ckpt), str(out), progress=False, overwrite=True)
    with pytest.raises(RuntimeError, match="disk full"):
        export_to_hf(str(ckpt), str(tmp_path / "new"), progress=False)
    assert {folder: _tree(folder) for folder in (ckpt, out)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "out"]
    monkeypatch.undo()

    export_to_hf(str(ckpt), str(out), progress=False, overwrite=True)
    assert "other-model" not in os.listdir(out) and (out / "model.safetensors").is_file()


def test_an_imported_checkpoint_can_be_moved(tmp_path):
    """Its tokenizer is recorded relative to the checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_focus.hf import export_to_hf, import_from_hf

    _bpe_with_config(tmp_path / "hf", {"eos_token": "<|end_of_text|>"})
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=400,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
        )
    ).save_pretrained(tmp_path / "hf")
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), progress=False)
    os.rename(tmp_path / "ckpt", tmp_path / "moved")
    export_to_hf(str(tmp_path / "moved"), str(tmp_path / "back"), progress=False)
    assert (tmp_path / "back" / "tokenizer.json").is_file()
