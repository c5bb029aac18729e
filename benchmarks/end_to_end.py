"""The product end to end, as a user runs it, for one attention variant:

1. train under the DeepSpeed launcher (`deepspeed --num_gpus 1 pretrain_gpt.py`), saving a
   checkpoint halfway and at the end;
2. resume from the halfway checkpoint: its losses must continue the first run's;
3. `tools/eval_ppl.py` on the final checkpoint (Focus: the soft row and every sparse top-k);
4. `tools/convert_to_hf.py`, then `generate` with the exported model on the run's device.

On a GPU the run is bf16; `--tiny` shrinks every size for the CPU rehearsal of the GPU session
(the same steps). Losses come from the runs' TensorBoard logs. Prints a table; `--json` writes it.

    python benchmarks/end_to_end.py --attention focus+xsa [--iters 30] [--tiny]
        [--workdir DIR] [--json out.json]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from megatron_focus import platform
from megatron_focus.variants import variant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "512",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "1024",
    "--micro-batch-size",
    "8",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
]
TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "4",
    "--focus-window",
    "16",
]
FOCUS = ["--focus-groups", "4"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--attention", default="focus+xsa")
    p.add_argument("--iters", type=int, default=30, help="even: the resume starts halfway")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU rehearsal)")
    p.add_argument("--workdir", default=None, help="default: a temporary folder, removed")
    p.add_argument("--timeout", type=int, default=300, help="seconds for each command")
    p.add_argument("--json", metavar="PATH")
    opts = p.parse_args()
    if opts.iters < 2 or opts.iters % 2:
        p.error("--iters must be even and at least 2")
    return opts


def run(cmd, opts, log):
    """Runs a command of the product; its output goes to `log` (and to the console on error)."""
    start = time.time()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=opts.timeout)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}\n")
    if result.returncode:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-4000:])
        raise RuntimeError(f"{cmd[:3]} ... failed with exit code {result.returncode} (log: {log})")
    return time.time() - start


def tensorboard_losses(folder: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)
    events.Reload()
    return {e.step: e.value for e in events.Scalars("lm loss")}


def generate(hf_dir: str, device: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).to(device).eval()
    prompt = tokenizer("The function returns", return_tensors="pt").to(device)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    return {
        "class": type(model).__name__,
        "device": str(next(model.parameters()).device),
        "new_tokens": int(out.shape[1] - prompt["input_ids"].shape[1]),
        "text": tokenizer.decode(out[0], skip_special_tokens=True),
    }


def main() -> None:
    opts = parse()
    cuda = platform.has_cuda()
    work = opts.workdir or tempfile.mkdtemp(prefix="end-to-end-")
    os.makedirs(work, exist_ok=True)
    log, ckpt, hf = (os.path.join(work, name) for name in ("commands.log", "ckpt", "hf"))
    half = opts.iters // 2
    flags = (TINY if opts.tiny else MODEL) + ["--attention", opts.attention]
    flags += FOCUS if variant(opts.attention).focus else []
    flags += ["--bf16", "--attention-dropout", "0", "--hidden-dropout", "0"] if cuda else []
    flags += [
        "--train-iters",
        str(opts.iters),
        "--log-interval",
        "1",
        "--eval-interval",
        str(opts.iters),
        "--eval-iters",
        "2",
        "--save",
        ckpt,
        "--save-interval",
        str(half),
        "--data-cache-path",
        os.path.join(work, "cache"),
    ]
    launch = ["deepspeed", "--num_gpus", "1", "pretrain_gpt.py"]
    result = {
        "attention": opts.attention,
        "device": "cuda" if cuda else "cpu",
        "iters": opts.iters,
        "tiny": opts.tiny,
        "seconds": {},
    }
    seconds = result["seconds"]

    seconds["train"] = run(
        launch + flags + ["--tensorboard-dir", os.path.join(work, "tb1")], opts, log
    )
    first = tensorboard_losses(os.path.join(work, "tb1"))
    with open(os.path.join(ckpt, "latest"), "w") as f:  # resume from the halfway checkpoint
        f.write(f"iter_{half:07d}")
    shutil.rmtree(os.path.join(ckpt, f"iter_{opts.iters:07d}"))
    seconds["resume"] = run(
        launch + flags + ["--load", ckpt, "--tensorboard-dir", os.path.join(work, "tb2")], opts, log
    )
    second = tensorboard_losses(os.path.join(work, "tb2"))
    result["losses"] = [first[i] for i in sorted(first)]
    result["resumed_losses"] = [second[i] for i in sorted(second)]
    result["resume_max_abs_diff"] = max(abs(first[i] - second[i]) for i in second)
    result["resumed_iterations"] = sorted(second)

    eval_json = os.path.join(work, "eval.json")
    data = ["--data-cache-path", os.path.join(work, "cache")]
    seconds["eval_ppl"] = run(
        [
            sys.executable,
            "tools/eval_ppl.py",
            "--load",
            ckpt,
            "--json",
            eval_json,
            "--eval-iters",
            "2",
            "--micro-batch-size",
            "2",
            "--seq-length",
            flags[flags.index("--seq-length") + 1],
        ]
        + data,
        opts,
        log,
    )
    with open(eval_json) as f:
        result["eval_ppl"] = json.load(f)["rows"]
    seconds["export"] = run(
        [sys.executable, "tools/convert_to_hf.py", "--load", ckpt, "--save-dir", hf, "--overwrite"],
        opts,
        log,
    )
    start = time.time()
    result["generate"] = generate(hf, "cuda" if cuda else "cpu")
    seconds["generate"] = time.time() - start
    if opts.workdir is None:
        shutil.rmtree(work)

    losses = result["losses"]
    print(
        f"{opts.attention} on {result['device']}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in "
        f"{opts.iters} iterations; resumed at {half}: max |loss difference| "
        f"{result['resume_max_abs_diff']:.2e} over {len(result['resumed_losses'])} iterations"
    )
    print(f"{'mode':<8}{'top-k':>6}{'loss':>9}{'ppl':>10}{'pairs kept':>12}")
    for r in result["eval_ppl"]:
        print(
            f"{r['mode']:<8}{r['top_k'] or '':>6}{r['loss']:>9.4f}{r['ppl']:>10.2f}"
            f"{r['pairs_kept']:>12.3f}"
        )
    g = result["generate"]
    print(
        f"HF export: {g['class']} on {g['device']} generated {g['new_tokens']} tokens: "
        f"{g['text']!r}"
    )
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
