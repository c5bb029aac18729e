"""A checkpoint a run reads, opened once: which format its tag folder holds and the model it
records. Everything that reads a checkpoint (the resume plan, its check and load,
`--use-checkpoint-args`) takes the format from here rather than asking the folder again.

Two formats: this trainer's (DeepSpeed's files and `model_args.json`, `format.py`; with
`--ckpt-format torch_dist` a distributed checkpoint beside them), and Megatron-LM's distributed
checkpoint alone (`torch_dist.py`), whose model is read from Megatron-LM's args record
(`megatron_lm_args.py`) and whose optimizer state does not load here.
"""

import dataclasses
from typing import Optional

from megatron_focus.checkpoint import format as checkpoint_format
from megatron_focus.checkpoint import megatron_lm_args, torch_dist

DEEPSPEED, MEGATRON_LM = "DeepSpeed", "Megatron-LM"


@dataclasses.dataclass(frozen=True)
class SavedCheckpoint:
    """`path`: the tag folder; `format`: `DEEPSPEED` or `MEGATRON_LM`; `model_args`: its model,
    as this trainer records one; `seq_length`: the sequence length its run trained at, as its
    record holds it (None: a checkpoint saved before this trainer recorded it)."""

    path: str
    format: str
    model_args: dict
    seq_length: Optional[int] = None

    @classmethod
    def open(cls, path: str, allow_unsafe: bool) -> "SavedCheckpoint":
        """Decide the folder's format and read its model's record (Megatron-LM's args are read
        without running code unless `allow_unsafe`)."""
        if not torch_dist.is_megatron_lm(path):
            record = checkpoint_format.saved_model_args(path)
            return cls(path, DEEPSPEED, record, record.get("seq_length"))
        saved = torch_dist.common_state(path, allow_unsafe).get("args")
        if saved is None:
            raise ValueError(f"{path} records no args: its model is unknown")
        model_args = megatron_lm_args.model_args(saved)
        return cls(path, MEGATRON_LM, model_args, getattr(saved, "seq_length", None))

    @property
    def megatron_lm(self) -> bool:
        return self.format == MEGATRON_LM
