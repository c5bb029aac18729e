"""Does learned routing keep the distant pairs that matter, where a window alone cannot?

Tiny models trained on multi-query associative recall (MQAR, `pretrain_gpt.py --mqar`: pairs at
the start, queries at least --mqar-min-distance tokens later) with each attention variant and
several seeds, then scored by `tools/eval_ppl.py` in every mode: recall accuracy (the share of
queried values predicted) and the share of causal pairs kept. Variants:

  standard    full causal attention (the ceiling)
  window      sliding-window attention over Focus's local window alone (--window-size w-1,0):
              no query can reach its pair
  focus       soft-gate Focus, evaluated soft and sparse (top-1, top-2)
  focus+xsa   the same with XSA
  focus-sinkS Focus with the first S tokens kept for every query (--focus-sink-tokens S)
  focus-random, focus+xsa-random
              the control: routers that never learn (--focus-router random: W_g and the
              centroids frozen as drawn from the seed); -random-centroids freezes the centroids
              alone
  focus-distilled, focus+xsa-distilled
              routers trained by distillation from the dense attention (--focus-distill-coeff
              1), after a dense warm-up of a fifth of --iters (--focus-dense-warmup-iters)

`--task corpus` trains on the embedded text corpus instead and reports validation loss, the
question for attention sinks on text. Prints a table, writes JSON and a plot.

    python examples/mqar_study.py --out runs/mqar-study [--seq-length 128] [--seeds 1 2]
        [--iters 800] [--variants standard window focus focus+xsa] [--json J] [--plot P]

The defaults are docs/mqar.md's CPU study (sequences of 128 tokens, queries at least 64 tokens
after their pair, a Focus window of 16). Long sequences are learned through a length curriculum,
as context extension is done on text: `--short-seq-length 128 --short-iters 800` first trains
each model at 128 tokens (recall at a distance is learned there in minutes; trained at 1024 from
scratch, no model leaves the plateau within a CPU's budget), then `--iters` at --seq-length
continue from those weights (`pretrain_gpt.py --pretrained-checkpoint`), and the models are
scored at --seq-length. `--init-from` adds a further stage: each model starts from the weights
of an earlier study's model of the same variant and seed (e.g. 2048 tokens after the 1024 above);
with `--iters 0` those models are only scored, at this study's --seq-length.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "standard": ["--attention", "standard"],
    "focus": ["--attention", "focus"],
    "focus+xsa": ["--attention", "focus+xsa"],
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", required=True, help="folder for the runs (checkpoints, reports)")
    p.add_argument("--task", choices=("mqar", "corpus"), default="mqar")
    p.add_argument("--variants", nargs="+", default=["standard", "window", "focus", "focus+xsa"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--iters", type=int, default=800)
    add_model_args(p)
    p.add_argument("--mqar-pairs", type=int, default=8)
    p.add_argument("--mqar-queries", type=int, default=None)
    p.add_argument(
        "--mqar-two-token-pairs",
        action="store_true",
        help="zoology's form (key, value as two tokens): a two-hop recall that takes "
        "far more training than a CPU study affords; default: packed pairs",
    )
    p.add_argument("--mqar-vocab-size", type=int, default=256)
    p.add_argument("--mqar-min-distance", type=int, default=64)
    short = p.add_argument_group("length curriculum: a first stage at a short length")
    short.add_argument("--short-seq-length", type=int, default=None)
    short.add_argument("--short-iters", type=int, default=800)
    short.add_argument("--short-micro-batch-size", type=int, default=64)
    short.add_argument(
        "--short-min-distance", type=int, default=64, help="--mqar-min-distance of that stage"
    )
    p.add_argument(
        "--init-from",
        metavar="STUDY",
        help="start each model from the final weights of the model of the same variant and seed "
        "in this earlier study's --out (a further stage of a length curriculum); with --iters 0, "
        "score those models at --seq-length without training",
    )
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    opts = p.parse_args()
    for name in opts.variants:
        variant_flags(name, opts)  # unknown names fail before any training
    if opts.iters == 0 and (opts.short_seq_length or not opts.init_from):
        raise SystemExit(
            "error: --iters 0 only scores the models of --init-from: give --init-from, "
            "without --short-seq-length"
        )
    if opts.init_from:  # and missing starting points too
        for name in opts.variants:
            for seed in opts.seeds:
                origin = init_checkpoint(opts, name, seed)
                if not os.path.exists(os.path.join(origin, "latest")):
                    raise SystemExit(f"error: --init-from: no checkpoint in {origin}")
    return opts


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, training and evaluation flags this study shares with routing_study.py."""
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--focus-window", type=int, default=16)
    p.add_argument("--focus-groups", type=int, default=4)
    p.add_argument("--eval-iters", type=int, default=8)


def run_name(variant: str, seed: int) -> str:
    return f"{variant.replace('+', '-')}-seed{seed}"


def init_checkpoint(opts, variant: str, seed: int) -> str:
    """The --init-from study's final checkpoint of this variant and seed."""
    return os.path.join(opts.init_from, run_name(variant, seed), "ckpt")


def variant_flags(name: str, opts) -> list:
    if name in VARIANTS:
        return VARIANTS[name]
    if name == "window":
        return ["--attention", "standard", "--window-size", f"{opts.focus_window - 1},0"]
    if name.startswith("focus-sink") and name[len("focus-sink") :].isdigit():
        return ["--attention", "focus", "--focus-sink-tokens", name[len("focus-sink") :]]
    for router in ("random-centroids", "random"):  # the longer suffix first
        base = name.removesuffix("-" + router)
        if base != name and base in ("focus", "focus+xsa"):
            return VARIANTS[base] + ["--focus-router", router]
    base = name.removesuffix("-distilled")
    if base != name and base in ("focus", "focus+xsa"):  # a fifth of the budget dense first
        return VARIANTS[base] + [
            "--focus-distill-coeff", "1", "--focus-dense-warmup-iters", str(opts.iters // 5)
        ]  # fmt: skip
    raise SystemExit(
        f"error: unknown variant {name!r}: standard, window, focus, focus+xsa, focus-sinkS, "
        "focus-random, focus+xsa-random (or -random-centroids), focus-distilled, "
        "focus+xsa-distilled"
    )


def data_flags(opts, min_distance: int) -> list:
    if opts.task == "corpus":
        return ["--data-cache-path", os.path.join(opts.out, "cache")]
    extra = ["--mqar-queries", str(opts.mqar_queries)] if opts.mqar_queries else []
    extra += [] if opts.mqar_two_token_pairs else ["--mqar-packed"]
    return [
        "--mqar",
        "--mqar-pairs",
        str(opts.mqar_pairs),
        "--mqar-vocab-size",
        str(opts.mqar_vocab_size),
        "--mqar-min-distance",
        str(min_distance),
        *extra,
    ]


def run(cmd: list, log: str) -> None:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)


def train(opts, variant: str, seed: int, ckpt: str, log: str, stage: dict, extra=()) -> None:
    """One pretrain_gpt.py run of `stage` (seq, min_distance, micro_batch, iters) into `ckpt`;
    an interrupted run resumes from its last checkpoint."""
    iters = stage["iters"]
    run(
        [
            sys.executable,
            "pretrain_gpt.py",
            *model_flags(opts),
            "--seq-length",
            str(stage["seq"]),
            *variant_flags(variant, opts),
            *data_flags(opts, stage["min_distance"]),
            "--seed",
            str(seed),
            "--micro-batch-size",
            str(stage["micro_batch"]),
            "--train-iters",
            str(iters),
            "--lr",
            str(opts.lr),
            "--min-lr",
            str(opts.lr / 10),
            "--lr-warmup-iters",
            str(iters // 10),
            "--log-interval",
            "50",
            "--eval-interval",
            str(iters),
            "--eval-iters",
            "2",
            "--save",
            ckpt,
            "--load",
            ckpt,
            "--save-interval",
            str(max(1, iters // 4)),
            *extra,
        ],
        log,
    )


def model_flags(opts) -> list:
    return [
        "--num-layers",
        str(opts.layers),
        "--hidden-size",
        str(opts.hidden),
        "--num-attention-heads",
        str(opts.heads),
        "--position-embedding-type",
        "rope",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--focus-window",
        str(opts.focus_window),
        "--focus-groups",
        str(opts.focus_groups),
    ]


def train_and_evaluate(opts, variant: str, seed: int) -> dict:
    folder = os.path.join(opts.out, run_name(variant, seed))
    os.makedirs(folder, exist_ok=True)
    ckpt, log, report = (os.path.join(folder, x) for x in ("ckpt", "log.txt", "eval.json"))
    start = time.time()
    if not os.path.exists(report):  # an interrupted study resumes where it stopped
        extra = []
        if opts.init_from:
            origin = init_checkpoint(opts, variant, seed)
            extra = ["--pretrained-checkpoint", origin]
            if opts.iters == 0:  # scored as they are, e.g. beyond their training length
                ckpt = origin
        if opts.short_seq_length:
            short_ckpt = os.path.join(folder, f"ckpt-{opts.short_seq_length}")
            short = {
                "seq": opts.short_seq_length,
                "min_distance": opts.short_min_distance,
                "micro_batch": opts.short_micro_batch_size,
                "iters": opts.short_iters,
            }
            train(opts, variant, seed, short_ckpt, log, short, extra)
            extra = ["--pretrained-checkpoint", short_ckpt]
        stage = {
            "seq": opts.seq_length,
            "min_distance": opts.mqar_min_distance,
            "micro_batch": opts.micro_batch_size,
            "iters": opts.iters,
        }
        if stage["iters"]:
            train(opts, variant, seed, ckpt, log, stage, extra)
        run(
            [
                sys.executable,
                "tools/eval_ppl.py",
                "--load",
                ckpt,
                *data_flags(opts, opts.mqar_min_distance),
                "--seq-length",
                str(opts.seq_length),
                "--eval-iters",
                str(opts.eval_iters),
                "--micro-batch-size",
                str(opts.micro_batch_size),
                "--seed",
                "999",
                "--json",
                report,
            ],
            log,
        )
    with open(report) as f:
        rows = json.load(f)["rows"]
    return {"variant": variant, "seed": seed, "rows": rows, "seconds": time.time() - start}


def run_all(opts) -> list:
    """Every variant and seed of `opts`, in turn: their evaluation rows."""
    os.makedirs(opts.out, exist_ok=True)
    results = []
    for variant in opts.variants:
        for seed in opts.seeds:
            results.append(train_and_evaluate(opts, variant, seed))
            print(f"{variant} seed {seed}: done in {results[-1]['seconds']:.0f} s", flush=True)
    return results


def router(variant: str) -> str:
    """The router a variant trains: learned, or one of the frozen controls ("-": no router)."""
    if not variant.startswith("focus"):
        return "-"
    frozen = [r for r in ("random-centroids", "random") if variant.endswith("-" + r)]
    if variant.endswith("-distilled"):
        return "distilled"
    return frozen[0] if frozen else "learned"


def summarise(results: list) -> list:
    """One row per variant and mode: accuracy, loss, perplexity, pairs kept and kept mass (None
    where the mode keeps every pair), mean and range over seeds."""
    table = {}
    for result in results:
        for row in result["rows"]:
            mode = row["mode"] if row["top_k"] is None else f"sparse top-{row['top_k']}"
            if mode in ("standard", "xsa"):
                mode = "full" if result["variant"] != "window" else "window"
            table.setdefault((result["variant"], mode), []).append(row)
    out = []
    for (variant, mode), rows in table.items():

        def stats(key):
            values = [r[key] for r in rows]
            if None in values:
                return None
            return statistics.mean(values), min(values), max(values)

        out.append(
            {
                "variant": variant,
                "router": router(variant),
                "mode": mode,
                "seeds": len(rows),
                **{key: stats(key) for key in ("accuracy", "loss", "ppl", "pairs_kept")},
                "kept_mass": stats("kept_mass"),
                "accuracy_per_seed": [r["accuracy"] for r in rows],
                "loss_per_seed": [r["loss"] for r in rows],
            }
        )
    return out


def table(summary: list, metrics: list) -> str:
    """variant, router, mode, each metric's mean ([min, max] over seeds when several), the pairs
    kept and the kept mass."""
    ranges = any(r["seeds"] > 1 for r in summary)
    head = f"{'variant':<18}{'router':<18}{'mode':<14}"
    for metric in metrics:
        head += f"{metric:>10}" + (f"{'range':>18}" if ranges else "")
    lines = [head + f"{'pairs kept':>12}{'kept mass':>11}"]
    for r in summary:
        line = f"{r['variant']:<18}{r['router']:<18}{r['mode']:<14}"
        for metric in metrics:
            mean, low, high = r[metric]
            line += f"{mean:>10.3f}" + (f"{f'[{low:.3f}, {high:.3f}]':>18}" if ranges else "")
        mass = "-" if r["kept_mass"] is None else f"{r['kept_mass'][0]:.3f}"
        lines.append(line + f"{r['pairs_kept'][0]:>12.3f}{mass:>11}")
    return "\n".join(lines)


def plot(summary: list, path: str, title: str, metric: str = "accuracy") -> None:
    """A bar per variant and mode (the mean of `metric`), a dot per seed, and the pairs kept
    (and kept mass) above it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['variant']}\n{r['mode']}" for r in summary]
    means = [r[metric][0] for r in summary]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4))
    ax.bar(range(len(labels)), means, color="tab:blue")
    for i, r in enumerate(summary):  # each seed, as the outcomes are often far apart
        seeds = r[f"{metric}_per_seed"]
        ax.plot([i] * len(seeds), seeds, "o", color="black", markersize=3)
        kept = f"kept {r['pairs_kept'][0]:.2f}"
        if r["kept_mass"] is not None:
            kept += f"\nmass {r['kept_mass'][0]:.2f}"
        ax.annotate(
            kept,
            (i, max(seeds)),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=7,
        )
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    if metric == "accuracy":
        ax.set_ylabel("recall accuracy (mean; dots: seeds)")
        ax.set_ylim(0, 1.1)
    else:  # losses differ by little: the axis starts near them
        values = [v for r in summary for v in r[f"{metric}_per_seed"]]
        pad = 0.2 * (max(values) - min(values)) or 0.1
        ax.set_ylabel(f"validation {metric} (mean; dots: seeds)")
        ax.set_ylim(min(values) - pad, max(values) + 2 * pad)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    opts = parse()
    results = run_all(opts)
    summary = summarise(results)
    metric = "accuracy" if opts.task == "mqar" else "loss"
    curriculum = (
        f" after {opts.short_iters} at seq {opts.short_seq_length}" if opts.short_seq_length else ""
    )
    if opts.init_from:
        origin = os.path.normpath(opts.init_from)
        curriculum += f", from {origin}" if opts.iters else f": {origin}'s models, not trained"
    print(
        f"{opts.task}, seq {opts.seq_length}, {opts.iters} iterations{curriculum}, "
        f"seeds {opts.seeds}"
    )
    print(table(summary, [metric]))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"settings": vars(opts), "summary": summary, "runs": results}, f, indent=1)
    if opts.plot and opts.task == "mqar":
        plot(
            summary,
            opts.plot,
            f"MQAR: {opts.mqar_pairs} pairs, queries >= "
            f"{opts.mqar_min_distance} tokens later, seq {opts.seq_length}{curriculum}; "
            f"Focus window {opts.focus_window}, K {opts.focus_groups}",
        )


if __name__ == "__main__":
    main()
