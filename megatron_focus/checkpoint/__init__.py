"""Checkpoints on disk, apart from how a run writes them: the format (`format.py`), the
checksums a save records and a load checks (`integrity.py`), reading files that may hold
pickled code (`safe_load.py`), a checkpoint's native model built from its record (`native.py`;
the tensor-parallel split, `tp_layout.py`), Megatron-Core's distributed format (`torch_dist.py`),
a checkpoint opened once, its format decided (`saved.py`), and DeepSpeed's universal format, to
which a checkpoint of another layout is converted (`universal.py`), and the lock that keeps a
`--save` folder to one job (`lock.py`). `training/`, `hf/` and
`evaluation/` go through it."""
