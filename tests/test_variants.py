"""The variant registry: variants registered from outside the package (tests/toy_variant.py,
tests/toy_temperature.py, loaded through MEGATRON_FOCUS_VARIANTS in every process) train, resume
from their checkpoints, evaluate and export, with no other file knowing their names or
settings."""

import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from distributed import run_distributed
from tiny_runs import ROOT, tiny_argv, train

TOKENS = torch.randint(0, 4000, (2, 32), generator=torch.Generator().manual_seed(0))


def _export_and_compare(ckpt, hf):
    """(HF config's layer kinds, max |HF logits - native logits|) of an exported checkpoint."""
    from transformers import AutoModelForCausalLM

    from megatron_focus.hf import export_to_hf, native_logits

    export_to_hf(ckpt, hf, progress=False)
    model = AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).eval()
    with torch.no_grad():
        diff = (model(TOKENS).logits - native_logits(ckpt, TOKENS)).abs().max().item()
    return getattr(model.config, "layer_attention", None), type(model).__name__, diff


def test_a_registered_variant_trains_checkpoints_and_exports(embedded_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_FOCUS_VARIANTS", "toy_variant")
    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    explicit = ["--attention", "explicit"]
    first = train(
        1, tiny_argv(embedded_cache, *explicit, "--save", ckpt, "--exit-interval", "3", iters=4)
    )
    resumed = train(
        1, tiny_argv(embedded_cache, *explicit, "--save", ckpt, "--load", ckpt, iters=4)
    )
    standard = train(1, tiny_argv(embedded_cache, iters=4))  # the same function, SDPA's kernel
    assert first["losses"] + resumed["losses"] == pytest.approx(standard["losses"], rel=1e-5)

    kinds, cls, diff = run_distributed(_export_and_compare, 1, ckpt, hf)
    assert cls == "GPT2LMHeadModel" and kinds is None  # a stock class: its layers are standard
    assert diff < 1e-4


@pytest.mark.slow
def test_a_variant_with_a_setting_and_a_parameter(embedded_cache, tmp_path, monkeypatch):
    """Its setting is a flag, recorded in model_args.json and compared on resume; its parameter
    trains and resumes with the rest of the model; its hooks' statistics reach TensorBoard; both
    evaluation tools run the model its record describes; it exports with its HF layer and its
    setting, and the folder imports back as it (test_a_variant_ships_its_hf_layer)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MEGATRON_FOCUS_VARIANTS", "toy_temperature")
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    bound = ["--attention", "temperature", "--temperature-bound", "2", "--tensorboard-dir", tb]
    bound += ["--position-embedding-type", "rope"]  # passkey prompts outgrow the 32 positions
    first = train(
        1, tiny_argv(embedded_cache, *bound, "--save", ckpt, "--exit-interval", "3", iters=4)
    )
    with open(os.path.join(ckpt, "iter_0000003", "model_args.json")) as f:
        assert json.load(f)["temperature_bound"] == 2.0
    resumed = train(1, tiny_argv(embedded_cache, *bound, "--save", ckpt, "--load", ckpt, iters=4))
    straight = train(1, tiny_argv(embedded_cache, *bound, iters=4))
    assert first["losses"] + resumed["losses"] == pytest.approx(straight["losses"], rel=1e-5)
    learned = _learned_temperatures(os.path.join(ckpt, "iter_0000004"))
    assert len(learned) == 2 and 0 not in learned  # one per layer, moved from its start
    events = EventAccumulator(tb)
    events.Reload()
    logged = [events.Scalars(f"temperature/layer{n:02d}/t")[-1].value for n in (1, 2)]
    assert logged == pytest.approx([2 ** math.tanh(w) for w in learned], rel=1e-5)

    _a_variant_ships_its_hf_layer(ckpt, tmp_path, monkeypatch)

    built, ppl, passkey = run_distributed(_evaluated, 1, ckpt, embedded_cache, str(tmp_path))
    assert built == [(2.0, w) for w in learned]  # the recorded bound, not the flag's default 4
    assert ppl["attention"] == "temperature" and ppl["seq_lengths"] == [16, 32]
    assert all(math.isfinite(row["loss"]) for row in ppl["rows"])
    assert [(r["mode"], r["length"], r["depth"]) for r in passkey["rows"]] == [
        (None, 100, 0.0),
        (None, 100, 1.0),
    ]

    default_bound = tiny_argv(
        embedded_cache, "--attention", "temperature", "--position-embedding-type", "rope"
    ) + ["--load", ckpt]
    with pytest.raises(Exception, match=r"temperature_bound: checkpoint 2.0, this run 4.0"):
        train(1, default_bound)


def test_a_standard_models_weights_start_a_variant_with_weights_of_its_own(
    embedded_cache, tmp_path, monkeypatch, capfd
):
    """--finetune from a standard model's checkpoint into a variant with a parameter of its own:
    the check and the load agree. The standard weights load and the variant's own start as
    initialised, said in one line (its temperature starts at 1: the same function, so the first
    loss is the standard model's from the same weights); another variant's checkpoint is refused
    before any model is built."""
    monkeypatch.setenv("MEGATRON_FOCUS_VARIANTS", "toy_temperature,toy_variant")
    ckpt, other = str(tmp_path / "standard"), str(tmp_path / "explicit")
    one = ["--lr-warmup-iters", "0"]  # runs of one iteration
    train(1, tiny_argv(embedded_cache, *one, "--save", ckpt, iters=2))
    train(1, tiny_argv(embedded_cache, *one, "--attention", "explicit", "--save", other, iters=1))
    capfd.readouterr()
    start = [*one, "--finetune", "--load"]
    tuned = train(1, tiny_argv(embedded_cache, "--attention", "temperature", *start, ckpt, iters=1))
    said = [line for line in capfd.readouterr().out.splitlines() if "as initialised" in line]
    assert len(said) == 1 and "its 2 weights of its own" in said[0], said
    standard = train(1, tiny_argv(embedded_cache, *start, ckpt, iters=1))
    assert tuned["losses"] == pytest.approx(standard["losses"], rel=1e-5)
    with pytest.raises(Exception, match=r"of another model: attention: checkpoint 'explicit'"):
        train(1, tiny_argv(embedded_cache, "--attention", "temperature", *start, other, iters=1))


@pytest.mark.slow
def test_a_parameter_split_over_tensor_parallel_ranks(embedded_cache, tmp_path, monkeypatch):
    """A variant's per-head parameter, split over TP ranks as its core attention declares:
    trains at TP 2 as at TP 1, resumes at TP 1, exports (every head's value in place: the HF
    model's logits are the native model's) and imports back at TP 2, computing the same."""
    monkeypatch.setenv("MEGATRON_FOCUS_VARIANTS", "toy_head_scale")
    tp2, tp1 = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    scaled = ["--attention", "head-scale"]
    first = train(
        2,
        tiny_argv(embedded_cache, *scaled, "--tensor-model-parallel-size", "2", iters=4)
        + ["--save", tp2, "--exit-interval", "3"],
    )
    resumed = train(1, tiny_argv(embedded_cache, *scaled, "--load", tp2, "--save", tp1, iters=4))
    straight = train(1, tiny_argv(embedded_cache, *scaled, iters=4))
    assert first["losses"] + resumed["losses"] == pytest.approx(straight["losses"], rel=1e-4)
    hf = str(tmp_path / "hf")
    kinds, _, diff = run_distributed(_export_and_compare, 1, tp2, hf)
    assert set(kinds) == {"head-scale"} and diff < 1e-4
    scales = run_distributed(_head_scales, 1, hf, str(tmp_path / "back"), tp2)
    assert len(set(scales["exported"])) == len(scales["exported"])  # the heads learned apart
    assert scales["imported"] == scales["exported"] and scales["diff"] < 1e-4


def _head_scales(hf, back, ckpt):
    """Layer 1's s in the export, and in the export imported at TP 2 (its two shards side by
    side); max |logits| difference of that import against the checkpoint exported."""
    from safetensors.torch import load_file

    from megatron_focus.checkpoint.format import model_file
    from megatron_focus.hf import import_from_hf, native_logits

    import_from_hf(hf, back, tensor_model_parallel_size=2, progress=False)
    name = "decoder.layers.0.self_attention.core_attention.s"
    tag = os.path.join(back, "iter_0000000")
    shards = [torch.load(model_file(tag, r), weights_only=False)["module"][name] for r in (0, 1)]
    exported = load_file(os.path.join(hf, "model.safetensors"))["model.layers.0.self_attn.s"]
    diff = (native_logits(back, TOKENS) - native_logits(ckpt, TOKENS)).abs().max()
    return {
        "exported": exported.tolist(),
        "imported": torch.cat(shards).tolist(),
        "diff": float(diff),
    }


def test_a_setting_the_hf_layer_cannot_take_is_refused_by_name(monkeypatch):
    """Registered as computing the HF model's standard layer, a variant's recorded setting
    would load at a default there: the export is refused, naming it."""
    monkeypatch.setenv("MEGATRON_FOCUS_VARIANTS", "toy_temperature")
    message = run_distributed(_exported_as_standard, 1)
    assert message == (
        "--attention temperature-as-standard records temperature_bound, which the HF model's "
        "'standard' layer has no setting for: not exported, as it would load at a default"
    )


def _exported_as_standard():
    import dataclasses

    from megatron_focus.hf.architecture import check_exportable
    from megatron_focus.model.config import ModelConfig
    from megatron_focus.training.arguments import parse_args
    from megatron_focus.variants import register, variant

    register(
        dataclasses.replace(
            variant("temperature"),
            name="temperature-as-standard",
            hf_attention="standard",
            hf_layer=None,
        )
    )
    args = parse_args(["--attention", "temperature-as-standard", "--temperature-bound", "2"])
    record = args.model_config.record(128, 1, args.seq_length)
    assert record["temperature_bound"] == 2.0
    try:
        check_exportable(ModelConfig.from_record(record, 100))
    except NotImplementedError as refused:
        return str(refused)


# A process that has never heard of the variant (no MEGATRON_FOCUS_VARIANTS, nothing of tests/ or
# megatron_focus on its path) loads an exported folder: its logits, those of the model saved again
# and loaded from there, and those with every TemperatureAttention's bound at the flag's default.
ALONE = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, __version__
folder, tokens, resaved, out = sys.argv[1:]
tokens = torch.tensor(json.loads(tokens))
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
model.save_pretrained(resaved)
again = AutoModelForCausalLM.from_pretrained(resaved, trust_remote_code=True).eval()
layers = [m for m in model.modules() if type(m).__name__ == "TemperatureAttention"]
with torch.no_grad():
    logits, resaved_logits = model(tokens).logits, again(tokens).logits
    bounds = [m.bound for m in layers]
    for m in layers:
        m.bound = 4.0
    default = model(tokens).logits
ours = ("megatron_focus", "toy_temperature", "toy_temperature_hf")
json.dump(dict(
    transformers=__version__, cls=type(model).__name__, bounds=bounds,
    config_bound=model.config.temperature_bound,
    imported=sorted(m for m in sys.modules if m.split(".")[0] in ours),
    logits=logits.tolist(), resaved=resaved_logits.tolist(), default=default.tolist(),
), open(out, "w"))
"""


def _loaded_alone(folder, work, transformers_dir=None):
    """ALONE's report of `folder`, under the venv's transformers or `transformers_dir`'s."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("MEGATRON_FOCUS_VARIANTS", "PYTHONPATH")
    }
    if transformers_dir is not None:
        env["PYTHONPATH"] = transformers_dir
    out, resaved = os.path.join(work, "alone.json"), tempfile.mkdtemp(dir=work, prefix="resaved")
    subprocess.run(
        [sys.executable, "-c", ALONE, folder, json.dumps(TOKENS.tolist()), resaved, out],
        cwd=work,
        env=env,
        check=True,
    )
    with open(out) as f:
        return json.load(f)


def _a_variant_ships_its_hf_layer(ckpt, tmp_path, monkeypatch):
    """The temperature checkpoint (bound 2) exports with its HF layer file: a process knowing
    nothing of the variant (transformers 5, and 4.57 where MEGATRON_FOCUS_TRANSFORMERS4 names
    it) computes the native logits; the folder imports back (its w set far from 0, where the
    bound matters) to a checkpoint recording the bound it holds, which exports alike again;
    without the variant registered, the import is refused by name."""
    hf, edited = str(tmp_path / "temperature-hf"), str(tmp_path / "temperature-hf-edited")
    back, again = str(tmp_path / "temperature-back"), str(tmp_path / "temperature-hf-again")
    first = run_distributed(_exported, 1, ckpt, hf)
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    assert config["temperature_bound"] == 2.0 and config["layer_attention"] == ["temperature"] * 2
    assert config["variant_layers"] == {"temperature": "toy_temperature_hf.TemperatureAttention"}
    assert config["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_megatron_focus_variants.MegatronFocusForCausalLM"
    )
    transformers4 = os.environ.get("MEGATRON_FOCUS_TRANSFORMERS4")
    for transformers_dir in [None] + ([transformers4] if transformers4 else []):
        alone = _loaded_alone(hf, str(tmp_path), transformers_dir)
        assert alone["transformers"].startswith("4." if transformers_dir else "5.")
        assert alone["imported"] == [] and alone["cls"] == "MegatronFocusForCausalLM"
        assert alone["config_bound"] == 2.0 and alone["bounds"] == [2.0, 2.0]
        torch.testing.assert_close(torch.tensor(alone["logits"]), first, rtol=0, atol=1e-4)
        assert alone["resaved"] == alone["logits"]

    _with_temperature_weights(hf, edited, [1.5, -1.0])
    flags, recorded, native = run_distributed(_imported_and_exported, 1, edited, back, again)
    assert flags[flags.index("--attention") + 1] == "temperature"
    assert flags[flags.index("--temperature-bound") + 1] == "2.0"
    assert recorded == 2.0
    alone = _loaded_alone(again, str(tmp_path))
    assert alone["bounds"] == [2.0, 2.0]
    torch.testing.assert_close(torch.tensor(alone["logits"]), native, rtol=0, atol=1e-4)
    # the bound matters: at the flag's default the model computes something else
    assert (torch.tensor(alone["default"]) - native).abs().max() > 1e-3

    without = str(tmp_path / "temperature-hf-without-bound")
    shutil.copytree(hf, without)
    with open(os.path.join(without, "config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if k != "temperature_bound"}, f)
    assert run_distributed(_refused_import, 1, without, str(tmp_path / "without")) == (
        "the HF config lacks temperature_bound, which --attention temperature records: not "
        "imported, as it would come back at a default"
    )
    with monkeypatch.context() as unregistered:
        unregistered.delenv("MEGATRON_FOCUS_VARIANTS")
        message = run_distributed(_refused_import, 1, hf, str(tmp_path / "unregistered"))
    assert message == (
        "layer_attention 'temperature': the layer of attention variant 'temperature' "
        "(toy_temperature_hf.TemperatureAttention), which is not registered here; register it "
        "(MEGATRON_FOCUS_VARIANTS) to import the model"
    )


def _with_temperature_weights(hf, edited, ws):
    """A copy of the folder `hf` whose layer i holds `ws[i]` as its w."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf, edited)
    path = os.path.join(edited, "model.safetensors")
    weights = load_file(path)
    for i, w in enumerate(ws):
        weights[f"model.layers.{i}.self_attn.w"] = torch.tensor([w])
    save_file(weights, path, metadata={"format": "pt"})


def _exported(ckpt, hf):
    """The native logits of `ckpt`, exported to `hf`."""
    from megatron_focus.hf import export_to_hf, native_logits

    export_to_hf(ckpt, hf, progress=False)
    return native_logits(ckpt, TOKENS)


def _imported_and_exported(hf, ckpt, again):
    """(the model flags, the bound model_args.json records, the native logits) of `hf` imported
    as `ckpt`, which is exported to `again`."""
    from megatron_focus.hf import import_from_hf

    flags = import_from_hf(hf, ckpt, progress=False)
    with open(os.path.join(ckpt, "iter_0000000", "model_args.json")) as f:
        recorded = json.load(f)["temperature_bound"]
    return flags, recorded, _exported(ckpt, again)


def _refused_import(hf, ckpt):
    from megatron_focus.hf import import_from_hf

    try:
        import_from_hf(hf, ckpt, progress=False)
    except ValueError as refused:
        return str(refused)


def test_two_shipped_layers_of_one_class_name_register_each(tmp_path, monkeypatch):
    """Two variants' HF layers whose classes share a name, in files of their own: the folder's
    module registers each kind with its own class; two files of one name (in two packages) are
    refused by name before any weight is read (the second copy would replace the first)."""
    import importlib

    from megatron_focus.hf import export
    from megatron_focus.variants import VARIANTS, AttentionVariant

    source = open(os.path.join(ROOT, "tests", "toy_temperature_hf.py")).read()
    layers = {}
    for kind, directory in (("first", "a"), ("second", "b")):
        os.makedirs(tmp_path / directory)
        path = str(tmp_path / directory / f"{kind}_layer.py")
        with open(path, "w") as f:
            f.write(source + f"\nTemperatureAttention.which = {kind!r}\n")
        monkeypatch.syspath_prepend(str(tmp_path / directory))
        layers[kind] = importlib.import_module(f"{kind}_layer").TemperatureAttention, path
    folder = tmp_path / "folder_pkg"
    os.makedirs(folder)
    for name in export.MODEL_CODE[:2]:
        shutil.copyfile(
            os.path.join(ROOT, "megatron_focus", "hf", f"{name}.py"), folder / f"{name}.py"
        )
    (folder / "__init__.py").write_text("")
    (folder / "config.json").write_text(json.dumps({"auto_map": {}}))
    export._ship_layers(str(folder), layers)
    monkeypatch.syspath_prepend(str(tmp_path))
    shipped = importlib.import_module(f"folder_pkg.{export.VARIANT_MODELING}")
    model_code = sys.modules["folder_pkg.modeling_megatron_focus"]
    attention = model_code.ATTENTION
    assert issubclass(shipped.MegatronFocusForCausalLM, model_code.MegatronFocusForCausalLM)
    assert attention["first"].which == "first" and attention["second"].which == "second"

    shipped_layers = {}
    for package in ("pa", "pc"):
        os.makedirs(tmp_path / package)
        (tmp_path / package / "__init__.py").write_text("")
        shutil.copyfile(layers["first"][1], tmp_path / package / "first_layer.py")
        kind = f"{package}-variant"
        shipped_layers[kind] = f"{package}.first_layer:TemperatureAttention"
        core = "megatron_focus.model.core_attention:CoreAttention"
        monkeypatch.setitem(
            VARIANTS, kind, AttentionVariant(kind, core, hf_layer=shipped_layers[kind])
        )
    with pytest.raises(ValueError, match="files of one name.*pa.first_layer.py.*rename one"):
        export._shipped_layers(shipped_layers)


def test_a_setting_the_hf_config_already_has_is_refused_by_name():
    """A variant shipping its HF layer writes its settings into the HF config under their keys:
    one the config already uses for its own (here `head_dim`) is refused, naming it."""
    assert run_distributed(_exported_with_a_taken_key, 1) == (
        "--attention head-variant records head_dim, which the HF config already uses for a "
        "setting of its own: not exported"
    )


def _exported_with_a_taken_key():
    import dataclasses

    from megatron_focus.hf import families
    from megatron_focus.model.config import ModelConfig
    from megatron_focus.settings import VariantSettings, setting
    from megatron_focus.training.arguments import parse_args
    from megatron_focus.variants import AttentionVariant, register

    @dataclasses.dataclass(frozen=True)
    class HeadConfig(VariantSettings, prefix="head"):
        dim: int = setting(8, "a setting whose key is the HF config's head_dim")

    register(
        AttentionVariant(
            "head-variant",
            "megatron_focus.model.core_attention:CoreAttention",
            settings=HeadConfig,
            hf_layer="toy_temperature_hf:TemperatureAttention",
        )
    )
    record = parse_args([]).model_config.record(128, 1, None)
    arch = ModelConfig.from_record({**record, "attention": "head-variant", "head_dim": 8}, 100)
    try:
        families.hf_config(families.CUSTOM, arch, {})
    except NotImplementedError as refused:
        return str(refused)


def _evaluated(ckpt, cache, folder):
    """(each layer's (bound, w) in the native model built from the checkpoint, eval_ppl's
    report, eval_passkey's report), each tool run as its command line runs it."""
    import runpy
    import sys

    from toy_temperature import TemperatureAttention

    from megatron_focus import platform
    from megatron_focus.checkpoint.native import (
        checkpoint_tag_dir,
        checkpoint_vocabulary,
        load_native_model,
    )

    ppl = ["--data-cache-path", cache, "--eval-iters", "1", "--micro-batch-size", "2"]
    reports = []
    for script, flags in (
        ("tools/eval_ppl.py", ppl + ["--seq-lengths", "16", "32"]),
        ("tools/eval_passkey.py", ["--lengths", "100", "--depths", "0", "1", "--trials", "1"]),
    ):
        reports.append(os.path.join(folder, os.path.basename(script) + ".json"))
        sys.argv = [script, "--load", ckpt, *flags, "--json", reports[-1]]
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    platform.init_distributed(1)
    tag_dir = checkpoint_tag_dir(ckpt)
    _, model = load_native_model(tag_dir, checkpoint_vocabulary(tag_dir)[0])
    built = [(m.bound, m.w.item()) for m in model.modules() if isinstance(m, TemperatureAttention)]
    return built, *(json.load(open(path)) for path in reports)


def _learned_temperatures(tag_dir):
    """Each layer's w, from the model state DeepSpeed saved."""
    [path] = glob.glob(os.path.join(tag_dir, "*model_states.pt"))
    module = torch.load(path, weights_only=True)["module"]
    return [w.item() for name, w in module.items() if name.endswith(".core_attention.w")]


def test_the_planner_counts_a_variants_parameters(monkeypatch):
    """The planner's count of a tensor-parallel rank's parameters is what each rank of a TP 2
    model holds, for variants with a replicated parameter (one temperature per layer) and with a
    parameter split over the ranks (one scale per head), declared nowhere but where they are
    created."""
    monkeypatch.setenv("MEGATRON_FOCUS_VARIANTS", "toy_temperature,toy_head_scale")
    counted, built = run_distributed(_counted_and_built, 2)
    assert counted == built
    # over standard attention, per layer: the one temperature; half the 4 heads' scales
    assert [c - counted[0] for c in counted[1:]] == [2 * 1, 2 * 2]


def _counted_and_built():
    """([parameters of TP rank 0 as counted], [as built]) for standard, temperature and
    head-scale attention at TP 2, two layers."""
    import torch.distributed as dist

    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model
    from megatron_focus.planner import count_parameters
    from megatron_focus.training.arguments import parse_args

    small = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    platform.init_distributed(2)
    counted, built = [], []
    for attention in ("standard", "temperature", "head-scale"):
        args = parse_args(small + ["--attention", attention, "--tensor-model-parallel-size", "2"])
        counted.append(count_parameters(args, 1000, tp=2).per_tp_rank(2))
        mine = sum(p.numel() for p in build_model(args, 1000).parameters())
        theirs = [None, None]
        dist.all_gather_object(theirs, mine)
        assert theirs[0] == theirs[1]  # the planner counts one rank for all
        built.append(mine)
    return counted, built


def test_a_variant_registered_in_process_keeps_its_settings(monkeypatch):
    """Registered after the run config's sections were generated (a notebook's or a test's
    `register`, not the environment variable's route): its flag's value reaches the run config
    and the variant's settings, and survives `replace`."""
    monkeypatch.delenv("MEGATRON_FOCUS_VARIANTS", raising=False)
    assert run_distributed(_registered_late, 1) == (2.5, 2.5, 2.5, 3.0)


def _registered_late():
    import importlib

    from megatron_focus.config import run_config  # noqa: F401 -- its sections made first
    from megatron_focus.training.arguments import parse_args
    from megatron_focus.variants import variant

    importlib.import_module("toy_temperature")  # registers "temperature" here, now
    small = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    config = parse_args(small + ["--attention", "temperature", "--temperature-bound", "2.5"])
    settings = variant("temperature").settings_from(config)
    wider = config.replace(temperature_bound=3.0)
    return (config.temperature_bound, settings.bound, config.flags()["temperature_bound"],
            wider.temperature_bound)  # fmt: skip


def test_unknown_and_duplicate_variants_are_refused():
    from megatron_focus.variants import VARIANTS, register, variant

    with pytest.raises(ValueError, match="unknown --attention 'sparse'; choose from standard"):
        variant("sparse")
    with pytest.raises(ValueError, match="already registered"):
        register(VARIANTS["xsa"])


def test_a_variant_module_that_cannot_be_imported_is_one_error_line():
    import os
    import subprocess
    import sys

    env = {**os.environ, "MEGATRON_FOCUS_VARIANTS": "no_such_variants_module"}
    out = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--help"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "error: MEGATRON_FOCUS_VARIANTS names 'no_such_variants_module', which cannot be "
        "imported: No module named 'no_such_variants_module'"
    ]
