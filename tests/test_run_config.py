"""The run config: built once from the validated flags, in sections generated from the parser's
groups, and frozen."""

import dataclasses

import pytest

from megatron_focus.config.flags import build_parser
from megatron_focus.config.run_config import SECTIONS, RunConfig
from megatron_focus.config.validation import validate_args
from megatron_focus.training.arguments import parse_args
from megatron_focus.variants import variant


def test_each_flag_is_a_field_of_one_section_typed_as_it_parses():
    fields = {f.name: f for section in SECTIONS.values() for f in dataclasses.fields(section)}
    declared = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert set(fields) == declared
    assert sum(len(dataclasses.fields(s)) for s in SECTIONS.values()) == len(declared)
    model = {f.name: f.type for f in dataclasses.fields(SECTIONS["model"])}
    assert model["hidden_size"] is int and model["swiglu"] is bool
    assert "focus_groups" in model  # a variant's settings are the model's
    assert "tensor_model_parallel_size" in {
        f.name for f in dataclasses.fields(SECTIONS["parallel"])
    }


def test_the_config_is_frozen_and_a_changed_run_is_a_new_config():
    config = parse_args(["--hidden-size", "64", "--num-attention-heads", "4"])
    assert isinstance(config, RunConfig)
    assert config.model.hidden_size == config.hidden_size == 64
    assert config.model.kv_channels == 16  # derived by validation
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.hidden_size = 128
    wider = config.replace(hidden_size=128)
    assert (wider.hidden_size, config.hidden_size) == (128, 64)
    with pytest.raises(TypeError, match="no flag"):
        config.replace(hidden_sise=128)


def test_validation_leaves_the_parsed_flags_as_they_were():
    parsed = build_parser().parse_args(["--hidden-size", "64", "--num-attention-heads", "4"])
    before = dict(vars(parsed))
    config = validate_args(parsed, world_size=1)
    assert vars(parsed) == before and before["kv_channels"] is None
    assert config.flags().keys() == before.keys()


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--attention", "focus", "--focus-groups", "4", "--focus-top-k", "3"],
        ["--attention", "focus+xsa", "--xsa-layers", "2", "--num-layers", "3"],
        ["--attention", "xsa", "--window-size", "15,0", "--swiglu", "--normalization", "RMSNorm"],
        ["--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope"],
    ],
)
def test_the_model_config_is_the_flags_model_and_its_record_comes_back(flags):
    """RunConfig.model_config holds the model the flags describe (the derived values too); its
    record, as a checkpoint holds it, reads back to the same model (the variant's inference
    settings given again, as the tools give them)."""
    from megatron_focus.model.config import ModelConfig

    config = parse_args(["--hidden-size", "64", "--num-attention-heads", "4", *flags])
    model = config.model_config
    assert model.kv_channels == 16 and model.ffn_hidden_size == config.ffn_hidden_size
    assert model.settings == variant(config.attention).settings_from(config)
    record = model.record(256, 1, config.seq_length)
    assert record["padded_vocab_size"] == 256 and record["seq_length"] == config.seq_length
    given = {} if model.settings is None else model.settings.keys("inference", "run")
    assert ModelConfig.from_record(record, **given) == model


def test_a_record_of_another_model_is_refused_by_name():
    """What the model checks itself, whoever builds it: a run's flags or a checkpoint's record."""
    from megatron_focus.model.config import ModelConfig

    record = parse_args(["--attention", "xsa"]).model_config.record(128, 1, 256)
    with pytest.raises(ValueError, match="--xsa-layers 9: no such layer"):
        ModelConfig.from_record({**record, "xsa_layers": [9]})
    with pytest.raises(ValueError, match="lacks norm_epsilon"):
        ModelConfig.from_record({k: v for k, v in record.items() if k != "norm_epsilon"})
    with pytest.raises(ValueError, match="has no setting 'focus_top_k'"):
        ModelConfig.from_record(record, focus_top_k=1)
    older = {k: v for k, v in record.items() if k != "qk_layernorm"}  # saved before it was
    assert ModelConfig.from_record(older).qk_layernorm is False
