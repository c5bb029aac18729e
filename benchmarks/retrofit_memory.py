"""A retrofit step against a full fine-tuning step of the same Focus model: memory and time.

Both runs are `pretrain_gpt.py` as a user runs it (DeepSpeed, ZeRO-1, fp32, the embedded corpus)
from one Focus checkpoint that this script writes first:

    full       --finetune --load BASE              every weight trained
    retrofit   --retrofit --finetune --load BASE   only the routers (W_g, C) trained

Each is its own process, so its peak resident set (from `wait4`) is its own: the model, and in the
full run the gradients, the fp32 master copy and Adam's two moments of every weight, which a
retrofit keeps for the routers only. Step time is the mean of the iterations after the first.
The defaults are GPT-2 124M's shape (12 layers, hidden 768, 12 heads, K = 4, d_g = 16) at
sequence 1024 with the embedded corpus's 4096-token vocabulary.

    python benchmarks/retrofit_memory.py [--seq-length 1024 --iters 4] [--json out.json]
        [other model flags, e.g. --num-layers 24 --hidden-size 1024 --num-attention-heads 16]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

MiB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"full": ["--finetune"], "retrofit": ["--retrofit", "--finetune"]}


def parse() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description="retrofit vs full fine-tuning: memory and step time",
        allow_abbrev=False,
        epilog="Any other flag goes to pretrain_gpt.py.",
    )
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-attention-heads", type=int, default=12)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--iters", type=int, default=4, help="iterations of each run (>= 2)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_known_args()


def run(flags: list[str]) -> tuple[str, int]:
    """pretrain_gpt.py with these flags: (its output, its peak resident set in bytes)."""
    process = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"pretrain_gpt.py {' '.join(flags)} failed:\n{output[-4000:]}")
    return output, usage.ru_maxrss * 1024  # Linux reports KiB


def measure(opts: argparse.Namespace, extra: list[str]) -> list[dict]:
    model = [
        "--num-layers",
        str(opts.num_layers),
        "--hidden-size",
        str(opts.hidden_size),
        "--num-attention-heads",
        str(opts.num_attention_heads),
        "--seq-length",
        str(opts.seq_length),
        "--micro-batch-size",
        str(opts.micro_batch_size),
        "--global-batch-size",
        str(opts.micro_batch_size),
        "--attention",
        "focus",
        "--focus-groups",
        "4",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--zero-stage",
        "1",
        "--eval-iters",
        "0",
        "--log-interval",
        "1",
        *extra,
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        run(model + ["--train-iters", "1", "--lr-warmup-iters", "0", "--save", base])
        for mode, flags in MODES.items():
            output, peak = run(
                model
                + flags
                + [
                    "--load",
                    base,
                    "--train-iters",
                    str(opts.iters),
                    "--lr-warmup-iters",
                    "0",
                    "--tensorboard-dir",
                    os.path.join(tmp, mode),
                ]
            )
            times = [
                float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", output)
            ][1:]
            trained, total = (
                int(n.replace(",", ""))
                for n in re.search(r"training ([\d,]+) of ([\d,]+) parameters", output).groups()
            )
            rows.append(
                {
                    "mode": mode,
                    "trained_parameters": trained,
                    "parameters": total,
                    "peak_rss_bytes": peak,
                    "step_ms": sum(times) / len(times),
                }
            )
    return rows


def main() -> None:
    opts, extra = parse()
    if opts.iters < 2:
        raise SystemExit("--iters must be at least 2 (the first iteration is not timed)")
    rows = measure(opts, extra)
    full = rows[0]
    print(
        f"{'mode':>9} {'trained params':>16} {'optimizer state MiB':>20} {'peak RSS MiB':>13} "
        f"{'RSS ratio':>9} {'step ms':>9} {'time ratio':>10}"
    )
    for row in rows:
        # ZeRO-1 in fp32 keeps a master copy and Adam's two moments: 3 fp32 values per weight.
        row["optimizer_state_bytes"] = 3 * 4 * row["trained_parameters"]
        row["rss_ratio"] = row["peak_rss_bytes"] / full["peak_rss_bytes"]
        row["time_ratio"] = row["step_ms"] / full["step_ms"]
        print(
            f"{row['mode']:>9} {row['trained_parameters']:>16,} "
            f"{row['optimizer_state_bytes'] / MiB:>20.1f} {row['peak_rss_bytes'] / MiB:>13.0f} "
            f"{row['rss_ratio']:>9.2f} {row['step_ms']:>9.0f} {row['time_ratio']:>10.2f}"
        )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"settings": {**vars(opts), "extra": extra}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
