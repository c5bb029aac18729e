"""`--yaml-cfg`: a YAML file laid out as Megatron-LM's stands for the command line it holds."""

import os

import pytest

from megatron_focus.training.arguments import parse_args

YAML = """\
language_model:
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 4
  num_query_groups: null
  ffn_hidden_size: null
  hidden_dropout: 0.0
  attention_dropout: 0.0
  layernorm_epsilon: 1.e-6
  layernorm_zero_centered_gamma: true
  add_bias_linear: false
  gated_linear_unit: true
  activation_func: swiglu
  num_moe_experts: null
  masked_softmax_fusion: true
  normalization: RMSNorm
model_parallel:
  tensor_model_parallel_size: 1
  sequence_parallel: false
  bf16: true
  perform_initialization: true
micro_batch_size: 2
global_batch_size: 4
lr: 2.5e-4
min_lr: 2.5e-5
lr_decay_style: cosine
train_iters: 20
position_embedding_type: rope
seq_length: 128
save: ${CKPT_ROOT}/run
save_interval: 10
split: '99,1,0'
profile_ranks: [0, 1]
window_size: [127, 0]
"""
SAME = [
    *("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --hidden-dropout 0.0").split(),
    *("--attention-dropout 0.0 --norm-epsilon 1e-6 --apply-layernorm-1p").split(),
    *("--disable-bias-linear --swiglu --normalization RMSNorm --bf16").split(),
    *("--micro-batch-size 2 --global-batch-size 4 --lr 2.5e-4 --min-lr 2.5e-5").split(),
    *("--lr-decay-style cosine --train-iters 20 --position-embedding-type rope").split(),
    *("--seq-length 128 --save-interval 10 --split 99,1,0 --profile-ranks 0 1").split(),
    *("--window-size 127,0").split(),  # a one-value flag: a YAML list is Megatron's tuple
]


def write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_a_yaml_file_is_the_command_line_it_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_ROOT", str(tmp_path))
    path = write(tmp_path, YAML)
    from_yaml = parse_args(["--yaml-cfg", path]).flags()
    by_flags = parse_args(SAME + ["--save", f"{tmp_path}/run"]).flags()
    assert from_yaml.pop("yaml_cfg") == path and by_flags.pop("yaml_cfg") is None
    assert from_yaml == by_flags


@pytest.mark.parametrize(
    "text, message",
    [
        ("language_model:\n  activation_func: relu\n", "activation_func relu: one of"),
        ("language_model:\n  num_moe_experts: 8\n", "mixture of experts is not supported"),
        ("language_model:\n  lr: 1.0\nlr: 2.0\n", "lr given twice"),
        ("save: ${NO_SUCH_VARIABLE_HERE}/x\n", "environment variable NO_SUCH_VARIABLE_HERE"),
        ("- 1\n- 2\n", "expected keys and values"),
        (
            "model_parallel:\n  cpu_offloading: true\n",
            "cpu_offloading True: Megatron-Core's cpu_offloading is set by this trainer, ",
        ),
    ],
)
def test_a_bad_key_is_refused_before_any_compute(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        parse_args(["--yaml-cfg", write(tmp_path, text)])


def test_flags_beside_the_yaml_file_are_refused_not_ignored(tmp_path):
    """Megatron-LM ignores the command line beside --yaml-cfg; a flag there would be lost."""
    path = write(tmp_path, "lr: 1.0e-4\n")
    with pytest.raises(ValueError, match="--lr, --seed beside --yaml-cfg"):
        parse_args(["--yaml-cfg", path, "--lr", "1e-3", "--seed=3"])
    assert parse_args(["--yaml-cfg", path, "--local-rank", "0"]).lr == 1e-4


def test_megatron_lms_shipped_config_reads_as_megatron_lm_reads_it():
    """Its keys of flags Megatron-LM has since removed are ignored with a warning naming them,
    and `save_interval` without `save` is taken, as Megatron-LM takes them."""
    path = os.path.join(os.path.dirname(__file__), "megatron_lm_gpt_config.yaml")
    with pytest.warns(UserWarning, match=r"ignoring standalone_embedding_stage \(did you mean"):
        args = parse_args(["--yaml-cfg", path])
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 64, 4)
    assert (args.save, args.save_interval) == (None, 20000)
    assert args.swiglu and args.apply_layernorm_1p and args.untie_embeddings_and_output_weights
    assert (args.position_embedding_type, args.rotary_percent) == ("rope", 0.5)
    assert (args.lr, args.min_lr, args.rampup_batch_size) == (2.5e-4, 2.5e-5, [32, 32, 65324160])


def test_an_unknown_key_is_named_and_ignored(tmp_path):
    """A misspelt key too: the warning names it and the flag it is closest to."""
    path = write(tmp_path, "lr: 1.0e-4\nmicro_batch_sise: 2\nno_such_thing: 3\n")
    with pytest.warns(UserWarning, match=r"ignoring micro_batch_sise \(did you mean ") as caught:
        args = parse_args(["--yaml-cfg", path])
    assert "no_such_thing" in str(caught[0].message)
    assert (args.lr, args.micro_batch_size) == (1e-4, parse_args([]).micro_batch_size)


def test_save_interval_without_save_is_taken_as_megatron_lm_takes_it():
    assert parse_args(["--save-interval", "5"]).save_interval == 5
