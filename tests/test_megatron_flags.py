"""Every flag of Megatron-LM's `pretrain_gpt.py` is known here: honoured, a documented no-op, or
refused by the name of what it is; at Megatron-LM's default, each one runs."""

import os
import re
import subprocess
import sys
import time

import pytest

from megatron_focus import cli
from megatron_focus.config.compat import NO_EFFECT, REFUSED, classify, megatron_lm_actions
from megatron_focus.config.flags import build_parser
from megatron_focus.config.validation import validate_args
from megatron_focus.training.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Megatron-LM's defaults that this trainer cannot take, and why.
NOT_AT_DEFAULT = {"--distributed-backend": "nccl: needs a GPU (gloo without)"}


def at_default(flags, keywords):
    """The command-line words that give a Megatron-LM flag its Megatron-LM default ([] when only
    leaving it out does)."""
    action, default = keywords.get("action"), keywords.get("default")
    if action == "boolean_optional":
        return [flags[0] if default else f"--no-{flags[0][2:]}"]
    if action is not None or default is None:
        return []
    values = default if isinstance(default, list) else [default]
    return [flags[0], *map(str, values)] if values else []


ACTIONS = [(flags, kw) for flags, kw in megatron_lm_actions() if kw.get("action") != "help"]
PARSER = build_parser()  # parsing leaves a parser as it was


def test_every_megatron_lm_flag_is_known():
    ours = {o for a in build_parser()._actions for o in a.option_strings}
    flags = [flag for names, _ in ACTIONS for flag in names]
    assert len(flags) > 600
    assert [flag for flag in flags if flag not in ours] == []


@pytest.mark.parametrize("flags, keywords", ACTIONS, ids=[f[0] for f, _ in ACTIONS])
def test_each_flag_at_megatron_lm_default_runs(flags, keywords):
    argv = at_default(flags, keywords)
    if flags[0] in NOT_AT_DEFAULT and not _gpu():
        pytest.skip(NOT_AT_DEFAULT[flags[0]])
    args = PARSER.parse_args(argv)
    validate_args(args, world_size=1)


def _gpu():
    from megatron_focus import platform

    return platform.has_cuda()


def test_no_family_names_a_flag_this_trainer_implements():
    """A pattern that caught an honoured flag would refuse it (or call it a no-op); a pattern
    that names no Megatron-LM flag is stale."""
    caught = [
        a.option_strings
        for a in build_parser()._actions
        if classify(a.option_strings[0] if a.option_strings else "") is None
        and any(classify(o) for o in a.option_strings)
    ]
    assert caught == []
    flags = [flag for names, _ in megatron_lm_actions() for flag in names]
    named = {p for table in (NO_EFFECT, REFUSED) for key in table for p in key.split()}
    assert sorted(p for p in named if not any(_matches(f, p) for f in flags)) == []


def _matches(flag, pattern):
    import fnmatch

    return fnmatch.fnmatchcase(flag, pattern)


@pytest.mark.parametrize(
    "extra, feature",
    [
        (
            ["--num-experts", "8", "--moe-router-topk", "2", "--moe-grouped-gemm",
             "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall"],
            "mixture of experts is not supported",
        ),
        (
            ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "2"],
            "pipeline parallelism is not supported",
        ),
        (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], "fp8 needs Transformer Engine"),
        (
            ["--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512"],
            "multi-latent attention",
        ),
        (["--mtp-num-layers", "1"], "multi-token prediction is not supported"),
    ],
)  # fmt: skip
def test_a_feature_not_offered_is_refused_by_name_in_one_message(extra, feature):
    with pytest.raises(ValueError) as refused:
        parse_args(extra)
    message = str(refused.value)
    assert message.count(feature) == 1 and "\n" not in message
    given = [word for word in extra if word.startswith("--") and word != "--moe-router-topk"]
    assert all(flag in message for flag in given), message
    # the defaults that scripts spell out pass (--moe-router-topk 2 is Megatron-LM's)
    assert "--moe-router-topk" not in message


def test_a_moe_script_stops_with_one_line_before_any_compute():
    out = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--num-experts", "64", "--moe-router-topk", "6"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --moe-router-topk 6, --num-experts 64: mixture of experts is not supported "
        "(dense MLPs only)"
    ]


def test_megatron_lm_values_parse_as_megatron_lm_parses_them():
    """Types of Megatron-LM's own (layer patterns, lists) are taken as text, and compared with
    the default as text: a script's value parses, and is refused for what it is."""
    args = build_parser().parse_args(
        ["--moe-layer-freq", "([1]*3+[0])*2", "--cuda-graph-scope", "attn", "mlp"]
    )
    assert args.moe_layer_freq == "([1]*3+[0])*2" and args.cuda_graph_scope == ["attn", "mlp"]
    with pytest.raises(ValueError, match="mixture of experts"):
        validate_args(args, world_size=1)
    validate_args(build_parser().parse_args(["--moe-layer-freq", "1"]), world_size=1)


def test_the_table_counts_a_no_form_as_its_flag():
    """`--no-X` of a refused X is refused (and of a no-op X a no-op), not honoured; flags that
    change nothing here are counted so."""
    from megatron_focus.config.compat import compat_table, megatron_flags

    table = compat_table(megatron_flags(), PARSER)
    status = dict(re.findall(r"^\| `(--[\w-]+)` \| ([a-z ]+) \|", table, re.M))
    pairs = [
        (f[0], f"--no-{f[0][2:]}") for f, kw in ACTIONS if kw.get("action") == "boolean_optional"
    ]
    assert len(pairs) > 10 and [p for p in pairs if status[p[0]] != status[p[1]]] == []
    assert status["--no-rl-partial-rollouts"] == "refused"
    assert status["--timing-log-level"] == status["--local-rank"] == "no effect"


def test_paired_enable_disable_flags_keep_megatron_lms_default():
    """Megatron-LM declares --enable-chunked-prefill (store_false, default True) before
    --disable-chunked-prefill: chunked prefill is off by default, so the disable form is the
    "off" value and the enable form asks for the inference engine this trainer does not have."""
    assert parse_args([]).disable_chunked_prefill is True
    assert parse_args(["--disable-chunked-prefill"]).disable_chunked_prefill is True
    with pytest.raises(ValueError, match="--enable-chunked-prefill: Megatron's inference engine"):
        parse_args(["--enable-chunked-prefill"])


def test_megatron_lm_other_names_do_what_ours_do():
    args = parse_args(
        ["--use-rotary-position-embeddings", "--disable-manual-gc-eval",
         "--persistent-save-interval", "5", "--save", "ckpt"]
    )  # fmt: skip
    assert args.position_embedding_type == "rope"
    assert args.manual_gc_eval is False and args.save_interval == 5


def test_every_option_has_help_with_its_default():
    formatter = cli.HelpFormatter("pretrain_gpt.py")
    missing = [
        a.option_strings[0]
        for a in build_parser()._actions
        if a.option_strings
        and a.dest != "help"
        and (not a.help or "default" not in formatter._get_help_string(a))
    ]
    assert missing == []


TOOLS = ["pretrain_gpt.py"] + sorted(
    os.path.join("tools", name) for name in os.listdir(os.path.join(ROOT, "tools"))
    if name.endswith(".py")
)  # fmt: skip
HEAVY = ("torch", "deepspeed", "transformers", "megatron")


@pytest.mark.parametrize("tool", TOOLS)
def test_help_answers_at_once_without_heavy_imports(tool):
    """--help builds the parser from light modules: torch, DeepSpeed, transformers and
    Megatron-Core stay unimported (what takes seconds), and it answers well within a second of
    work (the bound is generous for a loaded machine)."""
    code = (
        "import contextlib, io, runpy, sys, time\n"
        f"sys.argv = [{tool!r}, '--help']\n"
        "start = time.process_time()\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        f"        runpy.run_path({tool!r}, run_name='__main__')\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(time.process_time() - start, [m for m in {HEAVY!r} if m in sys.modules],\n"
        "      'usage' in out.getvalue())\n"
    )
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    wall = time.perf_counter() - start
    line = out.stdout.strip().splitlines()[-1]  # CPU seconds, heavy modules imported, usage
    assert line.endswith("[] True"), line
    assert float(line.split()[0]) < 1.0 and wall < 10, (line, wall)
