"""Sparse Focus's speed against sequence length, drawn from focus_sparse_speed.py's JSON: the
measured speedup over dense causal attention per (heads x dim, K, top-k), beside its ideal
(dense pairs / kept pairs), one panel per JSON file (a CPU run, a GPU session's).

    python benchmarks/focus_sparse_speed.py --json sparse.json
    python benchmarks/plot_speed.py sparse.json [gpu-sparse.json] --out docs/sparse-speed.png
"""

import argparse
import json
import os


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("json", nargs="+", help="focus_sparse_speed.py --json outputs")
    p.add_argument("--out", required=True, metavar="PNG")
    return p.parse_args()


def series(results: list) -> dict:
    """(heads, dim, K, top-k) -> [(n, speedup, ideal)] by n."""
    lines = {}
    for r in results:
        key = (r["heads"], r["head_dim"], r["groups"], r["top_k"])
        lines.setdefault(key, []).append((r["n"], r["speedup"], r["ideal_speedup"]))
    return {key: sorted(points) for key, points in sorted(lines.items())}


def main() -> None:
    opts = parse()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    runs = []
    for path in opts.json:
        with open(path) as f:
            runs.append((os.path.basename(path), json.load(f)))
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.5), squeeze=False)
    for ax, (name, run) in zip(axes[0], runs):
        config = run["config"]
        for i, ((heads, dim, groups, top_k), points) in enumerate(series(run["results"]).items()):
            n, speedup, ideal = zip(*points)
            label = f"{heads}x{dim}, K {groups}, top-{top_k}"
            (line,) = ax.plot(n, speedup, "o-", label=label, color=f"C{i}")
            ax.plot(n, ideal, ":", color=line.get_color(), alpha=0.7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g}K"))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("speedup over dense causal attention")
        ax.set_title(f"{config.get('device', '?')}, {config.get('dtype', '?')} ({name})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, title="solid: measured, dotted: ideal", title_fontsize=8)
    fig.suptitle("Sparse Focus forward (routing, window and merge included) against dense")
    fig.tight_layout()
    fig.savefig(opts.out, dpi=110)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
