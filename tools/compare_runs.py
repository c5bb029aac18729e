"""Put the loss curves of several runs side by side: plots (PNG/SVG) and a final-loss table.

    python tools/compare_runs.py runs/0.7b-*/ --out plots/0.7b
    python tools/compare_runs.py standard=runs/a/tensorboard xsa=runs/b/tensorboard \
        --seq-length 2048

Each argument is a run, `LABEL=PATH`, or a glob; PATH is a TensorBoard folder, a run folder with a
`tensorboard/` inside (as examples/pretrain.sh makes), or a folder of such runs. Runs that share a
label are seeds of one variant: their curves are averaged (the band shows min..max over seeds) and
the table gives mean +- standard deviation. A run's label is, in order: the one given, the "label"
of the `run.json` that examples/pretrain.sh writes next to its TensorBoard folder, or the run
folder's name without a trailing seed (`0.7b-xsa-seed2` -> `0.7b-xsa`).

The x axis is tokens: iteration x global batch (the `batch-size` scalar every run logs) x sequence
length (`--seq-length`, or `seq_length` from `run.json`). Training loss is smoothed as TensorBoard
does (`--smoothing`, a debiased exponential moving average). Validation loss is plotted as logged.
Each variant is also compared with its baseline: the group whose label has "standard" in place of
its attention variant (`0.7b xsa` -> `0.7b standard`), or `--baseline LABEL` for all; a third
panel shows the difference of their training losses, smoothed more (`--delta-smoothing`).

Prints the final-loss table as markdown; `--json PATH` writes it and every run's numbers.
"""

import argparse
import glob
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_focus import cli  # noqa: E402

TRAIN_TAG = "lm loss"
VALID_TAG = "lm loss validation"
BATCH_TAG = "batch-size"
SAMPLES_TAG = "batch-size vs samples"  # its steps: the samples consumed at each logged step
ATTENTION_RE = re.compile(r"focus\+xsa|focus-xsa|focus|xsa|standard")
SEED_RE = re.compile(r"[-_.]?seed[-_]?\d+$")


@dataclass
class Run:
    path: str  # the TensorBoard folder
    label: str
    seq_length: Optional[int]
    global_batch_size: Optional[int]
    series: Dict[str, tuple] = field(default_factory=dict)  # tag -> (steps, values)

    def tokens(self, steps: np.ndarray) -> np.ndarray:
        """Tokens seen after each step: the samples consumed by then (between logged steps,
        interpolated: a batch growing under --rampup-batch-size is counted as it grew) x
        sequence length; for logs without them, step x batch size at that step."""
        if SAMPLES_TAG in self.series and BATCH_TAG in self.series:
            iterations, samples = self.series[BATCH_TAG][0], self.series[SAMPLES_TAG][0]
            if len(iterations) == len(samples):
                consumed = np.interp(steps, np.r_[0.0, iterations], np.r_[0.0, samples])
                return consumed * self.seq_length
        if BATCH_TAG in self.series:
            b_steps, b_values = self.series[BATCH_TAG]
            at = np.clip(np.searchsorted(b_steps, steps, side="right") - 1, 0, len(b_steps) - 1)
            batch = b_values[at]
        elif self.global_batch_size:
            batch = np.full(len(steps), float(self.global_batch_size))
        else:
            raise ValueError(f"{self.path} logs no '{BATCH_TAG}' scalar: pass --global-batch-size")
        return steps * batch * self.seq_length


# --- finding and reading runs ---------------------------------------------------------------------


def _has_events(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "events.out.tfevents.*")))


def find_runs(arguments: List[str]) -> List[tuple]:
    """[(label or None, TensorBoard folder)] for each `[LABEL=]PATH-or-glob` argument."""
    found = []
    for argument in arguments:
        label, _, pattern = argument.partition("=") if "=" in argument else (None, "", argument)
        paths = sorted(glob.glob(pattern)) or [pattern]
        matched = []
        for path in paths:
            if not os.path.isdir(path):
                continue
            if _has_events(path):
                matched.append(path)
            elif _has_events(os.path.join(path, "tensorboard")):
                matched.append(os.path.join(path, "tensorboard"))
            else:
                matched += sorted(
                    root
                    for root, _, files in os.walk(path)
                    if any(f.startswith("events.out.tfevents.") for f in files)
                )
        if not matched:
            raise FileNotFoundError(f"{pattern}: no TensorBoard event files found")
        found += [(label or None, m) for m in matched]
    return found


def _run_json(tb_dir: str) -> dict:
    for folder in (tb_dir, os.path.dirname(os.path.normpath(tb_dir))):
        path = os.path.join(folder, "run.json")
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    return {}


def _default_label(tb_dir: str) -> str:
    folder = os.path.normpath(tb_dir)
    name = os.path.basename(folder)
    if name in ("tensorboard", "tb", "logs"):
        name = os.path.basename(os.path.dirname(folder))
    return SEED_RE.sub("", name) or name


def read_run(
    label: Optional[str],
    tb_dir: str,
    seq_length: Optional[int],
    global_batch_size: Optional[int],
    tags: List[str],
) -> Run:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    meta = _run_json(tb_dir)
    run = Run(
        path=tb_dir,
        label=label or meta.get("label") or _default_label(tb_dir),
        seq_length=seq_length or meta.get("seq_length"),
        global_batch_size=global_batch_size or meta.get("global_batch_size"),
    )
    events = EventAccumulator(tb_dir, size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    available = set(events.Tags()["scalars"])
    for tag in tags + [BATCH_TAG, SAMPLES_TAG]:
        if tag not in available:
            continue
        latest = {}
        for event in events.Scalars(tag):  # a resumed run logs some steps twice: keep the last
            latest[event.step] = event.value
        steps = np.array(sorted(latest), dtype=np.float64)
        run.series[tag] = (steps, np.array([latest[s] for s in sorted(latest)], dtype=np.float64))
    if TRAIN_TAG in tags and TRAIN_TAG not in run.series:
        raise ValueError(
            f"{tb_dir} has no '{TRAIN_TAG}' scalar (tags: {', '.join(sorted(available)) or 'none'})"
        )
    return run


# --- curves and statistics ------------------------------------------------------------------------


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    if weight <= 0 or len(values) == 0:
        return values
    out, last, n = np.empty_like(values), 0.0, 0
    for i, v in enumerate(values):
        n += 1
        last = last * weight + (1 - weight) * v
        out[i] = last / (1 - weight**n)
    return out


@dataclass
class Curve:
    x: np.ndarray  # tokens (or iterations)
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    runs: int


def group_curve(runs: List[Run], tag: str, smoothing: float, x_axis: str) -> Optional[Curve]:
    """Seeds of one variant on a common axis: mean, min and max at each point."""
    curves = []
    for run in runs:
        if tag not in run.series or len(run.series[tag][0]) == 0:
            continue
        steps, values = run.series[tag]
        x = run.tokens(steps) if x_axis == "tokens" else steps
        curves.append((x, smooth(values, smoothing)))
    if not curves:
        return None
    start = max(c[0][0] for c in curves)
    end = min(c[0][-1] for c in curves)
    grid = min((c[0] for c in curves), key=len)
    grid = grid[(grid >= start) & (grid <= end)]
    if len(grid) == 0:
        grid = np.array([end])
    stacked = np.stack([np.interp(grid, x, y) for x, y in curves])
    return Curve(grid, stacked.mean(0), stacked.min(0), stacked.max(0), len(curves))


def _final(run: Run, tag: str, window: int) -> Optional[float]:
    if tag not in run.series or len(run.series[tag][1]) == 0:
        return None
    return float(np.mean(run.series[tag][1][-window:]))


def _mean_std(values: List[Optional[float]]):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def baseline_of(label: str, labels: List[str], forced: Optional[str]) -> Optional[str]:
    if forced:
        return forced if forced != label and forced in labels else None
    match = ATTENTION_RE.search(label)
    if not match or match.group(0) == "standard":
        return None
    candidate = label[: match.start()] + "standard" + label[match.end() :]
    return candidate if candidate in labels else None


def summarize(groups: Dict[str, List[Run]], args: argparse.Namespace) -> List[dict]:
    labels = list(groups)
    rows = []
    for label, runs in groups.items():
        per_run = []
        for run in runs:
            steps = run.series[TRAIN_TAG][0]
            tokens = float(run.tokens(steps[-1:])[0]) if args.x == "tokens" else None
            per_run.append(
                {
                    "path": run.path,
                    "iterations": int(steps[-1]),
                    "tokens": tokens,
                    "final_train_loss": _final(run, TRAIN_TAG, args.final_window),
                    "final_validation_loss": _final(run, args.valid_tag, 1),
                }
            )
        train_mean, train_std = _mean_std([r["final_train_loss"] for r in per_run])
        valid_mean, valid_std = _mean_std([r["final_validation_loss"] for r in per_run])
        rows.append(
            {
                "label": label,
                "runs": len(runs),
                "iterations": min(r["iterations"] for r in per_run),
                "tokens": min(r["tokens"] for r in per_run) if args.x == "tokens" else None,
                "train_loss": train_mean,
                "train_loss_std": train_std,
                "validation_loss": valid_mean,
                "validation_loss_std": valid_std,
                "baseline": baseline_of(label, labels, args.baseline),
                "per_run": per_run,
            }
        )
    by_label = {row["label"]: row for row in rows}
    for row in rows:
        base = by_label.get(row["baseline"]) if row["baseline"] else None
        for key in ("train_loss", "validation_loss"):
            ok = base is not None and row[key] is not None and base[key] is not None
            row[f"delta_{key}"] = row[key] - base[key] if ok else None
    return rows


# --- output ---------------------------------------------------------------------------------------


def _si(x: float, _pos=None) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _pm(mean, std, n):
    if mean is None:
        return "-"
    return f"{mean:.4f}" + (f" ± {std:.4f}" if n > 1 else "")


def markdown_table(rows: List[dict], x_axis: str) -> str:
    lines = [
        "| run | seeds | "
        + ("tokens" if x_axis == "tokens" else "iterations")
        + " | train loss | validation loss | Δ train | Δ validation | vs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        amount = _si(r["tokens"]) if x_axis == "tokens" else str(r["iterations"])
        delta = [
            f"{r[k]:+.4f}" if r[k] is not None else ""
            for k in ("delta_train_loss", "delta_validation_loss")
        ]
        lines.append(
            f"| {r['label']} | {r['runs']} | {amount} | "
            f"{_pm(r['train_loss'], r['train_loss_std'], r['runs'])} | "
            f"{_pm(r['validation_loss'], r['validation_loss_std'], r['runs'])} | "
            f"{delta[0]} | {delta[1]} | {r['baseline'] or ''} |"
        )
    return "\n".join(lines)


def plot(groups: Dict[str, List[Run]], rows: List[dict], args: argparse.Namespace) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    train = {
        label: group_curve(runs, TRAIN_TAG, args.smoothing, args.x)
        for label, runs in groups.items()
    }
    valid = {
        label: group_curve(runs, args.valid_tag, args.valid_smoothing, args.x)
        for label, runs in groups.items()
    }
    pairs = [(r["label"], r["baseline"]) for r in rows if r["baseline"]]
    delta_weight = args.delta_smoothing
    if delta_weight is None:  # an EMA over ~2% of the logged points: a difference of noisy curves
        points = max(len(run.series[TRAIN_TAG][0]) for runs in groups.values() for run in runs)
        delta_weight = max(args.smoothing, 1 - 50 / points) if points > 50 else args.smoothing
    delta = (
        {
            label: group_curve(runs, TRAIN_TAG, delta_weight, args.x)
            for label, runs in groups.items()
        }
        if pairs
        else {}
    )
    panels = 3 if pairs else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.6), squeeze=False)
    axes = axes[0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {label: colors[i % len(colors)] for i, label in enumerate(groups)}

    def draw(ax, curves, title):
        for label, curve in curves.items():
            if curve is None:
                continue
            n = f" ({curve.runs} seeds)" if curve.runs > 1 else ""
            marker = "o" if len(curve.x) <= 30 else None
            ax.plot(
                curve.x,
                curve.mean,
                color=color[label],
                label=label + n,
                marker=marker,
                markersize=3,
                linewidth=1.4,
            )
            if curve.runs > 1:
                ax.fill_between(
                    curve.x, curve.low, curve.high, color=color[label], alpha=0.2, linewidth=0
                )
        ax.set_title(title)
        ax.set_ylabel("loss")
        if args.ylim:
            ax.set_ylim(*args.ylim)

    smoothed = f", smoothing {args.smoothing:g}" if args.smoothing > 0 else ""
    draw(axes[0], train, f"training loss{smoothed}")
    draw(axes[1], valid, "validation loss")
    if pairs:
        ax, shown = axes[2], []
        for label, base in pairs:
            mine, theirs = delta[label], delta[base]
            if mine is None or theirs is None:
                continue
            lo, hi = max(mine.x[0], theirs.x[0]), min(mine.x[-1], theirs.x[-1])
            x = theirs.x[(theirs.x >= lo) & (theirs.x <= hi)]
            if len(x) == 0:
                continue
            diff = np.interp(x, mine.x, mine.mean) - np.interp(x, theirs.x, theirs.mean)
            ax.plot(x, diff, color=color[label], label=f"{label} - {base}", linewidth=1.4)
            shown.append(diff[x >= x[0] + 0.05 * (x[-1] - x[0])])  # past the first steep 5%
        ax.axhline(0.0, color="gray", linewidth=0.8)
        shown = np.concatenate(shown) if shown else np.array([])
        if shown.size and np.ptp(shown) > 0:
            pad = 0.1 * np.ptp(shown)
            ax.set_ylim(min(shown.min(), 0) - pad, max(shown.max(), 0) + pad)
        ax.set_title(
            "training loss difference"
            + (f", smoothing {delta_weight:.3g}" if delta_weight > 0 else "")
        )
        ax.set_ylabel("Δ loss (below 0: better than baseline)")
    for ax in axes:
        ax.set_xlabel("tokens" if args.x == "tokens" else "iteration")
        ax.xaxis.set_major_formatter(FuncFormatter(_si))
        if args.xlog:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    written = []
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    for fmt in args.format:
        path = f"{args.out}.{fmt}"
        fig.savefig(path, dpi=args.dpi)
        written.append(path)
    plt.close(fig)
    return written


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.Parser(description=__doc__)
    p.add_argument(
        "runs",
        nargs="+",
        metavar="[LABEL=]PATH",
        help="TensorBoard folders, run folders or folders of runs (globs allowed)",
    )
    p.add_argument(
        "--out", default="compare", help="output path without extension (default: compare)"
    )
    p.add_argument("--format", nargs="+", choices=("png", "svg", "pdf"), default=["png", "svg"])
    p.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="tokens per sample, for every run (default: run.json's seq_length)",
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="for runs that log no 'batch-size' scalar",
    )
    p.add_argument("--x", choices=("tokens", "iteration"), default="tokens")
    p.add_argument(
        "--smoothing",
        type=float,
        default=0.6,
        help="training-loss smoothing in [0, 1) as in TensorBoard (default 0.6)",
    )
    p.add_argument("--valid-smoothing", type=float, default=0.0)
    p.add_argument(
        "--delta-smoothing",
        type=float,
        default=None,
        help="smoothing of the difference panel (default: an EMA over ~2%% of the "
        "logged points, at least --smoothing)",
    )
    p.add_argument(
        "--valid-tag", default=VALID_TAG, help=f"validation scalar (default '{VALID_TAG}')"
    )
    p.add_argument(
        "--final-window",
        type=int,
        default=1,
        help="final training loss = mean of the last N logged values (default 1)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="label every other group is compared with (default: per group, the "
        "label with 'standard' as attention)",
    )
    p.add_argument("--ylim", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"))
    p.add_argument("--xlog", action="store_true", help="log-scale x axis")
    p.add_argument("--title", default=None)
    p.add_argument("--dpi", type=int, default=120)
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if any(
        not 0 <= w < 1 for w in (args.smoothing, args.valid_smoothing, args.delta_smoothing or 0)
    ):
        p.error("--smoothing, --valid-smoothing and --delta-smoothing must be in [0, 1)")
    if args.final_window < 1:
        p.error("--final-window must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = [
        read_run(label, path, args.seq_length, args.global_batch_size, [TRAIN_TAG, args.valid_tag])
        for label, path in find_runs(args.runs)
    ]
    if args.x == "tokens":
        unknown = [r.path for r in runs if not r.seq_length]
        if unknown:
            raise ValueError(
                "no sequence length for "
                + ", ".join(unknown)
                + ": pass --seq-length, or --x iteration"
            )
    groups: Dict[str, List[Run]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run)
    rows = summarize(groups, args)
    written = plot(groups, rows, args)
    print(markdown_table(rows, args.x))
    print("\nwrote " + ", ".join(written))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(
                {"groups": rows, "plots": written, "x": args.x, "smoothing": args.smoothing},
                f,
                indent=1,
                default=lambda v: None if isinstance(v, float) and math.isnan(v) else v,
            )
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
