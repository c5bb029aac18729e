"""Checkpoints on disk, apart from how a run writes them: the format (`format.py`), the
checksums a save records and a load checks (`integrity.py`), reading files that may hold
pickled code (`safe_load.py`), and a checkpoint's native model built from its record
(`native.py`; the tensor-parallel split, `tp_layout.py`). `training/`, `hf/` and `evaluation/`
go through it."""
