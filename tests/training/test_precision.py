"""Half-precision training keeps gradients in fp32 while they are accumulated over micro-batches
and reduced across ranks, as Megatron-LM does: read from the DeepSpeed engine that the shipped
configs and the flags build."""

import os

import deepspeed
import pytest
import torch

from megatron_focus.config.deepspeed_config import deepspeed_config
from megatron_focus.training.arguments import parse_args

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
BASE = ["--num-attention-heads", "4", "--hidden-size", "64"]


def engine_of(argv):
    args = parse_args(BASE + argv)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        config=deepspeed_config(args, 1),
        dist_init_required=False,
    )
    return engine


def grad_accumulation_dtype(engine):
    return getattr(engine.optimizer, "gradient_accumulation_dtype", None)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shipped_bf16_configs_accumulate_and_reduce_in_fp32(single_process, stage):
    engine = engine_of(["--deepspeed_config", os.path.join(EXAMPLES, f"ds_zero{stage}_bf16.json")])
    assert engine.bfloat16_enabled()
    assert engine.communication_data_type == torch.float32
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    if stage < 3:  # ZeRO-3 accumulates in its fp32 partitions
        assert grad_accumulation_dtype(engine) in (torch.float32, None)


@pytest.mark.parametrize("stage", ["0", "2"])
def test_bf16_flag_alone_reduces_in_fp32(single_process, stage):
    engine = engine_of(["--bf16", "--zero-stage", stage])
    assert engine.communication_data_type == torch.float32
    if stage != "0":  # DeepSpeed accumulates in the model's dtype without ZeRO
        assert engine.get_data_types()[1] == torch.float32


def test_grad_reduce_in_bf16_is_megatrons_opt_out(single_process, tmp_path):
    engine = engine_of(["--bf16", "--zero-stage", "2", "--grad-reduce-in-bf16"])
    assert engine.communication_data_type == torch.bfloat16
    path = tmp_path / "ds.json"
    path.write_text('{"bf16": {"enabled": true}, "communication_data_type": "fp32"}')
    with pytest.raises(ValueError, match="--grad-reduce-in-bf16, but --deepspeed_config"):
        deepspeed_config(
            parse_args(BASE + ["--deepspeed_config", str(path), "--grad-reduce-in-bf16"]), 1
        )
