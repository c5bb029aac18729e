"""How the commands end on a user's mistake: one line starting `error:`, not a traceback.

An error this project raises while checking the user's input (a flag, a file, a checkpoint, a
config) ends the command with `error: <message>` and exit code 2; a run stopped by its own
safety checks (non-finite losses, a save that could not be written) exits 1. Any error raised
elsewhere (a library, a bug) keeps its traceback. Ctrl-C ends a command with one line (the
first rank's) and exit code 130. Under a launcher the line is told once per job, and a refusal
is final: torchrun does not restart it (`launchers.py`).
"""

import argparse
import difflib
import os
import sys

from megatron_focus import launchers


class Stopped(RuntimeError):
    """A run that stopped itself, for a reason it states (exit code 1)."""


USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotImplementedError,
    FloatingPointError,
    Stopped,
)
STOPPED = (FloatingPointError, Stopped)


def agreed(error: Exception) -> Exception:
    """`error`, marked as raised alike on every rank (after a collective): rank 0 tells it."""
    error.agreed = True
    return error


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raised_here(error: BaseException) -> bool:
    """Whether the innermost frame of `error` is this repository's code."""
    tb, where = error.__traceback__, ""
    while tb is not None:
        where, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    where = os.path.abspath(where)
    return where.startswith(_ROOT + os.sep) and "site-packages" not in where


def run(main, *args, interrupted: str = "interrupted (Ctrl-C)"):
    """`main(*args)`, with the user's errors, and Ctrl-C (`interrupted`), reported in one line;
    then the process groups it made destroyed (`_release_process_groups`)."""
    failed, had_groups = True, _distributed() is not None
    try:
        result = main(*args)
        failed = False
        return result
    except USER_ERRORS as e:
        if not _raised_here(e):
            raise
        launchers.end(
            f"error: {e}",
            1 if isinstance(e, STOPPED) else 2,
            agreed=getattr(e, "agreed", False),
            grouped=_distributed() is not None,
        )
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":
            print(interrupted, file=sys.stderr, flush=True)
        sys.exit(130)  # 128 + SIGINT, as a shell reports an interrupted command
    finally:
        if not had_groups:
            _release_process_groups(failed)


def _distributed():
    """torch.distributed if a process group exists (a process that never imported torch has
    none), else None."""
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _release_process_groups(failed: bool) -> None:
    """Gloo's worker threads left to the interpreter's teardown can abort a process that has
    finished ("terminate called without an active exception", exit -6 instead of its code).
    After a failure only in a world of one, as torchtitan does: a failed rank could block in
    destroying groups that other ranks still wait on."""
    dist = _distributed()
    if dist is not None and (not failed or dist.get_world_size() == 1):
        from megatron_focus import platform

        platform.destroy_distributed()


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default (a switch's: off), unless it names it already;
    descriptions keep their lines (the tools' usage examples)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: {shown_default(action)})".lstrip()


def shown_default(action: argparse.Action) -> str:
    """A flag's default as a user would write it: "off" for a switch, "none" when unset."""
    if action.nargs == 0:
        return "off"
    if action.default is None:
        return "none"
    if isinstance(action.default, (list, tuple)):
        return " ".join(map(str, action.default))
    return str(action.default).replace("%", "%%")


class Parser(argparse.ArgumentParser):
    """A refusal in one line, naming the closest known flag, instead of the whole usage; --help
    with each option's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            known = [o for action in self._actions for o in action.option_strings]
            words, strays = [], []
            for flag in message.split(": ", 1)[1].split():
                close = difflib.get_close_matches(flag.split("=")[0], known, n=1, cutoff=0.8)
                if flag.startswith("-"):
                    words.append(flag + (f" (did you mean {close[0]}?)" if close else ""))
                else:
                    strays.append(flag)
            if words:
                message = (
                    f"unknown flag{'s' if len(words) > 1 else ''} {', '.join(words)}; "
                    f"{self.prog} --help lists them"
                )
            else:  # values that no flag takes, e.g. a second value of a one-value flag
                message = f"unexpected value{'s' if len(strays) > 1 else ''} {', '.join(strays)}"
        self.exit(2, f"error: {message}\n")

    def add_corpus_args(self, order: str, writes: str, keys: str) -> None:
        """--input, --output-prefix and --json-keys, as the tools that read a corpus take them
        (`order`: how the inputs are read; `writes`: what the prefix names; `keys`: what is
        done with the fields)."""
        self.add_argument(
            "--input",
            nargs="+",
            required=True,
            help=f"files or globs: .jsonl, .jsonl.gz, .parquet, .txt{order}",
        )
        self.add_argument("--output-prefix", required=True, help=f"writes {writes}")
        self.add_argument(
            "--json-keys", nargs="+", default=["text"], help=f"fields (parquet columns) to {keys}"
        )
