"""--retrofit: Focus added to a trained model, only the routers trained and saved."""

import json
import os
import shutil

import pytest
import torch

from tiny_runs import full_weights, tiny_argv, train


def _module(ckpt, tag=None):
    tag = tag or open(os.path.join(ckpt, "latest")).read()
    shard = os.path.join(ckpt, tag, "mp_rank_00_model_states.pt")
    module = torch.load(shard, map_location="cpu", weights_only=False)["module"]
    return {k: v for k, v in module.items() if "_extra_state" not in k}


def _optimizer_numel(ckpt):
    """Elements of the (ZeRO-1) optimizer files' tensors: master weights and Adam moments (the
    step counters, scalars, aside)."""
    tag_dir = os.path.join(ckpt, open(os.path.join(ckpt, "latest")).read())

    def numel(obj):
        if torch.is_tensor(obj):
            return obj.numel() if obj.ndim else 0
        if isinstance(obj, dict):
            return sum(numel(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(numel(v) for v in obj)
        return 0

    files = [f for f in os.listdir(tag_dir) if f.endswith("optim_states.pt")]
    assert files
    return sum(
        numel(torch.load(os.path.join(tag_dir, f), weights_only=False)["optimizer_state_dict"])
        for f in files
    )


def test_retrofit_trains_only_the_routers(embedded_cache, tmp_path):
    base_ckpt, retro_ckpt, full_ckpt = (str(tmp_path / d) for d in ("base", "retro", "full"))
    train(1, tiny_argv(embedded_cache, "--save", base_ckpt, iters=3))
    base = full_weights(base_ckpt)
    focus = [
        "--attention",
        "focus",
        "--focus-window",
        "4",
        "--focus-groups",
        "4",
        "--eval-interval",
        "3",
        "--lr",
        "1e-2",
    ]
    train(
        1,
        tiny_argv(
            embedded_cache,
            *focus,
            "--retrofit",
            "--load",
            base_ckpt,
            "--save",
            retro_ckpt,
            "--save-interval",
            "1",
            iters=3,
        ),
    )
    routers = 2 * (64 * 16 + 4 * 16)
    # The checkpoint holds the routers only, their optimizer state only, and names its base.
    first, trained = _module(retro_ckpt, "iter_0000001"), _module(retro_ckpt)
    assert (
        all(".router." in k for k in trained)
        and sum(w.numel() for w in trained.values()) == routers
    )
    assert all(not torch.equal(trained[k], first[k]) for k in trained)  # the routers learn
    assert _optimizer_numel(retro_ckpt) == 3 * routers  # fp32 master, exp_avg, exp_avg_sq
    assert _optimizer_numel(base_ckpt) == 3 * sum(w.numel() for w in _module(base_ckpt).values())
    with open(os.path.join(retro_ckpt, "iter_0000003", "base_checkpoint.json")) as f:
        assert json.load(f) == {"load": os.path.abspath(base_ckpt), "tag": "iter_0000003"}
    after = full_weights(retro_ckpt)  # read through the base, as the HF export reads it
    assert after.keys() - base.keys() == trained.keys()
    for name, weight in base.items():
        assert torch.equal(after[name], weight), name  # every base weight bit-identical
    # Resuming a retrofit run is an ordinary resume (iteration 3 -> 4, base still frozen), and
    # its checkpoints still name the original base.
    resumed = train(
        1,
        tiny_argv(
            embedded_cache,
            *focus,
            "--retrofit",
            "--load",
            retro_ckpt,
            "--save",
            retro_ckpt,
            "--override-opt_param-scheduler",
            iters=4,
        ),
    )
    assert len(resumed["losses"]) == 1
    with open(os.path.join(retro_ckpt, "iter_0000004", "base_checkpoint.json")) as f:
        assert json.load(f)["load"] == os.path.abspath(base_ckpt)
    after_resume = full_weights(retro_ckpt)
    assert all(torch.equal(after_resume[k], w) for k, w in base.items())
    assert all(not torch.equal(after_resume[k], after[k]) for k in trained)
    # --save-full: a complete checkpoint, equal to base + routers.
    train(
        1,
        tiny_argv(
            embedded_cache,
            *focus,
            "--retrofit",
            "--save-full",
            "--load",
            base_ckpt,
            "--save",
            full_ckpt,
            iters=3,
        ),
    )
    assert not os.path.exists(os.path.join(full_ckpt, "iter_0000003", "base_checkpoint.json"))
    whole = _module(full_ckpt)
    assert whole.keys() == after.keys() and sum(".router." in k for k in whole) == len(trained)
    # A trained-only checkpoint whose base is gone is refused before any weight is read.
    shutil.rmtree(base_ckpt)
    with pytest.raises(Exception, match="holds only a retrofit.s routers"):
        train(
            1,
            tiny_argv(
                embedded_cache,
                *focus,
                "--retrofit",
                "--load",
                retro_ckpt,
                "--save",
                retro_ckpt,
                iters=5,
            ),
        )


@pytest.mark.slow
def test_retrofit_under_tensor_and_sequence_parallelism(embedded_cache, tmp_path):
    """TP = 2 with SP: the routers stay identical on both ranks (the merge checks it), and the
    frozen weights bit-identical to the base."""
    base_ckpt, retro_ckpt = str(tmp_path / "base"), str(tmp_path / "retro")
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "2"]
    train(2, tiny_argv(embedded_cache, *tp, "--save", base_ckpt, iters=3))
    train(
        2,
        tiny_argv(
            embedded_cache,
            *tp,
            "--attention",
            "focus",
            "--focus-window",
            "4",
            "--focus-groups",
            "4",
            "--lr",
            "1e-2",
            "--retrofit",
            "--load",
            base_ckpt,
            "--save",
            retro_ckpt,
            iters=3,
        ),
    )
    base, after = full_weights(base_ckpt), full_weights(retro_ckpt)
    assert all(torch.equal(after[k], w) for k, w in base.items())
    assert len(after.keys() - base.keys()) == 4  # 2 layers x (W_g, C)


@pytest.mark.slow
def test_retrofit_lowers_the_validation_loss(embedded_cache, tmp_path):
    """The paper's claim at our scale: a model pretrained here, Focus added (window 2, so most
    pairs are distant), only the routers trained. The run validates at iteration 0 (the base with
    fresh routers) and must win back a good part of what adding Focus cost, in soft mode; the
    sparse (top-2) loss is reported beside it and falls too."""
    model = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "128",
        "--micro-batch-size",
        "8",
        "--global-batch-size",
        "8",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--eval-iters",
        "4",
        "--log-interval",
        "50",
        "--data-cache-path",
        embedded_cache,
    ]
    base_ckpt = str(tmp_path / "base")
    base = train(
        1,
        model
        + ["--train-iters", "400", "--lr", "3e-3", "--eval-interval", "400", "--save", base_ckpt],
    )
    retrofit = train(
        1,
        model
        + [
            "--train-iters",
            "100",
            "--lr",
            "1e-2",
            "--eval-interval",
            "100",
            "--attention",
            "focus",
            "--focus-window",
            "2",
            "--focus-groups",
            "4",
            "--retrofit",
            "--load",
            base_ckpt,
        ],
    )
    ((_, pretrained),) = base["validation"]
    (start_iter, start), (end_iter, end) = retrofit["validation"]
    (_, sparse_start), (_, sparse_end) = retrofit["validation sparse"]
    assert (start_iter, end_iter) == (0, 100)
    assert start > pretrained  # fresh routers cut distant pairs: adding Focus costs something
    assert end < start - 0.25 * (start - pretrained)
    assert sparse_end < sparse_start


def test_retrofit_trains_148k_parameters_on_gpt2_124m_shape(single_process):
    """The paper's count: 12 x (768 x 16 + 4 x 16) = 148,224 router parameters, all else frozen."""
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    platform.manual_seed(0)
    args = parse_args(
        [
            "--num-layers",
            "12",
            "--hidden-size",
            "768",
            "--num-attention-heads",
            "12",
            "--seq-length",
            "1024",
            "--attention",
            "focus",
            "--focus-groups",
            "4",
            "--retrofit",
            "--load",
            "unused",
            "--data-path",
            "x",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            "y",
        ]
    )
    model = build_model(args, 50257)
    router = sum(p.numel() for n, p in model.named_parameters() if ".router." in n)
    total = sum(p.numel() for p in model.parameters())
    assert router == 148_224
    # GPT-2 124M (HF's count, 124,439,808) plus Megatron's vocabulary padding to 50,304 rows
    assert total - router == 124_439_808 + (50_304 - 50_257) * 768
