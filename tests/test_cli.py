"""Commands end a user's mistake in one line and exit code 2, having written nothing."""

import json
import os
import re

import pytest

from megatron_focus import cli


@pytest.mark.parametrize(
    "command",
    [
        ["pretrain_gpt.py", "--num-layers", "0"],
        ["pretrain_gpt.py", "--num-layer", "2"],
        ["pretrain_gpt.py", "--deepspeed_config", "{tmp}/missing.json"],
        [
            "pretrain_gpt.py",
            "--data-path",
            "{tmp}/none_text_document",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            "{tmp}/none.model",
        ],
        ["tools/convert_to_hf.py", "--load", "{tmp}/no-run", "--save-dir", "{tmp}/out"],
        ["tools/convert_from_hf.py", "--hf-dir", "{tmp}/no-model", "--save", "{tmp}/out"],
        ["tools/eval_ppl.py", "--load", "{tmp}/no-run"],
        [
            "tools/preprocess_data.py",
            "--input",
            "{tmp}/none-*.jsonl",
            "--output-prefix",
            "{tmp}/out",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            "{tmp}/none.model",
        ],
    ],
    ids=lambda c: " ".join(c[:2]).replace("{tmp}/", ""),
)
def test_bad_input_is_one_error_line_and_exit_code_2(run_tool, tmp_path, command):
    out = run_tool(*[part.format(tmp=tmp_path) for part in command])
    # libraries' own log lines (DeepSpeed's accelerator probe, torch's C++ logging "W1130 ...")
    # are not the command's words
    lines = [
        line
        for line in out.stderr.splitlines()
        if "[WARNING]" not in line
        and "warn" not in line.lower()
        and not re.match(r"[IWE]\d{4} ", line)
    ]
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert os.listdir(tmp_path) == []  # nothing written


@pytest.mark.parametrize("tensor_parallel, code", [(1, 0), (3, 2)])
def test_a_command_destroys_its_process_groups(tensor_parallel, code):
    """Left to the interpreter's teardown, gloo's threads can abort a process that has finished
    (exit -6): a command's groups are gone when it ends, by success or by the user's error (a
    tensor-parallel size that does not divide the world, found once the group exists)."""
    import subprocess
    import sys

    script = f"""
import atexit
import torch.distributed as dist
from megatron.core import parallel_state
from megatron_focus import cli, platform

atexit.register(
    lambda: print("left:", dist.is_initialized(), parallel_state.model_parallel_is_initialized())
)
cli.run(platform.init_distributed, {tensor_parallel})
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert out.returncode == code, out.stderr[-2000:]
    assert "left: False False" in out.stdout, out.stdout + out.stderr[-2000:]


def test_errors_raised_in_libraries_keep_their_traceback(single_process):
    """(A process group made before the command, here the fixture's, stays.)"""
    import torch.distributed as dist

    with pytest.raises(json.JSONDecodeError):
        cli.run(json.loads, "{")
    assert dist.is_initialized()


def test_megatron_compat_doc_is_generated_from_the_parser():
    """docs/megatron-compat.md is what tools/megatron_compat.py writes from today's parser."""
    from megatron_focus.config.compat import compat_table, megatron_flags
    from megatron_focus.config.flags import build_parser

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = megatron_flags()
    assert len(flags) == 681 and "--num-layers" in flags
    with open(os.path.join(root, "docs", "megatron-compat.md")) as f:
        assert f.read() == compat_table(flags, build_parser()), (
            "stale: run python tools/megatron_compat.py"
        )


def test_help_imports_neither_torch_nor_deepspeed_nor_megatron():
    """`pretrain_gpt.py --help` answers at once: nothing heavy is imported to build the parser."""
    import subprocess
    import sys

    code = (
        "import sys, pretrain_gpt\n"
        "try:\n    pretrain_gpt.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'megatron') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        check=True,
    ).stdout
    assert "--deepspeed_config" in out and out.strip().splitlines()[-1] == "[]"


def test_deepspeed_flags_are_deepspeeds_own():
    """The DeepSpeed flags the parser declares itself (to skip importing DeepSpeed) are those
    `deepspeed.add_config_arguments` adds: same names, destinations, defaults and help."""
    import argparse

    import deepspeed

    from megatron_focus.config.flags import build_parser

    def described(parser, options):
        return {
            o: (a.dest, a.default, a.help, a.nargs, a.type)
            for a in parser._actions
            for o in a.option_strings
            if o in options
        }

    theirs = deepspeed.add_config_arguments(argparse.ArgumentParser())
    options = {o for a in theirs._actions for o in a.option_strings} - {"-h", "--help"}
    assert described(build_parser(), options) == described(theirs, options) and options


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--num-layers", "0"], "--num-layers 0: must be at least 1"),
        (["--num-attention-heads", "6", "--tensor-model-parallel-size", "4"], "not divisible"),
        (["--attention", "focus", "--focus-groups", "0"], "--focus-groups 0"),
        (
            ["--data-path", "{tmp}/none_text_document", "--tokenizer-type",
             "SentencePieceTokenizer", "--tokenizer-model", "{tmp}/none.model"],
            "--tokenizer-model {tmp}/none.model: no such file",
        ),
        (
            ["--data-path", "{tmp}/none_text_document", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "100"],
            "--data-path {tmp}/none_text_document: missing",
        ),
        (["--load", "{tmp}/no-run"], "--load {tmp}/no-run: no checkpoint there"),
        (["--save", "/proc/no-such"], "--save /proc/no-such: cannot write there"),
    ],
    ids=["range", "divisibility", "focus", "tokenizer", "data", "load", "save"],
)  # fmt: skip
def test_a_refusal_needs_no_library_loaded(tmp_path, argv, error):
    """Refusals of flags and paths come before torch, DeepSpeed or Megatron-Core is imported
    (each takes seconds to load): the command answers at once."""
    import subprocess
    import sys

    argv = [a.format(tmp=tmp_path) for a in argv]
    code = (
        "import sys, pretrain_gpt\n"
        f"try:\n    pretrain_gpt.main({argv!r})\nexcept pretrain_gpt.cli.USER_ERRORS as e:\n"
        "    print('error:', e)\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'megatron') if m in sys.modules))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    lines = out.stdout.strip().splitlines()
    assert error.format(tmp=tmp_path) in lines[0], out.stdout + out.stderr[-2000:]
    assert lines[-1] == "[]", out.stdout
