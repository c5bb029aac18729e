"""The summary table of a benchmarks/gpu_session.sh run: each part's status and time, and its
headline figures from the part's JSON. Exits 1 if any part failed or ran out of time.

    python benchmarks/session_summary.py OUT_DIR
"""

import json
import os
import sys


def _load(out: str, name: str):
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def e2e(result: dict) -> str:
    losses, rows = result["losses"], result["eval_ppl"]
    sparse = [r for r in rows if r["mode"] == "sparse"]
    text = (
        f"loss {losses[0]:.2f} -> {losses[-1]:.2f}, resume |diff| "
        f"{result['resume_max_abs_diff']:.1e}, ppl {rows[0]['ppl']:.1f}"
    )
    if sparse:
        text += f" (sparse top-1 {sparse[0]['ppl']:.1f})"
    return text + f", HF generate on {result['generate']['device']}"


def sparse(result: dict) -> str:
    rows = result["results"]
    train = result["config"].get("train")

    def figures(r: dict) -> str:
        against = f"{r['over_kept']:.2f}x over kept" if train else f"{r['of_ideal']:.0%} of ideal"
        parts = f"; parts' path {r['dense_ms'] / r['parts_ms']:.2f}x" if "parts_ms" in r else ""
        if "eager_ms" in r:  # what its CUDA graphs save
            parts += f"; graphs {r['eager_ms'] / r['sparse_ms']:.2f}x"
        return (
            f"{r.get('heads', 4)}x{r.get('head_dim', 64)} K={r['groups']} top-{r['top_k']} "
            f"{r['speedup']:.2f}x ({against}{parts})"
        )

    step = "training step " if train else ""
    by_length = []
    for n in sorted({r["n"] for r in rows}):
        kernel = next((r["kernel"] for r in rows if r["n"] == n and "kernel" in r), "")
        by_length.append(
            f"{step}at {n} tokens{f' ({kernel})' if kernel else ''}: "
            + ", ".join(figures(r) for r in rows if r["n"] == n)
        )
    return "; ".join(by_length) if len(by_length) > 1 else by_length[0]


def tiles(result: dict) -> str:
    """Each candidate tile's time over the table's (below 1: faster), or that it failed."""
    said = []
    for r in result["results"]:
        figures = [
            f"{key.removeprefix('tiles ').removesuffix('_vs_table')} {ratio:.2f}x"
            for key, ratio in r.items()
            if key.endswith("_vs_table")
        ] + [f"{tiles} failed" for tiles in r.get("tiles_failed", {})]
        said.append(f"at {r['n']} tokens, time over the table's tiles: {', '.join(figures)}")
    return "; ".join(said)


def overhead(result: dict) -> str:
    worst = {}
    for run in result["runs"]:
        for variant, r in run["results"].items():
            ratios = (r["step_time_ratio"], r["peak_step_memory_ratio"])
            worst[variant] = tuple(map(max, zip(worst.get(variant, (0, 0)), ratios)))
    failed = sorted({v for run in result["runs"] for v in run.get("errors", {})})
    return ", ".join(
        [
            f"{v} {t:.2f}x time {m:.2f}x memory"
            for v, (t, m) in worst.items()
            if v != result["config"]["variants"][0]
        ]
        + [f"{v} failed" for v in failed]
    )


def recipe(result: dict) -> str:
    return ", ".join(
        f"{r['attention']} failed"
        if "error" in r
        else f"{r['attention']} {r['tokens_per_s']:.0f} tok/s"
        + (f" MFU {r['mfu']:.0%}" if r["mfu"] is not None else "")
        for r in result["rows"]
    )


def kernels(result: dict) -> str:
    """Forward + backward against SDPA (and the gate against the reference kernel)."""
    return ", ".join(
        f"{r['shape']} {r['kernel']} {r['x_sdpa']:.2f}x"
        + (f" ({r['x_reference']:.2f}x ref)" if r["kernel"] == "triton soft gate" else "")
        if "x_sdpa" in r
        else f"{r['shape']} {r.get('kernel', '')} failed"
        for r in result["results"]
        if r.get("kernel") not in ("sdpa causal", "flash reference")
    )


def fit(rows: list) -> str:
    """Launches that fit, and the driver's registers and spills against the CPU's prediction."""
    text = f"{sum(r['fits'] for r in rows)} of {len(rows)} launches fit"
    measured = [r for r in rows if "device_registers" in r]
    if measured:
        spills = sum(r["device_spills"] > 0 for r in measured)
        same = sum(r["device_registers"] == r["registers"] for r in measured)
        text += f"; on the device: {spills} spill, {same} of {len(measured)} as predicted"
    return text


def generate(result: dict) -> str:
    """The exported model in sparse mode against the standard one, at the longest context."""
    longest = max(r["context"] for r in result["rows"])
    rows = [r for r in result["rows"] if r["context"] == longest]
    return (
        f"at {longest} tokens: "
        + ", ".join(
            f"{r['model'].removeprefix('focus sparse ')} prefill {r['prefill_speedup']:.2f}x "
            f"decode {r['decode_speedup']:.2f}x (kept keys' bound {r['decode_kept_bound']:.2f}x)"
            for r in rows
            if not r["model"].startswith("standard")
        )
        + f" (decode bound {rows[0]['decode_bound']:.2f}x)"
    )


def graphs(result: dict) -> str:
    """Each model's decoding step as one graph (a StaticCache) against its eager step, at the
    longest context."""
    longest = max(r["context"] for r in result["rows"])
    rows = {r["model"]: r for r in result["rows"] if r["context"] == longest}
    return f"at {longest} tokens, decoding: " + ", ".join(
        f"{name.removesuffix(', static, graph')} {r['decode_tok_s']:.0f} tok/s, "
        f"{r['decode_tok_s'] / rows[name.removesuffix(', static, graph')]['decode_tok_s']:.2f}x "
        f"eager"
        for name, r in rows.items()
        if name.endswith(", static, graph")
    )


HEADLINES = {
    "generate": generate,
    "graphs": graphs,
    "fit": fit,
    "kernels": kernels,
    "e2e": e2e,
    "sparse": sparse,
    "tiles": tiles,
    "overhead": overhead,
    "recipe": recipe,
}


def main() -> int:
    out = sys.argv[1]
    failed = 0
    print(f"{'part':<16}{'status':<10}{'seconds':>8}  figures")
    with open(os.path.join(out, "parts.tsv")) as f:
        for line in f:
            name, rc, took = line.rstrip("\n").split("\t")
            status = {"0": "ok", "124": "TIMEOUT", "skipped": "SKIPPED"}.get(rc, f"FAILED {rc}")
            failed += rc not in ("0", "skipped")
            result = _load(out, name)
            headline = HEADLINES.get(name.split("-")[0])
            figures = ""
            if result is not None and headline is not None:
                try:
                    figures = headline(result)
                except (KeyError, IndexError, TypeError, ValueError) as e:
                    figures = f"(unreadable: {e!r})"
            print(f"{name:<16}{status:<10}{took:>8}  {figures}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
