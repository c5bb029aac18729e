"""`--ckpt-format torch_dist`: checkpoints that Megatron-Core's own `dist_checkpointing` reads and
writes for its own GPTModel (built here from Megatron-Core's local layer spec, the independent
reference) load into this trainer's model and back, with the same logits, at TP 1 and 2 and
across them."""

import json
import os

import pytest
import torch

import megatron_lm_record
from distributed import run_distributed
from tiny_runs import TINY, train

VOCAB = 200  # NullTokenizer: 201 ids with the end of document, padded to 256
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]
MODEL = TINY + MOCK + ["--train-iters", "4"]


def _args(tp: int, *extra):
    from megatron_focus import platform
    from megatron_focus.training.arguments import parse_args

    platform.init_distributed(tp)
    return parse_args(MODEL + ["--tensor-model-parallel-size", str(tp), *extra])


def _ours(args, seed: int):
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model

    platform.manual_seed(seed)
    return build_model(args, VOCAB + 1).eval()


def _megatron_core(args, seed: int):
    """Megatron-Core's GPTModel with its own local layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_focus import platform
    from megatron_focus.model.gpt import padded_vocab_size, transformer_config

    platform.manual_seed(seed)
    return GPTModel(
        config=transformer_config(args.model_config, args.parallel, args.training),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=padded_vocab_size(VOCAB + 1, 128, args.tensor_model_parallel_size),
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    ).eval()


def _logits(model) -> torch.Tensor:
    """Full-vocabulary logits of a fixed batch (gathered over tensor-parallel ranks); Megatron's
    own attention is given its causal mask (True: masked), ours is causal without one."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_focus.model.core_attention import CoreAttention

    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(2, 32)
    ours = any(isinstance(m, CoreAttention) for m in model.modules())
    mask = None if ours else torch.triu(torch.ones(32, 32, dtype=torch.bool), 1)[None, None]
    assert isinstance(model, GPTModel)
    with torch.no_grad():
        return gather_from_tensor_model_parallel_region(model(tokens, positions, mask))


def _megatron_lm(tp: int, seed: int):
    """Megatron-LM's record of MODEL's flags and the model pretrain_gpt.py builds from it."""
    from megatron_focus import platform

    argv = MODEL + ["--max-position-embeddings", "32", "--tensor-model-parallel-size", str(tp)]
    record = megatron_lm_record.record(argv, VOCAB + 1)
    platform.manual_seed(seed)
    return record, megatron_lm_record.gpt_model(record).eval()


def _both_ways(tp: int, folder: str, attention: str) -> dict:
    """Ours -> Megatron-Core and Megatron-Core -> ours at TP `tp`; returns the logits."""
    from megatron.core import dist_checkpointing

    from megatron_focus.checkpoint import torch_dist

    args = _args(tp)
    ours = _ours(args, seed=1)
    record = torch_dist.megatron_args(args, 256, consumed=0)
    tag_dir = os.path.join(folder, "ours")
    if torch.distributed.get_rank() == 0:
        os.makedirs(tag_dir)
    torch.distributed.barrier()
    torch_dist.save(ours, tag_dir, record, iteration=5, schedule={})
    reference = _megatron_core(args, seed=2)
    before = _logits(reference)
    loaded = dist_checkpointing.load({"model": reference.sharded_state_dict()}, tag_dir)
    reference.load_state_dict(loaded["model"])
    record, theirs = _megatron_lm(tp, seed=3)
    megatron_lm_record.save(theirs, os.path.join(folder, "megatron"), record)
    into_ours = _ours(_args(tp, "--attention", attention), seed=4)
    routers = {k: v.clone() for k, v in into_ours.state_dict().items() if ".router." in k}
    torch_dist.load_model(
        into_ours,
        os.path.join(folder, "megatron", "iter_0000007"),
        may_miss=lambda name: ".router." in name,
    )
    weights = into_ours.state_dict()
    return {
        "ours": _logits(ours),
        "before": before,
        "reference": _logits(reference),
        "theirs": _logits(theirs),
        "into ours": _logits(into_ours),
        "same weights": all(
            torch.equal(weights[k], v)
            for k, v in theirs.state_dict().items()
            if not k.endswith("_extra_state")
        ),
        "routers kept": all(torch.equal(weights[k], v) for k, v in routers.items()),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_core_reads_ours_and_we_read_megatron_cores(tmp_path, tp):
    out = run_distributed(_both_ways, tp, tp, str(tmp_path), "standard")
    assert not torch.allclose(out["before"], out["ours"])  # another model before the load
    # the same weights in two attention implementations (Megatron's and ours)
    torch.testing.assert_close(out["reference"], out["ours"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["into ours"], out["theirs"], rtol=1e-5, atol=1e-5)
    assert out["same weights"] and out["routers kept"]


def test_megatron_lm_checkpoint_starts_focus_with_fresh_routers(tmp_path):
    """A retrofit's start: every weight from the standard-attention checkpoint, routers fresh."""
    out = run_distributed(_both_ways, 1, 1, str(tmp_path), "focus")
    assert out["same weights"] and out["routers kept"]


def _save_focus_at_tp2(folder: str) -> torch.Tensor:
    from megatron.core import parallel_state

    from megatron_focus.checkpoint import torch_dist

    args = _args(2, "--attention", "focus")
    model = _ours(args, seed=5)
    sharded = model.sharded_state_dict()
    routers = [v for k, v in sharded.items() if ".router." in k]
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    # replicated over TP: the whole tensor on every rank, TP rank 0's the one written
    assert routers and all(
        r.local_shape == r.global_shape[1:] and r.replica_id[1] == tp_rank for r in routers
    )
    if torch.distributed.get_rank() == 0:
        os.makedirs(folder)
    torch.distributed.barrier()
    torch_dist.save(model, folder, torch_dist.megatron_args(args, 256, 0), 3, schedule={})
    return _logits(model)


def _load_focus_at_tp1(folder: str) -> torch.Tensor:
    from megatron_focus.checkpoint import torch_dist

    model = _ours(_args(1, "--attention", "focus"), seed=6)
    torch_dist.load_model(model, folder)
    return _logits(model)


def test_focus_saved_at_tp2_loads_at_tp1(tmp_path):
    folder = str(tmp_path / "iter_0000003")
    at_tp2 = run_distributed(_save_focus_at_tp2, 2, folder)
    at_tp1 = run_distributed(_load_focus_at_tp1, 1, folder)
    torch.testing.assert_close(at_tp1, at_tp2, rtol=1e-5, atol=1e-5)


def _load_refused(folder: str, *extra) -> str:
    from megatron_focus.checkpoint import torch_dist

    model = _ours(_args(1, *extra), seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises((ValueError, FileNotFoundError)) as refused:
        torch_dist.load_model(model, folder)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    return str(refused.value)


def _write_megatron_lm(folder: str) -> None:
    _args(1)  # the process groups
    record, model = _megatron_lm(1, seed=8)
    megatron_lm_record.save(model, folder, record)


def test_bad_checkpoints_are_refused_by_name_before_any_weight_loads(tmp_path):
    folder = str(tmp_path / "megatron")
    run_distributed(_write_megatron_lm, 1, folder)
    tag_dir = os.path.join(folder, "iter_0000007")
    wider = run_distributed(_load_refused, 1, tag_dir, "--ffn-hidden-size", "128")
    assert "decoder.layers.mlp.linear_fc1.weight: checkpoint (2, 256, 64)" in wider
    deeper = run_distributed(_load_refused, 1, tag_dir, "--num-layers", "3")
    assert "decoder.layers.self_attention.linear_qkv.weight: checkpoint (2, 192, 64)" in deeper
    gone = run_distributed(_load_refused, 1, str(tmp_path / "nowhere"))
    assert "metadata.json" in gone
    with open(os.path.join(tag_dir, "metadata.json"), "w") as f:
        f.write("{not json")
    damaged = run_distributed(_load_refused, 1, tag_dir)
    assert "metadata.json is not a distributed checkpoint's record" in damaged


def test_torch_dist_under_zero3_is_refused_at_parse_time():
    from megatron_focus.training.arguments import parse_args

    with pytest.raises(ValueError, match="--ckpt-format torch_dist: ZeRO stage 3 partitions"):
        parse_args(MODEL + ["--ckpt-format", "torch_dist", "--zero-stage", "3"])


@pytest.mark.slow
def test_a_run_saved_as_torch_dist_resumes_exactly_and_loads_into_megatron_core(tmp_path):
    """--ckpt-format torch_dist: the run stopped at 2 and resumed equals the straight run; its
    checkpoint is Megatron-LM's layout and Megatron-Core's GPTModel reads its weights."""
    flags = MODEL[:-2] + ["--data-cache-path", str(tmp_path / "cache"), "--train-iters", "4"]
    ckpt = str(tmp_path / "ckpt")
    saving = ["--save", ckpt, "--ckpt-format", "torch_dist"]
    straight = train(1, flags)
    first = train(1, flags + saving + ["--exit-interval", "2"])
    second = train(1, flags + saving + ["--load", ckpt])
    assert first["losses"] + second["losses"] == straight["losses"]
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "4"
    tag_dir = os.path.join(ckpt, "iter_0000004")
    # megatron-core 0.19 keeps the common state among the tensors, earlier ones in common.pt
    assert {"metadata.json", ".metadata"} <= set(os.listdir(tag_dir))
    with open(os.path.join(tag_dir, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    out = run_distributed(_read_run, 1, tag_dir)
    assert out["iteration"] == 4 and out["checkpoint_version"] == 3.0
    assert out["args"].no_save_optim and out["args"].consumed_train_samples == 4 * 8
    # Megatron-LM's scheduler counts samples: 4 iterations of 8
    assert out["opt_param_scheduler"]["num_steps"] == 32
    torch.testing.assert_close(out["megatron-core"], out["ours"], rtol=1e-5, atol=1e-5)


def _read_run(tag_dir: str) -> dict:
    """The run's checkpoint as Megatron-LM reads it, and its weights in Megatron-Core's model
    and, from DeepSpeed's files, in ours."""
    from megatron.core import dist_checkpointing

    from megatron_focus.checkpoint import torch_dist
    from megatron_focus.checkpoint.format import model_file, read_model_file

    args = _args(1)
    reference = _megatron_core(args, seed=9)
    common = torch_dist.common_state(tag_dir, allow_unsafe=False)
    loaded = dist_checkpointing.load({"model": reference.sharded_state_dict()}, tag_dir)
    reference.load_state_dict(loaded["model"])
    ours = _ours(args, seed=10)
    ours.load_state_dict(read_model_file(model_file(tag_dir, 0), False)["module"])
    return {**common, "megatron-core": _logits(reference), "ours": _logits(ours)}


def test_megatron_lm_checkpoint_starts_a_focus_retrofit_run(tmp_path):
    """--retrofit from a Megatron-LM folder: the plan reads its tracker and args, the run trains
    only the routers, and its trained-only checkpoints resume on that base; the folder itself
    resumes with --no-load-optim only (its optimizer state is Megatron's), not under ZeRO-3."""
    folder, run = str(tmp_path / "megatron"), str(tmp_path / "run")
    run_distributed(_write_megatron_lm, 1, folder)
    flags = MODEL[:-2] + ["--data-cache-path", str(tmp_path / "cache"), "--train-iters", "3"]
    retrofit = flags + ["--attention", "focus", "--retrofit", "--save", run, "--save-interval", "2"]
    history = train(1, retrofit + ["--load", folder, "--exit-interval", "2"])
    assert len(history["losses"]) == 2
    assert len(train(1, retrofit + ["--load", run])["losses"]) == 1  # iteration 3, on the base
    with pytest.raises(Exception, match="not supported under ZeRO stage 3"):
        train(1, flags + ["--load", folder, "--no-load-optim", "--zero-stage", "3"])
    with pytest.raises(Exception, match="is Megatron-LM's checkpoint.*--no-load-optim"):
        train(1, flags + ["--load", folder])
    # continued at its iteration 7: iterations 8 and 9 (as Megatron-LM reads ours)
    continued = train(1, flags[:-1] + ["9", "--load", folder, "--no-load-optim"])
    assert len(continued["losses"]) == 2
    # a model its weights would fit but that computes otherwise: refused from its args
    with pytest.raises(Exception, match="another model: normalization: checkpoint 'LayerNorm'"):
        train(1, flags + ["--load", folder, "--finetune", "--normalization", "RMSNorm"])
    from megatron_focus.training.arguments import parse_args

    deeper = [f if f != "2" or flags[i - 1] != "--num-layers" else "5" for i, f in enumerate(flags)]
    assert parse_args(deeper + ["--load", folder, "--finetune"]).num_layers == 5
    read = parse_args(deeper + ["--load", folder, "--finetune", "--use-checkpoint-args"])
    assert read.num_layers == 2 and read.hidden_size == 64


def _same_weights(run_dir: str, megatron_dir: str) -> bool:
    """Whether the run's saved weights (DeepSpeed's file) are the Megatron-LM checkpoint's, as
    Megatron-Core's GPTModel reads it (the routers aside)."""
    from megatron.core import dist_checkpointing

    from megatron_focus.checkpoint.format import model_file, read_model_file

    reference = _megatron_core(_args(1), seed=11)
    loaded = dist_checkpointing.load({"model": reference.sharded_state_dict()}, megatron_dir)
    reference.load_state_dict(loaded["model"])
    saved = read_model_file(model_file(run_dir, 0), False)["module"]
    return all(
        torch.equal(saved[k], v)
        for k, v in reference.state_dict().items()
        if not k.endswith("_extra_state")
    )


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["xsa", "focus"])
def test_megatron_lm_checkpoint_starts_an_xsa_or_focus_run(tmp_path, attention):
    """--pretrained-checkpoint of a Megatron-LM folder: a run of another attention variant from
    its weights (Focus's routers fresh), from iteration 0; at LR 0 it saves them unchanged."""
    folder = str(tmp_path / "megatron")
    run_distributed(_write_megatron_lm, 1, folder)
    flags = MODEL[:-2] + ["--data-cache-path", str(tmp_path / "cache"), "--train-iters", "3"]
    run = str(tmp_path / "run")
    argv = ["--attention", attention, "--pretrained-checkpoint", folder, "--save", run]
    history = train(1, flags + argv + ["--lr", "0", "--min-lr", "0"])
    assert len(history["losses"]) == 3
    megatron_dir = os.path.join(folder, "iter_0000007")
    assert run_distributed(_same_weights, 1, os.path.join(run, "iter_0000003"), megatron_dir)
