"""lm-evaluation-harness's command line, timing the model: the wall time of every forward it asks
of its `hf` model and the tokens in it, written to a JSON file when the run ends.

    python examples/lm_eval/timed.py --timing PATH run --model hf ...   # as `lm_eval run ...`

Everything after `--timing PATH` is lm-eval's own command line, unchanged. Timed: each call of
the `hf` model's forward (`HFLM._model_call`: log-likelihood and rolling perplexity tasks) and of
its `generate` (`HFLM._model_generate`: generation tasks), device-synchronised, nothing else
(not tokenization, request sorting or metric computation); the first call of each kind runs
twice, its first run untimed, so that one-time costs (imports, kernel compilation, the
allocator's first blocks) are charged to no rule. Counted: the tokens each forward
computes (batch x length, the batch's padding included, as the model computes it) and the
positions each `generate` adds. `examples/lm_eval/summary.py` puts these next to the metrics.
"""

import json
import os
import sys
import time


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timing:
    """Seconds and tokens of the timed calls, by kind ("forward", "generate")."""

    def __init__(self):
        self.seconds = {"forward": 0.0, "generate": 0.0}
        self.tokens = {"forward": 0, "generate": 0}
        self.calls = {"forward": 0, "generate": 0}

    def add(self, kind: str, seconds: float, tokens: int) -> None:
        self.seconds[kind] += seconds
        self.tokens[kind] += tokens
        self.calls[kind] += 1

    def report(self) -> dict:
        """{"forward": {"calls", "tokens", "seconds", "us_per_token"}, "generate": {...}}; a kind
        never called has no us_per_token (null)."""
        return {
            kind: {
                "calls": self.calls[kind],
                "tokens": self.tokens[kind],
                "seconds": self.seconds[kind],
                "us_per_token": (
                    self.seconds[kind] * 1e6 / self.tokens[kind] if self.tokens[kind] else None
                ),
            }
            for kind in self.seconds
        }


def time_calls(cls, timing: Timing) -> None:
    """Wrap `cls._model_call` and `cls._model_generate` (lm-eval's HFLM, or any class with the
    same two methods) so that each call adds its time and tokens to `timing`."""
    call, generate = cls._model_call, cls._model_generate
    warm = set()

    def _warm_up(kind, fn, *args, **kwargs):
        if kind not in warm:
            fn(*args, **kwargs)
            warm.add(kind)

    def _model_call(self, inps, *args, **kwargs):
        _warm_up("forward", call, self, inps, *args, **kwargs)
        _sync()
        start = time.perf_counter()
        out = call(self, inps, *args, **kwargs)
        _sync()
        timing.add("forward", time.perf_counter() - start, inps.numel())
        return out

    def _model_generate(self, context, *args, **kwargs):
        _warm_up("generate", generate, self, context, *args, **kwargs)
        _sync()
        start = time.perf_counter()
        out = generate(self, context, *args, **kwargs)
        _sync()
        added = out.shape[0] * max(out.shape[1] - context.shape[1], 0)
        timing.add("generate", time.perf_counter() - start, added)
        return out

    cls._model_call, cls._model_generate = _model_call, _model_generate


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--timing":
        sys.exit("usage: timed.py --timing PATH <lm_eval arguments...>")
    path, rest = argv[1], argv[2:]
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.models.huggingface import HFLM

    timing = Timing()
    time_calls(HFLM, timing)
    sys.argv = ["lm_eval", *rest]
    cli_evaluate()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(timing.report(), f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
