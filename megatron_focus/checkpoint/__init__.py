"""Checkpoints on disk, apart from how a run writes them: the format (`format.py`), the
checksums a save records and a load checks (`integrity.py`), and reading files that may hold
pickled code (`safe_load.py`). `training/` and `hf/` both go through it."""
