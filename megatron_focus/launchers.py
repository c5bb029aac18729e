"""How a command that stops on the user's mistake ends a job under a launcher (torchrun, the
DeepSpeed launcher): one line, once, and final.

Every rank runs the same command, so a refusal (a flag, a path, a folder held by another job)
is usually every rank's. One rank tells it (`speaks`): before the process group exists, local rank
0 of each node (the refusal depends on the command line and that node's files); after, rank 0
when every rank raised the same error (`agreed`) or when it is every rank's by construction. The
others wait a moment for the launcher, which ends the job as soon as the speaking rank exits,
and tell their own line only if the job is still running then (an error of their own).

torchrun restarts a failed worker group up to `--max-restarts` times, whatever the failure, and
then exits 1 with its own report. A refusal fails the same way every time; the refusing worker
declares it final in torchelastic's error file (`declare_final`), and the torchrun plugin this
package installs (megatron_focus_torchrun.py, the `torchrun.handlers` entry point torchrun loads at
start) makes torchrun's agent honour that declaration: no restart, and the job exits with the
worker's own code (2), as under the DeepSpeed launcher, which passes a worker's code on.
"""

import json
import os
import sys
import time

# The errorTraits category a refusing worker writes in torchelastic's error file.
FINAL = "megatron_focus.refusal"
# How long a rank that does not speak waits for the launcher to end the job.
GRACE = 10.0


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def speaks(agreed: bool, grouped: bool) -> bool:
    """Whether this rank tells the job's refusal at once: `agreed`, every rank raised it (after
    a collective); `grouped`, the process group existed when it was raised."""
    if _env_int("WORLD_SIZE", 1) <= 1:
        return True
    if grouped and not agreed:
        return True
    return _env_int("RANK" if grouped else "LOCAL_RANK", 0) == 0


def declare_final(line: str) -> None:
    """Under torchrun: this worker's failure is final, in torchelastic's error file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {
        "message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}},
        "errorTraits": {"category": FINAL, "retryability": "False"},
    }
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:  # the agent then treats it as any failure
        pass


def end(line: str, code: int, agreed: bool, grouped: bool) -> None:
    """Exit with `code`, `line` told once per job; a refusal (code 2) declared final."""
    if code == 2:
        declare_final(line)
    if not speaks(agreed, grouped):
        time.sleep(GRACE)  # the launcher ends this rank when the speaking one exits
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)


# --- torchrun's side -----------------------------------------------------------------------------


def _final_code(result) -> "int | None":
    """The exit code of a failure its worker declared final, or None."""
    for failure in (getattr(result, "failures", None) or {}).values():
        path = getattr(failure, "error_file", "")
        if not (path and os.path.isfile(path)):  # torch fills in traits of its own otherwise
            continue
        traits = (getattr(failure, "error_file_data", None) or {}).get("errorTraits") or {}
        if traits.get("category") == FINAL and traits.get("retryability") == "False":
            return failure.exitcode
    return None


def honour_final_failures(agent_class) -> None:
    """Make `agent_class` (torchrun's local agent) end the job with a worker's own exit code,
    unrestarted, when that worker declared its failure final."""
    monitor = agent_class._monitor_workers
    if getattr(monitor, "honours_final_failures", False):
        return

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        code = _final_code(result)
        if code is not None:
            raise SystemExit(code)  # torchrun's agent stops the workers on its way out
        return result

    _monitor_workers.honours_final_failures = True
    agent_class._monitor_workers = _monitor_workers


def honour_final_failures_in_torchrun() -> None:
    """torchrun's own agent honours final failures (the entry point's work, in torchrun)."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        honour_final_failures(LocalElasticAgent)
    except (ImportError, AttributeError):  # another torch's agent: restarts as it would
        pass
