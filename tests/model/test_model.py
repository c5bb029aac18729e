"""The platform layer, the standard core attention and flag validation."""

import math
import re
import warnings

import pytest
import torch

from megatron_focus import platform
from megatron_focus.model.gpt import padded_vocab_size, transformer_config
from megatron_focus.training.arguments import parse_args


def test_platform_changes_nothing_of_megatron_when_cuda_is_present():
    (dynamo,) = platform.planned_patches(cuda_available=True)
    assert dynamo.owner is torch._dynamo.config and dynamo.name == "recompile_limit"
    cpu = {p.name for p in platform.planned_patches(cuda_available=False)}
    assert cpu == {
        "recompile_limit",
        "current_device",
        "get_default_causal_mask",
        "_get_cuda_rng_state",
        "_set_cuda_rng_state",
        "_CUDA_RNG_STATE_TRACKER",
        "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
        "get_pos_emb_on_this_cp_rank",
        "preload_tensors",
    }


def test_recompile_limit_is_raised_never_lowered():
    config = torch._dynamo.config
    with config.patch(recompile_limit=8):
        platform.planned_patches()[0].apply()
        assert config.recompile_limit == platform.RECOMPILE_LIMIT == 64
    with config.patch(recompile_limit=128):
        platform.planned_patches()[0].apply()
        assert config.recompile_limit == 128


def test_platform_setup_is_idempotent():
    assert platform.setup() is platform.setup()


def test_cpu_rng_tracker_streams(single_process):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    platform.manual_seed(7)
    torch.manual_seed(7 + 2718)  # the TP stream of TP rank 0, as Megatron seeds it
    expected = torch.rand(5)
    platform.manual_seed(7)
    outer = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(5)
    assert torch.equal(inside, expected)
    assert torch.equal(torch.get_rng_state(), outer)  # the default stream is untouched
    with get_cuda_rng_tracker().fork():
        assert not torch.equal(torch.rand(5), inside)  # the stream advances across forks


def _reference_attention(q, k, v, scale, left=None):
    """Dense causal softmax attention written out, GQA by repeating key/value heads; `left`: a
    sliding window, query i sees keys i - left .. i only."""
    sq, b, heads, hn = q.shape
    rep = heads // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    removed = torch.zeros(sq, sq, dtype=torch.bool)
    for i in range(sq):
        for j in range(sq):
            removed[i, j] = j > i or (left is not None and i - j > left)
    probs = scores.masked_fill(removed, -math.inf).softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(sq, b, heads * hn)


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_core_attention_matches_dense_reference(single_process, groups):
    from megatron_focus.model.core_attention import CoreAttention
    from megatron_focus.model.gpt import transformer_config

    args = parse_args(
        [
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--group-query-attention",
            "--num-query-groups",
            str(groups),
        ]
    )
    attn = CoreAttention(
        transformer_config(args.model_config, args.parallel, args.training),
        layer_number=1,
        attn_mask_type=None,
    ).eval()
    g = torch.Generator().manual_seed(groups)
    q = torch.randn(12, 3, 4, 16, generator=g)
    k, v = (torch.randn(12, 3, groups, 16, generator=g) for _ in range(2))
    out = attn(q, k, v, None)
    assert out.shape == (12, 3, 64)
    torch.testing.assert_close(out, _reference_attention(q, k, v, 0.25), rtol=1e-5, atol=1e-5)
    # An explicit Megatron mask (True = removed) gives the same as the implicit causal one.
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)
    torch.testing.assert_close(attn(q, k, v, mask), out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("left, groups", [(0, 4), (3, 2), (40, 1)])
def test_sliding_window_matches_dense_reference(single_process, left, groups):
    """--window-size LEFT,0 (Megatron's): query i sees keys i - LEFT .. i; LEFT >= seq: causal."""
    from megatron_focus.model.core_attention import CoreAttention
    from megatron_focus.model.gpt import transformer_config

    args = parse_args(
        [
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--window-size",
            f"{left},0",
            "--group-query-attention",
            "--num-query-groups",
            str(groups),
        ]
    )
    attn = CoreAttention(
        transformer_config(args.model_config, args.parallel, args.training),
        layer_number=1,
        attn_mask_type=None,
    ).eval()
    g = torch.Generator().manual_seed(left)
    q = torch.randn(12, 2, 4, 16, generator=g)
    k, v = (torch.randn(12, 2, groups, 16, generator=g) for _ in range(2))
    torch.testing.assert_close(
        attn(q, k, v, None), _reference_attention(q, k, v, 0.25, left), rtol=1e-5, atol=1e-5
    )


# a window shorter than the documents, and groups: distant pairs in both documents
FOCUS_DOCUMENTS = ["--focus-window", "4", "--focus-groups", "4", "--focus-chunk-size", "8"]


def _packed_documents(variant):
    """A 2-layer model, and two documents (tokens 0..11, 12..31) packed in one sequence with
    Megatron-Core's dataset mask and positions."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from megatron_focus.model.gpt import build_model

    args = parse_args(
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "32",
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
            "--reset-attention-mask",
            "--reset-position-ids",
            *variant,
        ]
    )
    platform.manual_seed(3)
    model = build_model(args, 100)
    eod = 99
    tokens = torch.randint(0, eod, (32,), generator=torch.Generator().manual_seed(0))
    tokens[11] = eod
    mask, _, positions = _get_ltor_masks_and_position_ids(tokens, eod, True, True, False, True)
    return model, tokens, positions, mask


def _alone(model, tokens):
    return torch.cat(
        [
            model(doc[None], torch.arange(len(doc))[None], None)
            for doc in (tokens[:12], tokens[12:])
        ],
        dim=1,
    )


@pytest.mark.parametrize(
    "variant",
    [
        [],
        ["--attention", "xsa"],
        ["--window-size", "5,0"],
        ["--position-embedding-type", "rope", "--attention", "xsa"],
        [*FOCUS_DOCUMENTS, "--attention", "focus", "--focus-sink-tokens", "2"],
        [*FOCUS_DOCUMENTS, "--attention", "focus+xsa", "--focus-attention-mode", "sparse"],
    ],
)
def test_reset_attention_mask_equals_separate_documents(single_process, variant):
    """--reset-attention-mask with --reset-position-ids: Megatron-Core's dataset mask and
    positions make two packed documents compute what each computes alone (Focus: its routing
    restarts at the second document too)."""
    model, tokens, positions, mask = _packed_documents(variant)
    model.eval()
    with torch.no_grad():
        packed = model(tokens[None], positions[None], mask[None])
        alone = _alone(model, tokens)
        plain = model(tokens[None], torch.arange(32)[None], None)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(packed[:, 12:], plain[:, 12:], atol=1e-3)  # the mask matters


@pytest.mark.parametrize("recompute", [[], ["--recompute-activations"]])
def test_focus_gradients_with_packed_documents_equal_separate_ones(single_process, recompute):
    """Training with --reset-attention-mask: every weight's gradient (the routers' included)
    is the sum of the two documents' gradients alone, with Megatron's recompute as well."""
    model, tokens, positions, mask = _packed_documents(
        [*FOCUS_DOCUMENTS, "--attention", "focus+xsa", *recompute]
    )
    # (logits over the vocabulary padded to 128)
    weights = torch.randn(1, 32, 128, generator=torch.Generator().manual_seed(1))
    grads = []
    for forward in (
        lambda: model(tokens[None], positions[None], mask[None]),
        lambda: _alone(model, tokens),
    ):
        model.zero_grad()
        (forward() * weights).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert any(".router." in name for name in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--window-size", "7,3"], "give LEFT,0"),
        (["--window-size", "7"], "give LEFT,0"),
        (["--window-size", "7,0", "--attention", "focus"], "Focus has its own local window"),
    ],
)
def test_bad_window_sizes_are_refused(argv, error):
    with pytest.raises(ValueError, match=error):
        parse_args(BASE + argv)


def test_a_runs_model_config_warns_of_nothing():
    """Megatron-Core's own default CUDA-graph scope is deprecated (a warning at every config,
    0.16.1 and 0.19 alike, in the first lines a user reads) unless the scope is given."""
    config = parse_args(BASE).model_config
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transformer_config(config)
    assert not caught, [str(w.message) for w in caught]


def test_vocab_padding_follows_megatron():
    assert padded_vocab_size(200, 128, 1) == 256
    assert padded_vocab_size(257, 128, 2) == 512
    assert padded_vocab_size(50257, 128, 1) == 50304


BASE = ["--num-attention-heads", "4", "--hidden-size", "64"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (BASE + ["--tensor-model-parallel-size", "3"], "not divisible by --tensor-model-parallel"),
        (BASE + ["--group-query-attention", "--num-query-groups", "3"], "does not divide"),
        (
            BASE + ["--seq-length", "512", "--max-position-embeddings", "256"],
            "longer than the learned",
        ),
        (["--hidden-size", "65", "--num-attention-heads", "4"], "--kv-channels"),
        (
            BASE + ["--attention", "focus", "--focus-kernel", "flex"],
            "FlexAttention has no CPU backward",
        ),
    ],
)
def test_bad_flags_are_refused(monkeypatch, argv, message):
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match=message):
        parse_args(argv)


def test_sequence_parallel_without_tensor_parallel_is_turned_off():
    """As Megatron-LM does: its launch scripts pass --sequence-parallel whatever the TP size."""
    with pytest.warns(UserWarning, match="--sequence-parallel has no effect"):
        args = parse_args(BASE + ["--sequence-parallel"])
    assert args.sequence_parallel is False


def test_unset_schedule_and_logging_flags_take_megatrons_defaults():
    """Megatron-LM 0.16's defaults for a run on its own data; the demo's (embedded corpus) where
    the user left them unset, relative to what the user gave (--lr 1e-4 alone is valid)."""
    data = [
        "--data-path",
        "x_text_document",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        "x.json",
    ]
    ours = parse_args(BASE + data + ["--lr", "1e-4"])
    assert (
        ours.min_lr,
        ours.lr_decay_style,
        ours.lr_warmup_iters,
        ours.log_interval,
        ours.eval_interval,
        ours.eval_iters,
    ) == (0.0, "linear", 0, 100, 1000, 100)
    demo = parse_args(BASE + ["--lr", "1e-4", "--train-iters", "50"])
    assert (
        demo.min_lr,
        demo.lr_decay_style,
        demo.lr_warmup_iters,
        demo.log_interval,
        demo.eval_interval,
        demo.eval_iters,
    ) == (1e-5, "cosine", 5, 10, 100, 10)
    given = parse_args(
        BASE + ["--lr-decay-style", "linear", "--min-lr", "0", "--log-interval", "7"]
    )
    assert (given.lr_decay_style, given.min_lr, given.log_interval) == ("linear", 0.0, 7)


def test_unknown_flags_are_named_with_the_closest_known_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--num-layer", "2", "--lr-warmup-iter=5", "--frobnicate"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage:" not in err and err.count("\n") == 1
    assert err.startswith(
        "error: unknown flags --num-layer (did you mean --num-layers?), "
        "--lr-warmup-iter=5 (did you mean --lr-warmup-iters?), --frobnicate;"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"zero_optimization": {"stage": 2},}', "not valid JSON: .* line 1"),
        ('[{"bf16": {"enabled": true}}]', "must be an object of sections, not a list"),
        ('{"zero_optimization": {"stage": 7}}', "stage must be 0, 1, 2 or 3, not 7"),
        ('{"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}', "'optimizer' is not used here"),
        ('{"scheduler": {"type": "WarmupLR"}}', "'scheduler' is not used here.*--lr-warmup-iters"),
        ('{"zero_optimisation": {"stage": 3}}', "unknown section 'zero_optimisation' .*'zero_opt"),
        ('{"train_batch_size": 64}', "sets train_batch_size=64 but the flags give 8"),
    ],
)
def test_deepspeed_json_is_checked_as_flags_are_parsed(tmp_path, text, message):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        parse_args(BASE + ["--micro-batch-size", "8", "--deepspeed_config", str(path)])
    assert str(path) in str(error.value) or "train_batch_size" in message


def test_deepspeed_json_sets_stage_and_precision_at_parse_time(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}')
    args = parse_args(BASE + ["--deepspeed_config", str(path)])
    assert (args.zero_stage, args.bf16, args.fp16) == (2, True, False)


@pytest.mark.parametrize(
    "flag, value, message",
    [
        (
            "--pipeline-model-parallel-size",
            "2",
            "pipeline parallelism is not supported; use --zero-stage 3 or tensor parallelism",
        ),
        ("--num-experts", "8", "mixture of experts is not supported"),
        ("--fp8-format", "hybrid", "fp8 needs Transformer Engine"),
    ],
)
def test_what_is_not_offered_is_refused_by_name(flag, value, message):
    shown = str(value.split()).replace("'", "") if " " in value else value
    with pytest.raises(ValueError, match=f"^{re.escape(flag)} {re.escape(shown)}: {message}"):
        parse_args(BASE + [flag, *value.split()])


def test_megatron_flags_without_effect_or_done_by_deepspeed_are_accepted():
    """(Each of Megatron-LM's flags at its default: tests/test_megatron_flags.py.)"""
    from megatron_focus.config.deepspeed_config import deepspeed_config

    args = parse_args(
        BASE
        + [
            "--no-masked-softmax-fusion",
            "--use-flash-attn",
            "--empty-unused-memory-level",
            "2",
            "--attention-backend",
            "flash",
            "--pipeline-model-parallel-size",
            "1",
            "--ckpt-format",
            "torch",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
        ]
    )
    assert args.zero_stage == 1
    assert deepspeed_config(args, 1)["zero_optimization"]["overlap_comm"] is True
    with pytest.raises(ValueError, match="not with --zero-stage 0"):
        parse_args(BASE + ["--use-distributed-optimizer", "--zero-stage", "0"])


def test_sample_based_schedules_are_the_iterations_they_imply_in_samples():
    """As Megatron-LM: --train-samples counts the schedule in samples, the same schedule as in
    iterations at a constant batch."""
    from megatron_focus.training.optimizer import COUNTS, schedule

    batch = BASE + ["--micro-batch-size", "4", "--global-batch-size", "32", "--lr", "1e-3"]
    by_iters = parse_args(
        batch + ["--train-iters", "100", "--lr-warmup-iters", "10", "--lr-decay-iters", "90"]
    )
    by_samples = parse_args(
        batch
        + ["--train-samples", "3200", "--lr-warmup-samples", "320", "--lr-decay-samples", "2880"]
    )
    by_fraction = parse_args(
        batch + ["--train-iters", "100", "--lr-decay-iters", "90", "--lr-warmup-fraction", "0.12"]
    )
    assert by_samples.train_iters == by_iters.train_iters
    in_samples = {k: v * 32 if k in COUNTS else v for k, v in schedule(by_iters).items()}
    assert schedule(by_samples) == in_samples
    assert by_fraction.lr_warmup_iters == 10  # int(0.12 x 90)
    with pytest.raises(ValueError, match="--train-samples and --train-iters"):
        parse_args(batch + ["--train-samples", "3200", "--train-iters", "100"])


def test_unknown_attention_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--attention", "linear"])
    assert "invalid choice: 'linear'" in capsys.readouterr().err


def test_rope_allows_sequences_past_the_position_table():
    args = parse_args(
        BASE
        + [
            "--position-embedding-type",
            "rope",
            "--seq-length",
            "512",
            "--max-position-embeddings",
            "256",
        ]
    )
    assert args.seq_length == 512


def test_model_families_defaults():
    gpt2 = parse_args(BASE)
    assert (gpt2.ffn_hidden_size, gpt2.num_query_groups, gpt2.kv_channels) == (256, 4, 16)
    llama = parse_args(
        [
            "--hidden-size",
            "4096",
            "--num-attention-heads",
            "32",
            "--swiglu",
            "--group-query-attention",
            "--num-query-groups",
            "8",
        ]
    )
    assert (llama.ffn_hidden_size, llama.num_query_groups) == (10880, 8)


def test_splits_are_read_off_the_meta_model_on_a_gpu_host_too(single_process, monkeypatch):
    """On a GPU host (has_cuda forced here) the declared splits come from the model built on the
    meta device, which is never moved to the GPU; a run's model is (on_device)."""
    from megatron_focus.checkpoint import tp_layout
    from megatron_focus.model import gpt

    config = parse_args(["--attention", "focus", "--swiglu", "--num-layers", "2"])
    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    splits = tp_layout.declared_splits(config.model_config)
    layer = "decoder.layers.0."
    assert splits[layer + "mlp.linear_fc1.weight"] == (0, 2)  # SwiGLU's [gate; up]
    assert splits[layer + "self_attention.linear_proj.weight"] == (1, 1)
    assert splits[layer + "self_attention.core_attention.router.centroids"] is None
    moved = []

    class Model:
        def cuda(self, device):
            moved.append(device)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    gpt.on_device(Model())
    assert moved == [0]
