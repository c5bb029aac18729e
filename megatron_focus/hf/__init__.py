"""Hugging Face interop: export checkpoints to HF folders, import HF models as checkpoints.

    export_to_hf(load_dir, save_dir)      # tools/convert_to_hf.py
    import_from_hf(hf_dir, save_dir, tp)  # tools/convert_from_hf.py
    native_logits(load_dir, tokens)       # what the native model of a checkpoint computes

`families.py` holds the mapping table (Megatron name -> HF names) and what each HF class can
represent exactly; `checkpoint/tp_layout.py` how tensor parallelism splits the tensors, and
`checkpoint/native.py` how a checkpoint's native model is read and built.
"""

from megatron_focus.checkpoint.native import native_logits
from megatron_focus.hf.export import export_to_hf
from megatron_focus.hf.importer import import_from_hf

__all__ = ["export_to_hf", "import_from_hf", "native_logits"]
