"""How a run reads each format a checkpoint folder can hold. `checkpoint/saved.py` decides, once,
which one a folder holds; the resume plan's checks and its load ask that format's reader
(`reader`), and never branch on its name.

- `DeepSpeedFolder`: this trainer's checkpoints (either `--ckpt-format`): DeepSpeed's files and
  this trainer's records. A resume goes through DeepSpeed's engine, at this run's layout or, by
  the universal format, another (`layouts.py`).
- `MegatronLMFolder`: Megatron-LM's distributed checkpoint alone. Its weights are read at any
  tensor-parallel size; its optimizer state is not, so a resume is `--no-load-optim` (weights,
  iteration and data position).

Each reader answers the same questions: which model-args keys may differ from this run's
(`reshards`), which of this model's weights the folder lacks (`fresh`, refusing what it may not
lack), which weights its optimizer state covers (`trained`), what resuming from it refuses
(`check_resume`), and how weights and a whole run load from it.
"""

import os
from typing import TYPE_CHECKING, Callable, Optional

from megatron.core.parallel_state import get_tensor_model_parallel_rank

from megatron_focus import platform
from megatron_focus.checkpoint import format as checkpoint_format
from megatron_focus.checkpoint import torch_dist
from megatron_focus.checkpoint.format import NO_OPTIMIZER, check_compatible
from megatron_focus.checkpoint.safe_load import load_file
from megatron_focus.checkpoint.saved import DEEPSPEED, MEGATRON_LM, SavedCheckpoint
from megatron_focus.config.run_config import RunConfig
from megatron_focus.model.config import LAYOUT_KEYS
from megatron_focus.training import layouts
from megatron_focus.training.optimizer import in_unit, param_groups, schedule, steps_in

if TYPE_CHECKING:
    from megatron_focus.training.resume import ResumePlan


class DeepSpeedFolder:
    """This trainer's checkpoints."""

    reshards = ()  # a layout change is the plan's (`ResumePlan.layout`), not the format's

    def fresh(
        self,
        model,
        checkpoint: SavedCheckpoint,
        may_miss: Callable[[str], bool],
        allow_unsafe: bool,
        tp: Optional[int] = None,
    ) -> list:
        """The weights of `model` the checkpoint lacks, each excused by `may_miss(name)`;
        refused if it lacks another or holds one the model has not. Reads TP rank `tp`'s names
        (this rank's by default), not its values."""
        ours = model.state_dict().keys()
        saved = _checked_file(ours, checkpoint.path, may_miss, allow_unsafe, False, tp)["module"]
        return sorted(k for k in ours - saved.keys() if not k.endswith("_extra_state"))

    def load_weights(
        self, engine, checkpoint: SavedCheckpoint, may_miss: Callable[[str], bool], allow: bool
    ) -> None:
        """Model weights only (no optimizer, schedule or run state), checked before they are
        read. Read here rather than by DeepSpeed's `load_module_only`, which under ZeRO-2 copies
        frozen weights from the checkpoint's own list of frozen weights: empty when the
        checkpoint froze nothing, as a retrofit's base did."""
        ours = engine.module.state_dict().keys()
        saved = _checked_file(ours, checkpoint.path, may_miss, allow)
        engine.module.load_state_dict(saved["module"], strict=False)
        _refresh_master_weights(engine)

    def trained(self, checkpoint: SavedCheckpoint, allow_unsafe: bool) -> Optional[list]:
        """The names of the weights the checkpoint's optimizer state covers: its layout
        record's, or, in a checkpoint saved before they were recorded, DeepSpeed's ZeRO record
        (None: not known, at ZeRO stage 0)."""
        layout = checkpoint_format.read_layout(checkpoint.path) or {}
        if "trained" in layout:
            return layout["trained"]
        shapes = _run_state(checkpoint.path, allow_unsafe).get("param_shapes")
        return None if shapes is None else [name for group in shapes for name in group]

    def check_resume(self, plan: "ResumePlan", args: RunConfig, ours: dict) -> None:
        checkpoint, layout = plan.checkpoint.path, plan.layout
        if os.path.isfile(os.path.join(checkpoint, NO_OPTIMIZER)) and (
            layout or plan.load_optimizer
        ):
            raise ValueError(
                f"{checkpoint} was saved with --no-save-optim: it resumes with "
                "--no-load-optim (or --finetune), at its own layout"
            )
        if layout and (args.retrofit or plan.base is not None):
            raise ValueError(
                f"{checkpoint} is a retrofit's, written at another layout: resume it at its own ("
                + ", ".join(
                    f"{k} {v}" for k, v in layout.items() if k != "context_parallel_size" or v > 1
                )
                + ")"
            )
        if layout and not plan.load_optimizer:
            raise ValueError(
                f"{checkpoint} was written at another layout, which resumes with "
                "its optimizer state: drop --no-load-optim, or resume at its layout"
            )
        check_compatible(
            ours, plan.checkpoint.model_args, checkpoint, LAYOUT_KEYS if layout else ()
        )
        if plan.load_optimizer:  # the schedule comes from the checkpoint with the optimizer
            saved = _run_state(checkpoint, args.allow_unsafe_checkpoints)
            _check_schedule(saved["lr_scheduler"], args, checkpoint)

    def resume(self, engine, args: RunConfig, plan: "ResumePlan", padded_vocab_size: int) -> tuple:
        """Model, optimizer, schedule and run state: (iteration, consumed samples)."""
        checkpoint, layout = plan.checkpoint.path, plan.layout
        if layout:
            trained = [
                [name for name, _ in group] for _, group in param_groups(engine.module, args)
            ]
            client_state = layouts.load(
                engine, args, checkpoint, layout, trained, padded_vocab_size
            )
        else:
            load_dir, tag = os.path.split(checkpoint)
            path, client_state = engine.load_checkpoint(
                load_dir,
                tag=tag,
                load_module_strict=plan.base is None,
                load_optimizer_states=plan.load_optimizer,
                load_lr_scheduler_states=plan.load_optimizer,
            )
            if path is None:
                raise RuntimeError(f"DeepSpeed could not load {checkpoint}")
        if plan.load_rng and "rng" in client_state:
            platform.set_rng_state(client_state["rng"])
        else:
            # Random states that belong to a rank of another layout, or that were not saved or
            # are not wanted: start afresh, as Megatron seeds a run, from the seed and iteration.
            platform.manual_seed(args.seed + client_state["iteration"])
        return client_state["iteration"], client_state["consumed_samples"]


class MegatronLMFolder:
    """Megatron-LM's distributed checkpoint, read at any tensor-parallel size, each weight's
    shape checked as it loads."""

    reshards = LAYOUT_KEYS

    def fresh(self, model, checkpoint, may_miss, allow_unsafe: bool, tp=None) -> list:
        return torch_dist.fresh_weights(model, checkpoint.path, may_miss)

    def load_weights(self, engine, checkpoint, may_miss, allow: bool) -> None:
        torch_dist.load_model(engine.module, checkpoint.path, may_miss)
        _refresh_master_weights(engine)

    def trained(self, checkpoint: SavedCheckpoint, allow_unsafe: bool) -> Optional[list]:
        return None  # its optimizer state never loads here

    def check_resume(self, plan: "ResumePlan", args: RunConfig, ours: dict) -> None:
        if plan.load_optimizer:
            raise ValueError(
                f"{plan.checkpoint.path} is Megatron-LM's checkpoint, whose optimizer state does "
                "not load here: resume it with --no-load-optim (its weights, iteration and data "
                "position), or start from its weights with --finetune or "
                "--pretrained-checkpoint (or --retrofit to add Focus)"
            )
        check_compatible(ours, plan.checkpoint.model_args, plan.checkpoint.path, self.reshards)
        refuse_weights_only_under_zero3(args)  # its weights load as a fine-tune's do

    def resume(self, engine, args: RunConfig, plan: "ResumePlan", padded_vocab_size: int) -> tuple:
        """A Megatron-LM run continued (`--no-load-optim`): its weights, iteration and consumed
        samples; the optimizer and LR schedule start afresh, the random states from the seed."""
        self.load_weights(engine, plan.checkpoint, lambda name: False, False)
        state = torch_dist.common_state(plan.checkpoint.path, args.allow_unsafe_checkpoints)
        iteration = state["iteration"]
        consumed = getattr(state.get("args"), "consumed_train_samples", None)
        platform.manual_seed(args.seed + iteration)
        return iteration, iteration * args.global_batch_size if consumed is None else consumed


# One reader per format `SavedCheckpoint.open` decides.
READERS = {DEEPSPEED: DeepSpeedFolder(), MEGATRON_LM: MegatronLMFolder()}


def reader(checkpoint: SavedCheckpoint):
    return READERS[checkpoint.format]


def refuse_weights_only_under_zero3(args: RunConfig) -> None:
    if args.zero_stage == 3:
        raise ValueError(
            "loading weights only (an imported model, --finetune, --retrofit) is not "
            "supported under ZeRO stage 3: use --zero-stage 2 or lower for this run"
        )


def _refresh_master_weights(engine) -> None:
    if hasattr(engine.optimizer, "refresh_fp32_params"):  # ZeRO's and bf16's fp32 master copies
        engine.optimizer.refresh_fp32_params()


def _run_state(checkpoint_dir: str, allow_unsafe: bool) -> dict:
    """TP rank 0's DeepSpeed model-states file without its weights: the schedule, ZeRO's
    record of the weights it trains."""
    path = checkpoint_format.model_state_file(checkpoint_dir, tp=0, weights=False)
    return load_file(path, allow_unsafe, mmap=True)


def _checked_file(
    ours,
    checkpoint_dir: str,
    may_miss,
    allow_unsafe: bool,
    weights: bool = True,
    tp: Optional[int] = None,
) -> dict:
    """This rank's model file (or TP rank `tp`'s), refused unless its weights are this model's
    (`ours`: their names), bar `may_miss(name)`; `weights=False`: only their names are checked (a
    ZeRO-3 checkpoint holds no values there)."""
    tp = get_tensor_model_parallel_rank() if tp is None else tp
    saved_file = checkpoint_format.read_model_file(
        checkpoint_format.model_state_file(checkpoint_dir, tp, weights), allow_unsafe, mmap=True
    )
    saved = saved_file["module"]
    missing = [k for k in ours - saved.keys() if not may_miss(k) and not k.endswith("_extra_state")]
    unexpected = [k for k in saved.keys() - ours if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint_dir} does not fit this model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    return saved_file


# Megatron's OptimizerParamScheduler state: the flag that sets each value, "{unit}" the unit the
# run counts its schedule in (optimizer.steps_in).
SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-{unit}",
    "lr_decay_steps": "--lr-decay-{unit}",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
    "end_wd": "--weight-decay",
    "wd_incr_steps": "--train-{unit}",
}


def _shown(value):
    return f"{value:.6g}" if isinstance(value, float) else value


def _check_schedule(saved: dict, args: RunConfig, checkpoint_dir: str) -> None:
    """Refuse, as Megatron-LM does, a resume whose schedule flags differ from the checkpoint's,
    unless the user chose whose values win (which Megatron's scheduler then applies)."""
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    ours, unit = schedule(args), steps_in(args)
    saved = in_unit(saved, unit, args.global_batch_size)
    differ = sorted(
        {
            f"{flag.format(unit=unit)} {_shown(ours[key])} (checkpoint: {_shown(saved[key])})"
            for key, flag in SCHEDULE_FLAGS.items()
            if key in saved and saved[key] != ours[key]
        }
    )
    if differ:
        raise ValueError(
            f"{checkpoint_dir}: this run's schedule differs from the checkpoint's: "
            f"{', '.join(differ)}; pass --override-opt_param-scheduler to use this "
            "run's values, or --use-checkpoint-opt_param-scheduler to keep the "
            "checkpoint's"
        )
