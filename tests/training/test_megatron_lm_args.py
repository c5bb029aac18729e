"""Megatron-LM's checkpoints read as Megatron-LM writes their `args`, and ours written as it reads
them: the records are Megatron-LM's own parser's (tests/megatron_lm_record.py), the reference
the model Megatron-LM's pretrain_gpt.py builds from them in Megatron-Core."""

import argparse
import os

import pytest
import torch

import megatron_lm_record
from distributed import run_distributed

VOCAB = 200  # NullTokenizer: 201 ids with the end of document
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]


def _norms(model, part: str = "") -> list:
    return [p for name, p in model.named_parameters() if "layernorm" in name and part in name]


def _logits(model) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(2, 32)
    mask = torch.triu(torch.ones(32, 32, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return gather_from_tensor_model_parallel_region(model(tokens, positions, mask))


def _refusal(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def _megatron_lm_run(script: str, tp: int, folder: str) -> dict:
    """Megatron-LM saves `script`'s model at TP `tp`; this trainer reads it (from the script's
    flags and from the record alone) and writes its own record of the same flags."""
    from megatron_focus import platform
    from megatron_focus.checkpoint import format as checkpoint_format
    from megatron_focus.checkpoint import torch_dist
    from megatron_focus.checkpoint.saved import MEGATRON_LM, SavedCheckpoint
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args
    from megatron_focus.training.saved_formats import MegatronLMFolder

    platform.init_distributed(tp)
    argv = megatron_lm_record.SCRIPTS[script] + MOCK + ["--tensor-model-parallel-size", str(tp)]
    record = megatron_lm_record.record(argv, VOCAB + 1)
    platform.manual_seed(1)
    theirs = megatron_lm_record.gpt_model(record).eval()
    with torch.no_grad():  # norms that are not the identity, the same on every rank
        for i, p in enumerate(_norms(theirs)):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    megatron_lm_record.save(theirs, folder, record)
    if record.layernorm_zero_centered_gamma:  # what Megatron-LM computes from those weights
        with torch.no_grad():
            for p in _norms(theirs, "weight"):
                p.add_(1)
    checkpoint = os.path.join(folder, "iter_0000007")
    opened = SavedCheckpoint.open(checkpoint, allow_unsafe=False)
    assert opened.format == MEGATRON_LM
    saved = opened.model_args
    out = {"theirs": _logits(theirs)}
    for how, flags in (
        ("from the script", argv),
        ("from the record", MOCK + ["--load", folder, "--use-checkpoint-args"]),
    ):
        args = parse_args(flags + ["--tensor-model-parallel-size", str(tp)])
        out[f"seq_length {how}"] = (args.seq_length, record.seq_length)
        ours = args.model_config.record(
            record.padded_vocab_size, args.tensor_model_parallel_size, args.seq_length
        )
        checkpoint_format.check_compatible(ours, saved, checkpoint, MegatronLMFolder.reshards)
        platform.manual_seed(2)
        model = build_model(args, VOCAB + 1).eval()
        torch_dist.load_model(model, checkpoint)
        out[how] = _logits(model)
    ours = torch_dist.megatron_args(parse_args(argv), record.padded_vocab_size, consumed=0)
    out["record"] = {
        name: (getattr(record, name), getattr(ours, name, "missing"))
        for name in megatron_lm_record.CHECKED_ON_LOAD
        + megatron_lm_record.TAKEN_BY_USE_CHECKPOINT_ARGS
        if hasattr(record, name)
    }
    # each model flag of the script left out in turn: a run of another model, refused by name
    out["refused"] = {}
    for i, flag in enumerate(argv):
        if flag in ("--apply-layernorm-1p", "--disable-bias-linear", "--norm-epsilon"):
            other = argv[:i] + argv[i + 1 + (flag == "--norm-epsilon") :]
            args = parse_args(other)
            out["refused"][flag] = _refusal(
                lambda: checkpoint_format.check_compatible(
                    args.model_config.record(
                        record.padded_vocab_size, args.tensor_model_parallel_size, args.seq_length
                    ),
                    saved,
                    checkpoint,
                    MegatronLMFolder.reshards,
                )
            )
    return out


@pytest.mark.parametrize(
    "script,tp",
    [("gpt3", 1), ("gpt3", 2), ("llama3-8b", 1), ("llama3-8b", 2), ("llama3-rmsnorm", 1)],
)
def test_megatron_lm_checkpoints_load_as_the_model_their_args_describe(tmp_path, script, tp):
    out = run_distributed(_megatron_lm_run, tp, script, tp, str(tmp_path / "megatron"))
    torch.testing.assert_close(out["from the script"], out["theirs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["from the record"], out["theirs"], rtol=1e-5, atol=1e-5)
    # --use-checkpoint-args without --seq-length takes the record's, as Megatron-LM does
    assert out["seq_length from the record"] == out["seq_length from the script"] == (32, 32)
    # Megatron-LM reads ours as its own: its check_checkpoint_args and --use-checkpoint-args
    differ = {k: v for k, v in out["record"].items() if v[0] != v[1]}
    assert not differ and len(out["record"]) >= 25
    expected = {
        "gpt3": {},
        "llama3-8b": {
            "--apply-layernorm-1p": "apply_layernorm_1p: checkpoint True, this run False",
            "--disable-bias-linear": "add_bias_linear: checkpoint False, this run True",
        },
        "llama3-rmsnorm": {
            "--apply-layernorm-1p": "apply_layernorm_1p: checkpoint True, this run False",
            "--norm-epsilon": "norm_epsilon: checkpoint 0.01, this run 1e-05",
        },
    }[script]
    for flag, words in expected.items():
        assert words in out["refused"][flag]


def _record(**changes) -> argparse.Namespace:
    record = megatron_lm_record.record(megatron_lm_record.LLAMA3_8B + MOCK, VOCAB + 1)
    for name, value in changes.items():
        setattr(record, name, value)
    return record


def test_every_model_field_is_read_under_megatron_lms_name():
    from megatron_focus.checkpoint import megatron_lm_args
    from megatron_focus.model.config import LAYOUT_KEYS, ModelConfig

    assert set(megatron_lm_args.FIELDS) | set(megatron_lm_args.STANDARD) == {
        *ModelConfig.described(),
        *LAYOUT_KEYS,
    }
    read = megatron_lm_args.model_args(_record())
    assert read["norm_epsilon"] == 1e-5 and read["apply_layernorm_1p"] is True
    assert read["num_query_groups"] == 2 and read["add_qkv_bias"] is False
    # GPT-3's defaults: one group per head, the QKV bias add_bias_linear's
    gpt3 = megatron_lm_args.model_args(megatron_lm_record.record(megatron_lm_record.GPT3, 201))
    assert gpt3["num_query_groups"] == 4 and gpt3["add_qkv_bias"] is False
    assert gpt3["add_bias_linear"] is True and gpt3["normalization"] == "LayerNorm"
    # a Qwen2-style QKV bias without the others
    qwen = megatron_lm_args.model_args(_record(add_qkv_bias=True))
    assert qwen["add_qkv_bias"] is True
    # releases up to core 0.15 recorded the norm under this trainer's names
    old = _record(norm_epsilon=1e-6, apply_layernorm_1p=False)
    del old.layernorm_epsilon, old.layernorm_zero_centered_gamma
    read = megatron_lm_args.model_args(old)
    assert read["norm_epsilon"] == 1e-6 and read["apply_layernorm_1p"] is False


@pytest.mark.parametrize(
    "changes,named",
    [
        ({"num_experts": 8}, "num_experts 8"),
        ({"multi_latent_attention": True}, "multi_latent_attention True"),
        ({"rotary_interleaved": True}, "rotary_interleaved True"),
        ({"rope_type": "yarn"}, "rope_type 'yarn'"),
        ({"apply_residual_connection_post_layernorm": True}, "apply_residual_connection"),
        ({"position_embedding_type": "mrope"}, "position_embedding_type 'mrope'"),
        ({"softmax_type": "learnable"}, "softmax_type 'learnable'"),
    ],
)
def test_a_model_not_built_here_is_refused_by_name(changes, named):
    from megatron_focus.checkpoint import megatron_lm_args

    with pytest.raises(ValueError, match="does not build") as refused:
        megatron_lm_args.model_args(_record(**changes))
    assert named in str(refused.value)
    # at Megatron-LM's "off" values, read
    assert megatron_lm_args.model_args(_record(rope_type="rope", num_experts=None))


def test_a_record_without_a_required_field_is_refused_by_name():
    from megatron_focus.checkpoint import megatron_lm_args

    record = _record()
    del record.hidden_size
    with pytest.raises(ValueError, match="record no hidden_size"):
        megatron_lm_args.model_args(record)
