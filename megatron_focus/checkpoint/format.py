"""The checkpoint format: what a checkpoint folder holds, its names and records, and how each of
its files is written. Training (`training/checkpointing.py`, `training/layouts.py`) and the HF
tools (`hf/native.py`) both read and write checkpoints through it.

Layout (`--save DIR`): `DIR/iter_0000100/` holds DeepSpeed's files (model and optimizer shards per
rank), `model_args.json` (the model's shape and variant), `tokenizer_args.json`, `layout.json` (the
TP / DP size, ZeRO stage and precision that wrote it, `training/layouts.py`, and the names of the
weights its optimizer state covers) and `checksums.json`
(`integrity.py`); `DIR/latest` names the newest complete tag (DeepSpeed's own pointer, so its tools
such as `zero_to_fp32.py` work on these checkpoints). With `--ckpt-format torch_dist` the tag
folder is also Megatron-Core's distributed checkpoint of the model (`torch_dist.py`), and
`DIR/latest_checkpointed_iteration.txt`, Megatron-LM's pointer, names its iteration.
Markers: `weights_only` (an imported model: no optimizer, no run state), `no_optimizer`
(`--no-save-optim`), `base_checkpoint.json` (a retrofit's trained-only checkpoint: where its
frozen weights are). `DIR/job.lock` names the job saving into the folder (`lock.py`): not a
checkpoint, and not what an interrupted run left.
"""

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import re
import uuid
from typing import Optional

from megatron_focus.checkpoint.safe_load import load_file
from megatron_focus.model.config import RECORDED_ONLY, ModelConfig
from megatron_focus.variants import current_name

LATEST = "latest"
# Megatron-LM's pointer: the newest checkpoint's iteration (`--ckpt-format torch_dist`).
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
ARGS_FILE = "model_args.json"
# The tokenizer the model was trained with (for the HF export); not compared on load.
TOKENIZER_FILE = "tokenizer_args.json"
# The layout (TP / DP size, ZeRO stage, precision) that wrote a checkpoint (training/layouts.py),
# and "trained": the weights its optimizer state covers (a run training others cannot resume it).
LAYOUT_FILE = "layout.json"
# Marks a checkpoint that holds weights only (tools/convert_from_hf.py): no optimizer, no run state.
WEIGHTS_ONLY = "weights_only"
# Marks a checkpoint saved with --no-save-optim: weights, schedule position and data position only.
NO_OPTIMIZER = "no_optimizer"
# In a retrofit's trained-only checkpoint: {"load": DIR, "tag": TAG} of the frozen weights.
BASE_FILE = "base_checkpoint.json"
# In the --save folder while a job saves there: the job's host, pid and start time (`lock.py`).
LOCK = "job.lock"
# A variant's schedule, where the run has one: the iteration it counts from and its settings
# (Focus's dense warm-up: {"start": 0, "dense_warmup_iters": 500}).
SCHEDULE_FILE = "schedule.json"


TAG = re.compile(r"iter_\d{7}")
# A save in progress, renamed to its tag once every rank has written it; named for the job
# writing it (`partial_tag`), so that no two jobs ever write into one.
PARTIAL = ".partial"
# A checkpoint of another layout converted for this run's (`universal.py`), removed once loaded.
UNIVERSAL = ".universal"
# What an interrupted save or layout conversion leaves: never complete, never `latest`.
DEBRIS = re.compile(
    rf"iter_\d{{7}}({re.escape(PARTIAL)}(\.[0-9a-f]+)?|{re.escape(UNIVERSAL)})"
    rf"|({re.escape(LATEST)}|{re.escape(MEGATRON_TRACKER)})(\.[^/]+)?\.tmp"
)


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(tag: str) -> int:
    return int(tag[len("iter_") :])


def partial_tag(tag: str, job: str) -> str:
    """The name job `job`'s save of `tag` is written under until it is complete."""
    return f"{tag}{PARTIAL}.{job[:12]}"


def tag_of_partial(name: str) -> str:
    return name.split(PARTIAL)[0]


def universal_dir(folder: str, tag: str) -> str:
    """The scratch folder in `folder` where checkpoint `tag` is converted to another layout."""
    return os.path.join(folder, tag + UNIVERSAL)


# --- DeepSpeed's model-states files: one per tensor-parallel rank --------------------------------


def model_file(checkpoint_dir: str, tp: int) -> str:
    """TP rank `tp`'s model-states file: its weights (ZeRO 0-2) and DeepSpeed's records."""
    return os.path.join(checkpoint_dir, f"mp_rank_{tp:02d}_model_states.pt")


def zero3_model_file(checkpoint_dir: str, tp: int) -> str:
    """Under ZeRO-3 data-parallel rank 0's records: every weight's name, the values partitioned
    over the optimizer files."""
    return os.path.join(checkpoint_dir, f"zero_pp_rank_0_mp_rank_{tp:02d}_model_states.pt")


def model_files(checkpoint_dir: str) -> list:
    """Every tensor-parallel rank's model-states file, in rank order (none under ZeRO-3)."""
    return sorted(glob.glob(os.path.join(checkpoint_dir, "mp_rank_*_model_states.pt")))


def is_model_states(name: str) -> bool:
    """A DeepSpeed model-states file, whichever rank or ZeRO stage wrote it."""
    return name.endswith("model_states.pt")


def is_zero3(checkpoint_dir: str) -> bool:
    return bool(glob.glob(os.path.join(checkpoint_dir, "zero_pp_rank_*_model_states.pt")))


def model_state_file(checkpoint_dir: str, tp: int, weights: bool) -> str:
    """TP rank `tp`'s model-states file, or, under ZeRO-3, the one holding its weights' names
    (refused when the `weights` themselves are wanted)."""
    shard, zero3 = model_file(checkpoint_dir, tp), zero3_model_file(checkpoint_dir, tp)
    if os.path.isfile(shard):
        return shard
    if not os.path.isfile(zero3):
        raise FileNotFoundError(f"{shard} is missing: not a complete checkpoint")
    if weights:
        raise ValueError(
            f"{checkpoint_dir} is a ZeRO-3 checkpoint, whose weights are "
            "partitioned: resume it as it is, or export it (tools/convert_to_hf.py) "
            "and import that to load its weights alone"
        )
    return zero3


def read_model_file(path: str, allow_unsafe: bool, mmap: bool = False) -> dict:
    """A model-states file, its weights under this version's names (see `current_name`)."""
    saved = load_file(path, allow_unsafe, mmap=mmap)
    saved["module"] = current_names(saved["module"])
    return saved


def write_atomically(path: str, text: str) -> None:
    """Every file of the checkpoint format is written so: whole under its name, or not at all (a
    failed write, e.g. on a full disk, removes its temporary file and raises naming it)."""
    tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"  # two writers of one file never share it
    try:
        with open(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):  # never written, or not ours to remove
            os.remove(tmp)
        raise OSError(e.errno, e.strerror, e.filename or tmp) from e


def write_model_args(checkpoint_dir: str, record: dict) -> None:
    write_atomically(
        os.path.join(checkpoint_dir, ARGS_FILE), json.dumps(record, indent=1, sort_keys=True)
    )


def saved_model_args(checkpoint_dir: str) -> dict:
    """A checkpoint's `ModelConfig.record`, the settings it predates at what it computed."""
    return ModelConfig.completed(read_json(checkpoint_dir, ARGS_FILE))


def write_schedule(checkpoint_dir: str, schedule: dict) -> None:
    write_atomically(
        os.path.join(checkpoint_dir, SCHEDULE_FILE), json.dumps(schedule, indent=1, sort_keys=True)
    )


def read_schedule(checkpoint_dir: str) -> dict:
    """A checkpoint's schedule record ({}: its run had none)."""
    path = os.path.join(checkpoint_dir, SCHEDULE_FILE)
    return read_json(checkpoint_dir, SCHEDULE_FILE) if os.path.isfile(path) else {}


def write_layout(checkpoint_dir: str, layout: dict) -> None:
    write_atomically(
        os.path.join(checkpoint_dir, LAYOUT_FILE), json.dumps(layout, indent=1, sort_keys=True)
    )


def read_layout(checkpoint_dir: str) -> Optional[dict]:
    """The layout that wrote a checkpoint (None: one saved before layouts were recorded; one
    saved before context parallelism was recorded had none)."""
    path = os.path.join(checkpoint_dir, LAYOUT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return {"context_parallel_size": 1, **json.load(f)}


_TOKENIZER_FILES = ("tokenizer_model", "vocab_file", "merge_file")


@dataclasses.dataclass(frozen=True)
class TokenizerRecord:
    """`tokenizer_args.json`: the tokenizer a model was trained with, for the HF export (not
    compared on load). `files` are absolute (a training run's) or relative to the checkpoint (an
    import's copies); `tokenizer_type` None: synthetic data, or an import without a tokenizer,
    whose HF config's bos/eos/pad ids are `special_token_ids`."""

    vocab_size: int
    tokenizer_type: Optional[str] = None
    files: dict = dataclasses.field(default_factory=dict)
    special_token_ids: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of_run(
        cls, vocab_size: int, tokenizer_type: Optional[str], flags: dict
    ) -> "TokenizerRecord":
        """A training run's: `flags` are `build_tokenizer`'s keyword arguments."""
        files = {key: os.path.abspath(flags[key]) for key in _TOKENIZER_FILES if flags.get(key)}
        return cls(vocab_size, tokenizer_type, files)

    def write(self, checkpoint_dir: str) -> None:
        record = {
            "tokenizer_type": self.tokenizer_type,
            **{key: self.files.get(key) for key in _TOKENIZER_FILES},
            "vocab_size": self.vocab_size,
        }
        if self.special_token_ids:
            record["special_token_ids"] = self.special_token_ids
        write_atomically(os.path.join(checkpoint_dir, TOKENIZER_FILE), json.dumps(record, indent=1))

    @classmethod
    def read(cls, checkpoint_dir: str) -> "TokenizerRecord":
        record = read_json(checkpoint_dir, TOKENIZER_FILE)
        return cls(
            record["vocab_size"],
            record.get("tokenizer_type"),
            {key: record[key] for key in _TOKENIZER_FILES if record.get(key)},
            record.get("special_token_ids", {}),
        )

    def paths(self, checkpoint_dir: str) -> dict:
        """The tokenizer's files where they are now (an import's, inside the checkpoint)."""
        return {key: os.path.join(checkpoint_dir, path) for key, path in self.files.items()}


def read_json(checkpoint_dir: str, name: str) -> dict:
    path = os.path.join(checkpoint_dir, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: not a megatron-focus checkpoint, or saved by an older version"
        )
    with open(path) as f:
        return json.load(f)


def check_compatible(ours: dict, saved: dict, checkpoint_dir: str, ignore: tuple = ()) -> None:
    """Refuse, before any weight is read, a checkpoint whose model has another shape: `saved`
    and `ours` are its and this run's model args (what is recorded only, not compared)."""
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r}, this run {ours.get(k)!r}"
        for k in sorted(set(saved) | set(ours))
        if saved.get(k) != ours.get(k) and k not in ignore + RECORDED_ONLY
    ]
    if diffs:
        raise ValueError(f"checkpoint {checkpoint_dir} is of another model: " + "; ".join(diffs))


def current_names(weights: dict) -> dict:
    return {current_name(name): value for name, value in weights.items()}


def latest_tag(load_dir: str, flag: str = "--ckpt-step") -> Optional[str]:
    """The newest complete checkpoint's tag, or None if the folder holds none yet. A `latest`
    that names no complete checkpoint is refused, with those the folder holds: `flag` (the
    command's) picks one."""
    pointer = os.path.join(load_dir, LATEST)
    if not os.path.isfile(pointer):
        return megatron_tag(load_dir)
    with open(pointer, "rb") as f:
        tag = f.read().decode(errors="replace").strip()
    complete = complete_tags(load_dir)
    if tag in complete:
        return tag
    if not tag:
        damage = "it is empty"
    elif TAG.fullmatch(tag):
        damage = f"it names {tag!r}, which is not in {load_dir}"
    else:
        damage = f"it holds {tag[:40]!r}, not a checkpoint's name"
    offer = (
        f"complete checkpoints there: {', '.join(complete)}; pick one with {flag} (e.g. "
        f"{iteration_of(complete[-1])})"
        if complete
        else f"{load_dir} holds no complete checkpoint"
    )
    raise ValueError(f"{pointer} is damaged: {damage}; {offer}")


def megatron_tag(load_dir: str) -> Optional[str]:
    """The tag Megatron-LM's `latest_checkpointed_iteration.txt` names (a folder Megatron-LM
    saved), or None if there is none."""
    path = os.path.join(load_dir, MEGATRON_TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        text = f.read().decode(errors="replace").strip()
    if not text.isdigit():
        raise ValueError(
            f"{path} holds {text[:40]!r}, not an iteration"
            + ("; point --load at a folder of iter_* checkpoints" if text == "release" else "")
        )
    tag = tag_for(int(text))
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise FileNotFoundError(f"{path} names {tag}, which is not in {load_dir}")
    return tag


def resume_tag(args: argparse.Namespace) -> Optional[str]:
    """The tag `--load` resumes from: `--ckpt-step`'s, else the latest (None: no checkpoint)."""
    if args.ckpt_step is None:
        return latest_tag(args.load) if os.path.isdir(args.load) else None
    tag = tag_for(args.ckpt_step)
    if not os.path.isdir(os.path.join(args.load, tag)):
        held = complete_tags(args.load) if os.path.isdir(args.load) else []
        raise FileNotFoundError(
            f"--ckpt-step {args.ckpt_step}: {args.load} holds no {tag} "
            f"(it holds: {', '.join(held) or 'no checkpoint'})"
        )
    return tag


def complete_tags(folder: str) -> list:
    return sorted(
        name
        for name in os.listdir(folder)
        if TAG.fullmatch(name) and os.path.isdir(os.path.join(folder, name))
    )


def base_checkpoint(checkpoint_dir: str) -> Optional[str]:
    """The checkpoint holding the frozen weights of a retrofit's trained-only checkpoint, or None
    for a complete checkpoint."""
    path = os.path.join(checkpoint_dir, BASE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        base = json.load(f)
    base_dir = os.path.join(base["load"], base["tag"])
    if not os.path.isdir(base_dir):
        raise FileNotFoundError(
            f"{checkpoint_dir} holds only a retrofit's routers; the checkpoint "
            f"with its other weights, {base_dir}, is gone"
        )
    return base_dir
