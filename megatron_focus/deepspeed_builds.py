"""DeepSpeed's one-time C++ builds that training here never uses, skipped.

On the CPU, DeepSpeed's communication backend compiles its shared-memory op (`deepspeed_shm_comm`,
into `~/.cache/torch_extensions`) whenever `deepspeed.initialize` starts it, whatever the config:
about 50 s of silence on a fresh 2-core machine, and a run killed during the build leaves a lock
file on which every later run waits. Only DeepSpeed's inference all-reduce (`inference_all_reduce`,
its tensor-parallel inference) uses the op; training reduces through torch.distributed, so the
backend is started without it.
"""


def skip_unused_builds() -> None:
    """Start DeepSpeed's communication backend without building its shared-memory op."""
    import importlib

    # by module name: the package attribute `deepspeed.comm.torch` is torch itself
    backend = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None  # what it returns where the op cannot build
