"""What the tools and runs write gets the permissions the user's umask gives new files: an export
(written in an owner-only temporary folder, renamed at the end), a checkpoint folder and its
lock, the run's folders: readable by a team under umask 022, private under 077."""

import os
import stat
import subprocess
import sys
import tempfile

import pytest

from megatron_focus.outputs import fresh_folder

from tiny_runs import ROOT, fresh_world, tiny_argv


def _modes(folder) -> dict:
    """{path relative to folder: permission bits}, the folder itself as "."."""
    out = {}
    for root, folders, files in os.walk(folder):
        for name in [".", *files] if root == str(folder) else [*files, "."]:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = stat.S_IMODE(os.stat(path).st_mode)
    return out


@pytest.mark.parametrize(
    "mask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)]
)
def test_a_tool_output_honours_the_umask(tmp_path, mask, folder_mode, file_mode):
    old = os.umask(mask)
    try:
        with fresh_folder(str(tmp_path / "out")) as partial:
            os.mkdir(os.path.join(partial, "sub"))
            tempfile.mkstemp(dir=partial)  # owner-only, as some writers make their files
            with open(os.path.join(partial, "sub", "run.sh"), "w") as f:
                f.write("#!/bin/sh\n")
            os.chmod(os.path.join(partial, "sub", "run.sh"), 0o700)
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "out")
    assert modes["."] == modes["sub"] == folder_mode
    assert modes["sub/run.sh"] == folder_mode  # an executable keeps its execute bits
    assert {m for name, m in modes.items() if name not in (".", "sub", "sub/run.sh")} == {file_mode}


@pytest.mark.slow
def test_checkpoints_and_exports_are_readable_by_a_team_under_umask_022(embedded_cache, tmp_path):
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    train = [sys.executable, "pretrain_gpt.py", *tiny_argv(embedded_cache, "--save", str(ckpt))]
    export = [sys.executable, "tools/convert_to_hf.py", "--load", str(ckpt), "--save-dir", str(hf)]
    for command in (train, export):
        done = subprocess.run(
            command, cwd=ROOT, env=fresh_world(), capture_output=True, text=True,
            preexec_fn=lambda: os.umask(0o022),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    card = (hf / "README.md").read_text()  # a stock class: no remote code to trust
    assert 'AutoTokenizer.from_pretrained("hf")' in card and "trust_remote_code" not in card
    for folder in (ckpt, hf):
        modes = _modes(folder)
        assert len(modes) > 5
        unreadable = {name: oct(m) for name, m in modes.items() if not m & stat.S_IROTH}
        assert not unreadable, unreadable


def test_a_custom_class_export_says_its_tokenizer_needs_the_flag_too(tmp_path):
    """transformers 5's AutoTokenizer reads the model's config first: for the custom class that
    is the folder's code, and without trust_remote_code it stops at a prompt."""
    from megatron_focus.hf import families
    from megatron_focus.hf.export import _write_model_card

    arch = type("Arch", (), dict(attention="focus", num_layers=2, hidden_size=64,
                                 num_attention_heads=4))  # fmt: skip
    _write_model_card(str(tmp_path), "exports/m", families.CUSTOM, arch, "ckpt/iter_0000100", True)
    card = (tmp_path / "README.md").read_text()
    assert 'AutoModelForCausalLM.from_pretrained("m", trust_remote_code=True)' in card
    assert 'AutoTokenizer.from_pretrained("m", trust_remote_code=True)' in card
    assert "checkpoint `iter_0000100`" in card
