"""Recipes and tooling: examples/pretrain.sh (+ SLURM), retrofit, the planner, prepare_fineweb,
compare_runs."""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain.sh")
MODELS = ("0.7b", "1.4b", "2.7b", "7b")
ATTENTIONS = ("standard", "xsa", "focus", "focus+xsa")


def _recipe_variables():
    """Every variable the recipe scripts read, and the launcher's: none may leak in from outside."""
    names = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    for script in ("pretrain.sh", "pretrain.slurm", "retrofit.sh"):
        with open(os.path.join(ROOT, "examples", script)) as f:
            names |= set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", f.read()))
    return names - {"PATH", "HOME", "SLURM_SUBMIT_DIR", "BASH_SOURCE"}


LAUNCH_ENV = _recipe_variables()


def _env(**settings):
    """This process's environment without launcher/recipe variables (a fixture may have set
    some)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update({k: str(v) for k, v in settings.items()})
    return env


def _script(*argv, **settings):
    return subprocess.run(
        ["bash", *argv], env=_env(**settings), capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def _dry_run(model, attention, **settings):
    """(the settings line, the launcher's argv, pretrain_gpt.py's flags) that the recipe would
    run."""
    out = _script(
        SCRIPT,
        DRY_RUN=1,
        MODEL=model,
        ATTENTION=attention,
        HOSTFILE="examples/hostfile",
        **settings,
    )
    assert out.returncode == 0, out.stderr
    header, command = out.stdout.splitlines()[:2]
    argv = shlex.split(command)
    cut = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py")) + 1
    return dict(kv.split("=", 1) for kv in header[2:].split()), argv[:cut], argv[cut:]


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flag(flags, name):
    return flags[flags.index(name) + 1]


def _without_variant(flags):
    out, skip = [], 0
    for f in flags:
        skip = 2 if f in ("--attention", "--focus-groups") else skip
        if skip:
            skip -= 1
            continue
        out.append(f)
    return out


# --- examples/pretrain.sh -------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_recipe_commands_and_their_plans(model):
    """Each size x attention: the command it launches, and that the planner says it fits."""
    from megatron_focus.planner import make_plan, parse_plan_args

    for attention in ATTENTIONS:
        settings, launcher, flags = _dry_run(model, attention, RUN_DIR="runs/x")
        assert _flag(flags, "--attention") == attention
        assert ("--focus-groups" in flags) == attention.startswith("focus")
        assert launcher[0] == "deepspeed" and _flag(launcher, "--num_gpus") == "8"
        if int(settings["NODES"]) > 1:
            assert _flag(launcher, "--hostfile") == "examples/hostfile"
            assert _flag(launcher, "--num_nodes") == settings["NODES"]
        assert os.path.isfile(_flag(flags, "--deepspeed_config"))
        assert (_flag(flags, "--seq-length"), _flag(flags, "--global-batch-size")) == (
            "2048",
            "256",
        )
        assert float(_flag(flags, "--min-lr")) == pytest.approx(float(_flag(flags, "--lr")) / 10)
        if attention == "standard":
            standard = flags
        else:  # one variable: the variants' commands differ from standard's by the variant only
            assert _without_variant(flags) == _without_variant(standard)

        # The planner reads the same flags: the paper's sizes, and room to spare on 80 GB GPUs.
        plan = make_plan(
            *parse_plan_args(
                flags
                + [
                    "--nodes",
                    settings["NODES"],
                    "--gpus-per-node",
                    settings["GPUS_PER_NODE"],
                    "--vocab-size",
                    "32000" if model == "7b" else "50257",
                    "--gpu-memory-gb",
                    "80",
                ]
            )
        )
        p = plan.parameters
        if model == "7b":
            router = 32 * (4096 * 16 + 4 * 16) if attention.startswith("focus") else 0
            assert p["total"] == 7_241_732_096 + router  # Mistral-7B's published count
            assert p["output_layer"] == p["word_embedding"] == 32000 * 4096
        else:
            assert round(p["non_embedding"] / 1e9, 1) == float(model[:-1])
            assert p["output_layer"] == 0 and p["position_embedding"] == 0  # tied, RoPE
        chosen = plan.chosen
        assert plan.fits and chosen["total_gb"] < 0.7 * 80, (attention, chosen)
        assert chosen["accumulation"] >= 1 and chosen["zero_stage"] == int(settings["ZERO"])
        assert (chosen["tp"], chosen["sp"]) == (int(settings["TP"]), settings["SP"] == "1")


def _smoke(model, attention, tmp_path, cache, **settings):
    """SMOKE=1 run of the recipe; with LAUNCHER set, its ranks meet on a free port."""
    from distributed import on_a_free_port

    run_dir = tmp_path / f"{model}-{attention}"

    def launch(port=None):
        shutil.rmtree(run_dir, ignore_errors=True)  # what a run that could not start left
        ports = {} if port is None else {"MASTER_PORT": port}
        return _script(
            SCRIPT,
            SMOKE=1,
            MODEL=model,
            ATTENTION=attention,
            RUN_DIR=run_dir,
            DATA_CACHE=cache,
            **settings,
            **ports,
        )

    out = on_a_free_port(launch) if "LAUNCHER" in settings else launch()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (
        "iteration        3/       3" in out.stdout
        and "validation loss at iteration 3" in out.stdout
    )
    meta = json.loads((run_dir / "run.json").read_text())
    assert (meta["label"], meta["seq_length"], meta["global_batch_size"]) == (
        f"{model} {attention}",
        64,
        4,
    )
    assert os.listdir(run_dir / "tensorboard") and (run_dir / "checkpoints" / "latest").exists()
    return out.stdout


@pytest.mark.parametrize(
    "model, attention",
    [
        ("0.7b", "standard"),
        pytest.param("1.4b", "xsa", marks=pytest.mark.slow),
        pytest.param("2.7b", "focus+xsa", marks=pytest.mark.slow),
        pytest.param("7b", "focus", marks=pytest.mark.slow),
    ],
)
def test_recipe_smoke_runs_on_the_cpu(model, attention, tmp_path, embedded_cache):
    """The recipe itself (not a copy), shrunk by SMOKE=1: first iterations in one CPU process.

    Each size runs once and each attention variant once. The 7b keeps its TP 2 + SP, through
    the DeepSpeed launcher on two CPU ranks.
    """
    settings = {}
    if model == "7b":
        settings = dict(LAUNCHER="deepspeed", GPUS_PER_NODE=2, TP=2)
    stdout = _smoke(model, attention, tmp_path, embedded_cache, **settings)
    assert f"attention {attention} | 2 layers, hidden 64" in stdout
    if model == "7b":
        assert "--sequence-parallel" in stdout and "TP 2, DP 1, ZeRO 1" in stdout


def test_a_smoke_run_keeps_out_of_the_real_runs_folder():
    """SMOKE=1 writes to a folder of its own: the real recipe's, left alone, does not hold a
    tiny model it would refuse as another model's."""
    real, _, _ = _dry_run("0.7b", "focus")
    smoke, _, _ = _dry_run("0.7b", "focus", SMOKE=1)
    assert real["RUN_DIR"] == "runs/0.7b-focus-seed1234"
    assert smoke["RUN_DIR"] == "runs/0.7b-focus-seed1234-smoke"
    retrofit = subprocess.run(
        ["bash", "-c", 'source <(sed -n "/smoke/p" examples/retrofit.sh); echo "$RUN_DIR"'],
        env=_env(SMOKE=1, MODEL="gpt2"), capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert retrofit.stdout.strip() == "runs/retrofit-gpt2-smoke"


def test_recipe_refuses_bad_settings():
    out = _script(SCRIPT, DRY_RUN=1, MODEL="3b")
    assert out.returncode == 2 and "MODEL=3b: choose 0.7b, 1.4b, 2.7b or 7b" in out.stderr
    out = _script(SCRIPT, DRY_RUN=1, ATTENTION="sparse")
    assert out.returncode == 2 and "ATTENTION=sparse" in out.stderr
    out = _script(SCRIPT, DRY_RUN=1, MODEL="2.7b")  # 4 nodes and no hostfile
    assert out.returncode == 2 and "NODES=4 needs HOSTFILE" in out.stderr
    out = _script(SCRIPT, MODEL="0.7b", DATA_PATH="/nowhere/fineweb_text_document")
    assert out.returncode == 2 and "tools/prepare_fineweb.py" in out.stderr


def test_recipe_overrides_and_the_plan_command():
    settings, launcher, flags = _dry_run(
        "1.4b",
        "xsa",
        NODES=4,
        TP=2,
        MBS=4,
        SEED=7,
        EXTRA_ARGS="--eval-iters 5",
        LAUNCHER_ARGS="--force_multi",
    )
    assert (settings["NODES"], settings["SP"]) == ("4", "1")  # SP comes with TP > 1 unless set
    assert _flag(launcher, "--num_nodes") == "4" and "--force_multi" in launcher
    assert (_flag(flags, "--tensor-model-parallel-size"), _flag(flags, "--micro-batch-size")) == (
        "2",
        "4",
    )
    assert "--sequence-parallel" in flags
    assert flags[-2:] == ["--eval-iters", "5"] and "runs/1.4b-xsa-seed7/checkpoints" in flags
    _, launcher, flags = _dry_run("7b", "focus", LAUNCHER="torchrun", NODE_RANK=1, MASTER_ADDR="n0")
    assert launcher[:7] == [
        "torchrun",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "8",
        "--node_rank",
        "1",
    ]
    assert _flag(launcher, "--master_addr") == "n0" and "--sequence-parallel" in flags

    # PLAN=1 hands the same flags to tools/plan.py (a stand-in python echoes the command line).
    out = _script(
        SCRIPT, PLAN=1, MODEL="7b", ATTENTION="xsa", PYTHON="echo", PLAN_ARGS="--gpu-memory-gb 40"
    )
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[0].endswith("tools/plan.py")
    _, _, flags = _dry_run("7b", "xsa")
    assert argv[1 : len(flags) + 1] == flags
    assert argv[len(flags) + 1 :] == [
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--vocab-size",
        "32000",
        "--gpu-memory-gb",
        "40",
    ]
    from megatron_focus.planner import make_plan, parse_plan_args

    assert make_plan(*parse_plan_args(argv[1:])).fits  # 7b fits 40 GB GPUs too


def test_slurm_script_builds_the_hostfile_and_launches_every_node(tmp_path):
    """Under stand-in scontrol/srun: the hostfile and each node's no-ssh DeepSpeed command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a1\\ngpu-a2\\n'\n")
    # srun runs its command once per node, as SLURM would, with that node's SLURM_NODEID.
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        'for id in 0 1; do SLURM_NODEID=$id "$@" || exit 1; done\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    env = dict(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_NUM_NODES=2,
        SLURM_JOB_ID=4242,
        SLURM_JOB_NODELIST="gpu-a[1-2]",
        SLURM_SUBMIT_DIR=ROOT,
        HOSTFILE=hostfile,
        DRY_RUN=1,
        MODEL="7b",
        ATTENTION="focus+xsa",
    )
    out = _script(os.path.join(ROOT, "examples", "pretrain.slurm"), **env)
    assert out.returncode == 0, out.stderr
    assert hostfile.read_text() == "gpu-a1 slots=8\ngpu-a2 slots=8\n"
    commands = [
        shlex.split(line) for line in out.stdout.splitlines() if line.startswith("deepspeed")
    ]
    assert len(commands) == 2
    for rank, argv in enumerate(commands):
        assert argv[: argv.index("--no_ssh")] == [
            "deepspeed",
            "--hostfile",
            str(hostfile),
            "--num_nodes",
            "2",
            "--num_gpus",
            "8",
        ]
        assert _flag(argv, "--node_rank") == str(rank)
        assert (_flag(argv, "--master_addr"), _flag(argv, "--master_port")) == ("gpu-a1", "29742")
        assert _flag(argv, "--attention") == "focus+xsa"


# --- the planner ----------------------------------------------------------------------------------


def _plan_args(*argv):
    """The run's config and the cluster's flags."""
    from megatron_focus.planner import parse_plan_args

    return parse_plan_args(list(argv))


def test_planner_retrofit_keeps_state_for_the_routers_only():
    """--retrofit: gradients and optimizer state of the routers only (the checkpoint test measures
    3 fp32 values per router weight in DeepSpeed's optimizer files), weights of the whole model;
    ZeRO-3 is refused, as the trainer refuses it."""
    from megatron_focus.planner import memory

    flags = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--attention",
        "focus",
        "--focus-groups",
        "4",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--vocab-size",
        "4096",
    ]
    full, retrofit = (
        _plan_args(*flags)[0],
        _plan_args(*flags, "--retrofit", "--load", "ckpt")[0],
    )
    routers = 2 * (64 * 16 + 4 * 16)
    a = memory(full, 1, 1, False, 1, 1, 1e12)
    r = memory(retrofit, 1, 1, False, 1, 1, 1e12)
    assert (r.gradients, r.optimizer) == (4 * routers, 12 * routers)
    assert r.weights == a.weights and a.optimizer == 12 * a.weights / 4
    assert not memory(retrofit, 1, 1, False, 3, 1, 1e12).fits


def test_planner_counts_the_parameters_of_the_built_model(single_process):
    """count_parameters == the GPTModel the trainer builds, for each family and Focus."""
    from megatron_focus.model.gpt import build_model
    from megatron_focus.planner import count_parameters
    from megatron_focus.training.arguments import parse_args

    small = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    families = [
        small,  # GPT-2: LayerNorm, GELU, biases, learned positions, tied
        small
        + ["--kv-channels", "24", "--position-embedding-type", "rope", "--disable-bias-linear"],
        small
        + [
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--swiglu",
            "--normalization",
            "RMSNorm",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
            "--ffn-hidden-size",
            "176",
            "--position-embedding-type",
            "rope",
        ],
        small
        + [
            "--swiglu",
            "--normalization",
            "RMSNorm",
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--position-embedding-type",
            "rope",
        ],  # Qwen2
        small + ["--qk-layernorm", "--position-embedding-type", "none", "--squared-relu"],
        small + ["--qk-layernorm", "--normalization", "RMSNorm", "--apply-layernorm-1p"],
    ]
    families.append(small + ["--attention", "focus+xsa", "--focus-groups", "4"])
    for argv in families:
        args = parse_args(argv)
        model = build_model(args, 1000)
        counted = count_parameters(args, 1000)
        assert counted.total == sum(p.numel() for p in model.parameters()), argv
        if "--attention" in argv:
            assert counted.router_per_layer == 64 * 16 + 4 * 16


def test_retrofit_flops_match_counted_flops(single_process):
    """flops_per_token: what a retrofit step saves (the frozen weights' gradients) against the
    matmul FLOPs torch's FlopCounterMode counts in a full and a retrofit step of the built model.
    The formula leaves out layer 0's input gradients, which a retrofit does not need either
    (nothing below its router learns): about 3% here."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_focus import platform
    from megatron_focus.model.flops import flops_per_token
    from megatron_focus.model.focus.focus import train_routers_only
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    argv = [
        "--num-layers",
        "8",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--attention",
        "focus",
        "--focus-groups",
        "4",
        "--seq-length",
        "64",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ]
    vocab, tokens = 256, torch.randint(0, 256, (2, 64))
    counted = {}
    for mode in ("full", "retrofit"):
        args = parse_args(argv + (["--retrofit", "--load", "ckpt"] if mode == "retrofit" else []))
        platform.manual_seed(1)
        model = build_model(args, vocab)
        if mode == "retrofit":
            train_routers_only(model)
        with FlopCounterMode(display=False) as counter:
            positions = torch.arange(64).expand_as(tokens)
            model(tokens, positions, None, labels=tokens).sum().backward()
        counted[mode] = counter.get_total_flops()
        formula = flops_per_token(args, vocab)
        counted[mode + " formula"] = formula * tokens.numel()
    saved = counted["full"] - counted["retrofit"]
    assert saved == pytest.approx(counted["full formula"] - counted["retrofit formula"], rel=0.05)


def test_planner_memory_matches_a_hand_computation():
    """TP 2 + SP, ZeRO-2, bf16, 2 nodes x 4 GPUs (DP 4), GPT-2 style, dropout on, flash
    attention."""
    from megatron_focus.planner import make_plan

    args = _plan_args(
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "16",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--bf16",
        "--zero-stage",
        "2",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--vocab-size",
        "1000",
        "--gpu-memory-gb",
        "1",
    )
    plan = make_plan(*args)
    vocab = 1024  # 1000 padded to a multiple of 128 x TP 2
    word, position = vocab * 64, 32 * 64
    layer_sharded = (64 * 192 + 192) + 64 * 64 + (64 * 256 + 256) + 256 * 64  # QKV, proj, fc1, fc2
    layer_replicated = 2 * 128 + 64 + 64  # two LayerNorms, proj and fc2 biases
    final_norm = 128
    total = word + position + 2 * (layer_sharded + layer_replicated) + final_norm
    assert plan.parameters["total"] == total == 167_680
    psi = (word + 2 * layer_sharded) / 2 + position + 2 * layer_replicated + final_norm
    assert plan.parameters["per_tp_rank"] == psi == 85_312
    dp = 4
    weights, grads, optimizer = 2 * psi, 2 * psi / dp, 12 * psi / dp  # ZeRO-2
    s, b, h, t = 32, 2, 64, 2
    sbh = s * b * h
    per_layer = (
        (4 * 2 * sbh + 2 * sbh) / t  # SP region: norm inputs/outputs, 2 dropout masks
        + (
            2 * s * b * (64 + 2 * 64)  # Q, K, V
            + 2 * s * b * 64  # attention output
            + 4 * s * b * 4  # log-sum-exp
            + 2 * 2 * s * b * 256
        )
        / t  # GELU in and out
    )
    around = (2 * 2 * sbh + sbh) / t + (2 + 4) * s * b * vocab / t  # final norm, mask; logits
    activations = 2 * per_layer + around
    chosen = plan.chosen
    gb = 1e9
    assert chosen["weights_gb"] == round(weights / gb, 3)
    expected = weights + grads + optimizer + activations
    assert expected == 816_352
    assert chosen["total_gb"] == round(expected / gb, 3)
    assert (chosen["data_parallel"], chosen["accumulation"]) == (4, 2)
    # Without SP the norm region is whole on each rank; ZeRO-0 keeps every state whole.
    no_sp = next(g for g in plan.grid if g["tp"] == 2 and not g["sp"] and g["zero_stage"] == 0)
    assert no_sp["total_gb"] == round(
        (16 * psi + activations + 2 * (10 * sbh - 10 * sbh / t) + (5 * sbh - 5 * sbh / t)) / gb, 3
    )


def test_activation_formula_is_korthikanti_for_gpt3():
    """e = 2, f = 4h, a d = h, dropout, scores kept: s b h (34 + 5 a s / h) per layer, and the
    TP/SP forms."""
    from megatron_focus.planner import activation_bytes_per_layer

    config, _ = _plan_args(
        "--num-layers",
        "24",
        "--hidden-size",
        "2048",
        "--num-attention-heads",
        "16",
        "--seq-length",
        "2048",
        "--bf16",
        "--gpus-per-node",
        "1",
    )
    s, b, h, a = 2048, 1, 2048, 16
    for tp, sp, expected in (
        (1, False, 34 + 5 * a * s / h),
        (4, False, 10 + 24 / 4 + 5 * a * s / (h * 4)),
        (4, True, 34 / 4 + 5 * a * s / (h * 4)),
    ):
        got = activation_bytes_per_layer(config, b, tp, sp, materialized_attention=True)
        assert got == pytest.approx(s * b * h * expected, rel=1e-12), (tp, sp)


def test_plan_json_and_the_error_that_names_what_to_change(tmp_path, capsys):
    from megatron_focus.planner import main

    mistral = [
        "--num-layers",
        "32",
        "--hidden-size",
        "4096",
        "--num-attention-heads",
        "32",
        "--group-query-attention",
        "--num-query-groups",
        "8",
        "--ffn-hidden-size",
        "14336",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--position-embedding-type",
        "rope",
        "--seq-length",
        "2048",
        "--global-batch-size",
        "256",
        "--train-iters",
        "3815",
        "--bf16",
        "--vocab-size",
        "32000",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ]
    path = tmp_path / "plan.json"
    assert (
        main(
            mistral
            + [
                "--micro-batch-size",
                "2",
                "--nodes",
                "2",
                "--zero-stage",
                "3",
                "--target-days",
                "0.5",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    plan = json.loads(path.read_text())
    assert plan["fits"] and plan["parameters"]["total"] == 7_241_732_096
    th = plan["throughput"]
    assert th["train_tokens"] == 3815 * 256 * 2048
    assert th["tokens_per_sec_needed"] == pytest.approx(th["train_tokens"] / 43200)
    assert th["mfu_needed"] == pytest.approx(
        th["tokens_per_sec_needed"] * plan["flops_per_token"] / 16 / 989e12
    )
    assert "7.24B" in capsys.readouterr().out

    # ZeRO-1 on one 8-GPU node with micro-batch 8: optimizer states fit, activations do not.
    assert main(mistral + ["--micro-batch-size", "8", "--zero-stage", "1"]) == 1
    err = capsys.readouterr().err
    assert "does not fit" in err and "--tensor-model-parallel-size" in err
    assert "--micro-batch-size" in err

    assert main(mistral + ["--tensor-model-parallel-size", "3"]) == 2  # invalid flags: no plan
    assert "not divisible by --tensor-model-parallel-size 3" in capsys.readouterr().err


# --- tools/prepare_fineweb.py ---------------------------------------------------------------------


def _fineweb_shards(folder, shards=3, docs=40):
    """Tiny parquet shards with FineWeb's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = (
        "attention model token group window sparse exclusive value head layer train loss "
        "the a of to and in is that for with as on by it from at this be are"
    ).split()
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    expected = []
    for shard in range(shards):
        texts = [
            " ".join(rng.choice(words, size=int(rng.integers(5, 60)))).capitalize() + "."
            for _ in range(docs)
        ]
        texts[3] = ""  # an empty document: skipped and counted
        pq.write_table(
            pa.table(
                {
                    "text": texts,
                    "id": [f"<urn:{shard}:{i}>" for i in range(docs)],
                    "url": ["https://example.org"] * docs,
                    "token_count": [len(t) for t in texts],
                }
            ),
            folder / f"{shard:03d}_00000.parquet",
        )
        expected.append(docs - 1)
    return expected


@pytest.mark.parametrize("tokenizer", ["huggingface", "sentencepiece"])
def test_prepare_fineweb_holds_out_the_last_shard(tmp_path, tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_focus.data.datasets import build_datasets
    from megatron_focus.data.tokenizer import build_tokenizer

    docs = _fineweb_shards(tmp_path / "fineweb" / "sample" / "10BT")
    argv = [
        "--input",
        str(tmp_path / "fineweb/sample/10BT/*.parquet"),
        "--output-prefix",
        str(tmp_path / "data" / "fw"),
        "--workers",
        "1",
    ]
    if tokenizer == "huggingface":
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator(
            ["attention model token group"] * 5,
            trainers.BpeTrainer(
                vocab_size=300,
                special_tokens=["<pad>", "<|endoftext|>"],
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            ),
        )
        tok.save(str(tmp_path / "tokenizer.json"))
        argv += [
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(tmp_path / "tokenizer.json"),
        ]
    else:
        argv += ["--train-tokenizer", "--vocab-size", "300"]
    tool = _tool("prepare_fineweb")
    manifest = tool.prepare(tool.parse_args(argv))

    prefix = str(tmp_path / "data" / "fw_text_document")
    assert manifest["data_path"] == prefix
    assert (manifest["train_documents"], manifest["valid_documents"]) == (sum(docs[:2]), docs[2])
    assert manifest["valid_shards"][0].endswith("002_00000.parquet")
    assert manifest["empty_documents_skipped"] == 3
    split = open(prefix + ".split").read().strip()
    assert split == manifest["split"] == f"{sum(docs[:2])},{docs[2]},0"
    if tokenizer == "sentencepiece":
        assert manifest["tokenizer_model"].endswith("fw-tokenizer.model")

    # The held-out shard is exactly the validation split, and the same documents as its own prefix.
    data, held_out = IndexedDataset(prefix), IndexedDataset(manifest["valid_data_path"])
    assert len(data) == sum(docs) and len(held_out) == docs[2]
    for i in range(len(held_out)):
        assert data[sum(docs[:2]) + i].tolist() == held_out[i].tolist()
    tokenizer_ = build_tokenizer(manifest["tokenizer_type"], manifest["tokenizer_model"])
    train, valid, test = build_datasets(
        [prefix], split, 16, 1, tokenizer_, (4, 4, 0), str(tmp_path / "cache")
    )
    assert test is None
    assert valid.indices.tolist() == list(range(sum(docs[:2]), sum(docs)))
    assert train.indices.tolist() == list(range(sum(docs[:2])))


def test_prepare_fineweb_needs_a_shard_to_train_on(tmp_path):
    _fineweb_shards(tmp_path / "fw", shards=1)
    tool = _tool("prepare_fineweb")
    args = tool.parse_args(
        [
            "--input",
            str(tmp_path / "fw" / "*.parquet"),
            "--output-prefix",
            str(tmp_path / "out"),
            "--train-tokenizer",
            "--vocab-size",
            "300",
        ]
    )
    with pytest.raises(ValueError, match="cannot hold out --valid-shards 1"):
        tool.prepare(args)


# --- tools/compare_runs.py ------------------------------------------------------------------------


def test_compare_runs_plots_real_training_logs(embedded_cache, tmp_path, capsys):
    """Two tiny runs (standard, xsa) through pretrain; xsa twice as two seeds; plot and table."""
    from tiny_runs import tiny_argv, train

    runs = tmp_path / "runs"
    for attention in ("standard", "xsa"):
        tb = runs / f"{attention}-seed1" / "tensorboard"
        history = train(
            1,
            tiny_argv(
                embedded_cache,
                "--attention",
                attention,
                "--tensorboard-dir",
                str(tb),
                "--eval-interval",
                "3",
                iters=6,
            ),
        )
        assert len(history["validation"]) == 2
    # A second xsa "seed": same curves, so the group mean equals them and the spread is 0.
    shutil.copytree(runs / "xsa-seed1", runs / "xsa-seed2")

    out = tmp_path / "plots" / "compare"
    assert (
        _tool("compare_runs").main(
            [
                str(runs),
                "--seq-length",
                "32",
                "--out",
                str(out),
                "--json",
                str(tmp_path / "table.json"),
            ]
        )
        == 0
    )
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in table[1:]] == ["| standard", "| xsa"]
    assert table[2].split(" | ")[1] == "2"  # two xsa seeds

    summary = json.loads((tmp_path / "table.json").read_text())
    standard, xsa = summary["groups"]
    assert standard["tokens"] == xsa["tokens"] == 6 * 8 * 32  # iterations x batch x sequence
    assert xsa["runs"] == 2 and xsa["validation_loss_std"] == 0.0 and xsa["baseline"] == "standard"
    assert xsa["delta_validation_loss"] == pytest.approx(
        xsa["validation_loss"] - standard["validation_loss"]
    )
    assert standard["validation_loss"] != xsa["validation_loss"]

    import matplotlib.image

    png = out.with_suffix(".png")
    assert png.stat().st_size > 20_000 and out.with_suffix(".svg").stat().st_size > 20_000
    pixels = matplotlib.image.imread(str(png))
    assert pixels.shape[1] > 1000 and pixels[..., :3].std() > 0.05  # drawn on, not blank


def test_compare_runs_needs_the_sequence_length(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "a" / "tensorboard"))
    for step, loss in ((1, 9.0), (2, 8.0), (3, 7.5)):
        writer.add_scalar("lm loss", loss, step)
        writer.add_scalar("batch-size", 16, step)
    writer.close()
    tool = _tool("compare_runs")
    with pytest.raises(ValueError, match="no sequence length"):
        tool.main([str(tmp_path / "a"), "--out", str(tmp_path / "x")])
    (tmp_path / "a" / "run.json").write_text(json.dumps({"label": "mine", "seq_length": 100}))
    path = tmp_path / "t.json"
    assert (
        tool.main(
            [
                str(tmp_path / "a"),
                "--out",
                str(tmp_path / "x"),
                "--format",
                "svg",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    (row,) = json.loads(path.read_text())["groups"]
    assert (row["label"], row["tokens"], row["train_loss"]) == ("mine", 3 * 16 * 100, 7.5)
    assert row["validation_loss"] is None and (tmp_path / "x.svg").exists()


def test_compare_runs_counts_the_tokens_of_a_growing_batch(tmp_path):
    """--rampup-batch-size: the token axis is the samples each logged step had consumed, not
    the step times its batch."""
    from torch.utils.tensorboard import SummaryWriter

    batches = [2, 2, 4, 6, 8]
    writer = SummaryWriter(str(tmp_path / "a"))
    for step, batch in enumerate(batches, 1):
        writer.add_scalar("lm loss", 9.0 - step, step)
        writer.add_scalar("batch-size", batch, step)
        writer.add_scalar("batch-size vs samples", batch, sum(batches[:step]))
    writer.close()
    run = _tool("compare_runs").read_run("ramp", str(tmp_path / "a"), 10, None, ["lm loss"])
    steps = np.arange(1, 6, dtype=np.float64)
    assert run.tokens(steps).tolist() == [10 * sum(batches[:s]) for s in range(1, 6)]


@pytest.mark.slow
def test_cpu_study_script_trains_every_variant_and_compares_them(tmp_path, embedded_cache):
    """examples/study_cpu.sh itself, shrunk: one seed, 2 iterations, a 1-layer model."""
    shrink = (
        f"--data-cache-path {embedded_cache} --num-layers 1 --hidden-size 64 "
        "--num-attention-heads 4 --micro-batch-size 2 --eval-iters 1 --focus-window 8"
    )
    out = _script(
        os.path.join(ROOT, "examples", "study_cpu.sh"),
        SEEDS="1",
        ITERS="2",
        SEQ_LENGTH="32",
        OUT=str(tmp_path / "runs"),
        STUDY_OUT=str(tmp_path / "study"),
        EXTRA_ARGS=shrink,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    table = json.load(open(tmp_path / "study.json"))
    assert os.path.getsize(tmp_path / "study.png") > 10_000
    assert "focus+xsa" in json.dumps(table) and "standard" in json.dumps(table)


@pytest.mark.slow
def test_retrofit_recipe_smoke_runs_every_step(embedded_cache, tmp_path):
    """examples/retrofit_gpt2.sh, SMOKE=1: import a GPT-2 built from a config, retrofit, evaluate,
    export. Sparse mode with top-k = K keeps every causal pair, so it must score the base model's
    loss exactly (a check on the chain: routers trained, base read through the reference)."""
    run_dir = tmp_path / "retrofit"
    out = _script(
        os.path.join(ROOT, "examples", "retrofit_gpt2.sh"),
        SMOKE=1,
        RUN_DIR=str(run_dir),
        DATA_CACHE=embedded_cache,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "training 2,176 of" in out.stdout and "validation loss at iteration 0" in out.stdout
    base = json.load(open(run_dir / "eval-base.json"))["rows"]
    rows = json.load(open(run_dir / "eval-checkpoints.json"))["rows"]
    assert [(r["mode"], r["top_k"]) for r in rows] == [("soft", None)] + [
        ("sparse", k) for k in range(1, 5)
    ]
    assert rows[-1]["pairs_kept"] == 1.0 and rows[1]["pairs_kept"] < 1.0
    assert abs(rows[-1]["loss"] - base[0]["loss"]) < 1e-4
    assert os.path.isfile(run_dir / "checkpoints" / "iter_0000006" / "base_checkpoint.json")
    assert json.load(open(run_dir / "hf" / "config.json"))["focus_groups"] == 4


@pytest.mark.parametrize("model", ["0.7b", "1.4b", "2.7b"])
def test_recipe_speed_commands_pass_the_trainers_checks(model):
    """benchmarks/recipe_speed.py at the GPU session's few iterations: the recipe's command as
    it runs it is one the trainer takes (the schedule shrunk to fit), for every variant."""
    import argparse
    import importlib.util

    from megatron_focus.training.arguments import parse_args

    spec = importlib.util.spec_from_file_location(
        "recipe_speed", os.path.join(ROOT, "benchmarks", "recipe_speed.py")
    )
    recipe_speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe_speed)
    opts = argparse.Namespace(model=model, iters=5, warmup=3, micro_batch_size=None, smoke=False)
    for attention in ATTENTIONS:
        cmd = recipe_speed.recipe_command(opts, attention)
        args = parse_args(cmd[cmd.index(os.path.join(ROOT, "pretrain_gpt.py")) + 1 :])
        assert (args.attention, args.train_iters) == (attention, 5)
        assert args.lr_warmup_iters < args.train_iters
