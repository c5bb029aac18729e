"""A recipe's shape on this machine: a few training iterations of examples/pretrain.sh's model,
per attention variant, side by side: tokens/s, TFLOP/s per device, MFU (on GPUs of known peak)
and peak memory, read from the runs' own TensorBoard logs (the first iterations, which compile
and warm up, are left out).

The command is the recipe's own (`DRY_RUN=1 examples/pretrain.sh` prints it), on one process
and the embedded corpus, without checkpoints or evaluation. `--smoke` runs the recipe shrunk
(SMOKE=1), the CPU rehearsal of the GPU session.

    python benchmarks/recipe_speed.py [--model 0.7b] [--variants standard focus+xsa]
        [--iters 8] [--micro-batch-size 8] [--smoke] [--json out.json]
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Flags of the recipe's command that a speed measurement drops (with their value).
DROPPED = {
    "--save",
    "--load",
    "--save-interval",
    "--tensorboard-dir",
    "--log-interval",
    "--eval-iters",
    "--eval-interval",
    "--exit-signal-handler",
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    # one process: the sizes that the recipe runs without tensor parallelism (7b's is TP 2)
    p.add_argument("--model", default="0.7b", choices=("0.7b", "1.4b", "2.7b"))
    p.add_argument("--variants", nargs="+", default=["standard", "focus+xsa"])
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="first iterations left out")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the recipe's")
    p.add_argument("--smoke", action="store_true", help="the recipe shrunk (the CPU rehearsal)")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--json", metavar="PATH")
    opts = p.parse_args()
    if opts.iters <= opts.warmup:
        p.error("--iters must be larger than --warmup")
    return opts


def recipe_command(opts, attention: str) -> list:
    """examples/pretrain.sh's command for one process, without the flags in DROPPED."""
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "MODEL": opts.model,
        "ATTENTION": attention,
        "NODES": "1",
        "GPUS_PER_NODE": "1",
        "LAUNCHER": "python",
        "PYTHON": sys.executable,
        "DATA_PATH": "",
        "SMOKE": "1" if opts.smoke else "0",
        # a few iterations: the schedule shrunk to fit them (its shape costs no time)
        "TRAIN_ITERS": str(opts.iters),
        "WARMUP": "1",
    }
    if opts.micro_batch_size:
        env["MBS"] = env["GBS"] = str(opts.micro_batch_size)
    else:
        env["GBS"] = ""  # one micro-batch per step: set below from the recipe's MBS
    printed = (
        subprocess.run(
            ["bash", "examples/pretrain.sh"],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    cmd, kept = shlex.split(printed), []
    while cmd:
        flag = cmd.pop(0)
        if flag in DROPPED:
            if cmd and not cmd[0].startswith("--"):
                cmd.pop(0)
            continue
        kept.append(flag)
    return kept


def measure(opts, attention: str, work: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = os.path.join(work, attention.replace("+", "-"))
    cmd = recipe_command(opts, attention)
    mbs = cmd[cmd.index("--micro-batch-size") + 1]
    cmd[cmd.index("--global-batch-size") + 1] = mbs
    cmd += [
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--tensorboard-dir",
        tb,
        "--data-cache-path",
        os.path.join(work, "cache"),
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=opts.timeout)
    if result.returncode:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-3000:])
        raise RuntimeError(f"{attention}: pretrain_gpt.py failed with {result.returncode}")
    events = EventAccumulator(tb)
    events.Reload()
    tags = set(events.Tags()["scalars"])

    def steady(tag):  # the median over the iterations after the warm-up
        if tag not in tags:
            return None
        return statistics.median(e.value for e in events.Scalars(tag) if e.step > opts.warmup)

    memory_tag = next(t for t in ("mem-max-allocated-bytes", "mem-peak-rss-bytes") if t in tags)
    return {
        "attention": attention,
        "micro_batch_size": int(mbs),
        "seq_length": int(cmd[cmd.index("--seq-length") + 1]),
        "tokens_per_s": steady("tokens-per-sec"),
        "tflops": steady("tflops-per-device"),
        "mfu": steady("mfu"),
        "peak_memory_gib": max(e.value for e in events.Scalars(memory_tag)) / 2**30,
        "memory": memory_tag,
    }


def main() -> None:
    opts = parse()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for variant in opts.variants:  # a variant that fails is a row saying so; the rest run
            try:
                rows.append(measure(opts, variant, work))
            except (RuntimeError, subprocess.TimeoutExpired, StopIteration, ValueError) as e:
                rows.append({"attention": variant, "error": f"{type(e).__name__}: {e}"})
            if opts.json:  # after each variant: a later failure loses nothing measured
                with open(opts.json, "w") as f:
                    json.dump({"model": opts.model, "smoke": opts.smoke, "rows": rows}, f, indent=2)
    measured = [r for r in rows if "error" not in r]
    print(
        f"{opts.model}{' (smoke)' if opts.smoke else ''}: one process; medians of iterations "
        f"{opts.warmup + 1}..{opts.iters}"
        + (
            f", micro-batch {measured[0]['micro_batch_size']} x {measured[0]['seq_length']}"
            if measured
            else ""
        )
    )
    print(
        f"{'variant':<12}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'peak GiB':>10}{'vs first':>10}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['attention']:<12} failed: {r['error']}")
            continue
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / measured[0]["tokens_per_s"]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(
            f"{r['attention']:<12}{r['tokens_per_s']:>12.0f}{r['tflops']:>10.2f}{mfu:>8}"
            f"{r['peak_memory_gib']:>10.2f}{r['tokens_per_s_ratio']:>10.2f}"
        )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"model": opts.model, "smoke": opts.smoke, "rows": rows}, f, indent=2)
    if not measured:
        sys.exit(1)


if __name__ == "__main__":
    main()
