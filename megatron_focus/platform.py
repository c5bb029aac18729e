"""The one place where megatron-focus adapts Megatron-Core (0.16.1 to 0.19) to the machine it
runs on.

With a GPU, Megatron-Core runs as it is: NCCL, its CUDA RNG tracker, its CUDA causal mask, and
this module changes nothing. Without one, Megatron-Core still hard-codes CUDA in a few places that
a GPT model touches; `setup()` answers exactly those, with the CPU and gloo:

* `torch.cuda.current_device()`: Megatron creates buffers (sequence-parallel all-gathers, the
  global memory buffer, rotary frequencies) on "the current CUDA device". On the CPU it answers
  `cpu`, so they land on the CPU.
* The CUDA RNG tracker (Megatron's module globals `_CUDA_RNG_STATE_TRACKER` and its
  `_INITIALIZED` flag): Megatron forks a per-tensor-parallel-rank RNG stream around dropout in
  tensor-parallel regions. `CPURNGStatesTracker` keeps the same named streams, seeded the same
  way (`manual_seed`), but swaps the CPU generator, so dropout stays different across TP ranks and
  identical across data-parallel replicas, as on a GPU.
* `get_default_causal_mask`: built on the CPU.
* Context parallelism's rotary positions: selected without a pinned CUDA index.
* Saving a `torch_dist` checkpoint (`checkpoint/torch_dist.py`): Megatron copies the tensors to
  the host without blocking and then waits with `torch.cuda.synchronize()`; on the CPU the copy
  blocks and there is nothing to wait for.
* Activation recompute (`--recompute-*`) saves and restores "the CUDA RNG state" around each
  recomputed forward; on the CPU there is none beyond the CPU generator and the tracker's streams,
  which it saves and restores as well, so that state is empty.

One process-wide setting applies on every machine: dynamo's recompile limit, raised for
FlexAttention (`model/kernels/flex.py`, `RECOMPILE_LIMIT`). Every change is listed by
`planned_patches()` before it is made, so a test can check that with CUDA present that setting is
the only one.
`setup()` is idempotent.

The `mpu` adapter for DeepSpeed lives here too: DeepSpeed asks for the legacy names
`get_model_parallel_world_size/rank/group`, which Megatron-Core no longer has.
"""

import contextlib
import dataclasses
import functools
import os
import random
import types
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.models.common.embeddings import rotary_pos_embedding as mcore_rotary
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer import utils as mcore_transformer_utils


@dataclasses.dataclass(frozen=True)
class Platform:
    device: torch.device
    backend: str  # torch.distributed backend: "nccl" or "gloo"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One attribute that Megatron-Core reads and that the CPU must answer differently."""

    owner: object
    name: str
    replacement: object
    why: str

    def apply(self):
        setattr(self.owner, self.name, self.replacement)


class CPURNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """Megatron's named RNG streams, held as CPU generator states.

    Megatron's tracker stores and swaps *CUDA* generator states; on the CPU, dropout draws from the
    CPU generator, so that is the one to store and swap.
    """

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's selection of a context-parallel rank's rotary positions (its chunks r and
    2C - 1 - r), without its pinned CUDA index."""
    from megatron_focus.parallel.context_parallel import chunk_ids

    size = cp_group.size()
    chunks = pos_emb.unflatten(seq_dim, (2 * size, -1))
    mine = chunks.index_select(seq_dim, torch.tensor(chunk_ids(cp_group.rank(), size)))
    return mine.flatten(seq_dim, seq_dim + 1)


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args, **kwargs) -> None:
    return None


_preload_tensors = FileSystemWriterAsync.preload_tensors


def _preload_tensors_blocking(write_buckets, non_blocking=True):
    """Megatron's copy of a checkpoint's tensors to the host, done blocking: its non-blocking
    copy ends with `torch.cuda.synchronize()`."""
    return _preload_tensors(write_buckets, non_blocking=False)


def has_cuda() -> bool:
    """Whether this process has a GPU: the one place that asks (the other modules ask here)."""
    return torch.cuda.is_available()


# Dynamo compiles FlexAttention's frame again for each score_mod function, grad mode, and shape
# until shapes turn dynamic; past its recompile limit (8 by default) a call silently runs eager
# FlexAttention, which materialises the n x n scores. A Focus run that trains and validates in
# both modes uses several entries (soft gate with and without grad, the sparse path's range and
# band calls, each static then dynamic), the GPU tests more than 8.
RECOMPILE_LIMIT = 64


def _recompile_limit() -> Patch:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # < 2.6
    return Patch(
        config,
        name,
        max(getattr(config, name), RECOMPILE_LIMIT),
        "FlexAttention compiles a variant per score function, grad mode and shape",
    )


def planned_patches(cuda_available: Optional[bool] = None) -> List[Patch]:
    """What `setup()` would change on a machine with or without CUDA (with CUDA, only dynamo's
    recompile limit)."""
    if cuda_available is None:
        cuda_available = has_cuda()
    if cuda_available:
        return [_recompile_limit()]
    return [
        _recompile_limit(),
        Patch(
            torch.cuda,
            "current_device",
            _cpu_current_device,
            "Megatron allocates communication buffers and rotary tables on the current device",
        ),
        Patch(
            mcore_transformer_utils,
            "get_default_causal_mask",
            _cpu_causal_mask,
            "the default causal mask is hard-coded to device='cuda'",
        ),
        Patch(
            mcore_random,
            "_get_cuda_rng_state",
            _no_cuda_rng_state,
            "activation recompute saves the CUDA RNG state around each recomputed forward",
        ),
        Patch(mcore_random, "_set_cuda_rng_state", _set_no_cuda_rng_state, "... and restores it"),
        Patch(
            mcore_rotary,
            "get_pos_emb_on_this_cp_rank",
            _cpu_pos_emb_on_this_cp_rank,
            "a context-parallel rank's rotary positions are selected by a pinned CUDA index",
        ),
        Patch(
            FileSystemWriterAsync,
            "preload_tensors",
            staticmethod(_preload_tensors_blocking),
            "a torch_dist checkpoint's save waits for the GPU's copies with torch.cuda.synchronize",
        ),
        Patch(
            mcore_random,
            "_CUDA_RNG_STATE_TRACKER",
            CPURNGStatesTracker(),
            "Megatron's RNG tracker swaps CUDA generator states; dropout draws from the CPU's",
        ),
        Patch(
            mcore_random,
            "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
            True,
            "... and Megatron would replace it by its own on first use",
        ),
    ]


_PLATFORM: Optional[Platform] = None


def setup() -> Platform:
    """Detect the device and, without CUDA, apply `planned_patches()`. Safe to call repeatedly."""
    global _PLATFORM
    if _PLATFORM is None:
        cuda = has_cuda()
        for patch in planned_patches(cuda):
            patch.apply()
        if cuda:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            _PLATFORM = Platform(torch.device("cuda", local_rank), "nccl")
        else:
            _PLATFORM = Platform(torch.device("cpu"), "gloo")
    return _PLATFORM


def rng_state() -> dict:
    """Every random state of this process (Python's, NumPy's, torch's, Megatron's named streams
    and, with a GPU, CUDA's), as a checkpoint records it: tensors and plain values, no pickle."""
    name, keys, position, has_gauss, gauss = np.random.get_state()
    state = {
        "random": random.getstate(),
        # as a tensor: a numpy array would need pickle to load
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "tracker": mcore_random.get_cuda_rng_tracker().get_states(),
    }
    if has_cuda():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    name, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    mcore_random.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def manual_seed(seed: int) -> None:
    """Seed every generator the way Megatron-LM does, on either device.

    The default stream gets `seed` (identical on all TP ranks of a replica, so weights built on the
    CPU are identical whatever the TP size); Megatron's named streams get the seeds
    `model_parallel_cuda_manual_seed` gives them (the TP stream is offset by the TP rank).
    """
    platform = setup()
    torch.manual_seed(seed)
    if platform.is_cuda:
        mcore_random.model_parallel_cuda_manual_seed(seed)
        return
    tracker = mcore_random.get_cuda_rng_tracker()  # setup()'s CPURNGStatesTracker
    tracker.reset()
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if dist.is_initialized() else 0
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)


def _restart_store(timeout) -> dict:
    """Under torchrun, whose agent keeps one store for the job: this attempt's own keys in it
    (`init_process_group`'s store, rank and world size; {} elsewhere). A group that torchrun
    restarts (`--max-restarts`) otherwise finds its predecessor's keys there, of the same group
    names, and its process groups wait forever to connect to ranks that are gone."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"megatron_focus/attempt_{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def init_distributed(
    tensor_model_parallel_size: int = 1,
    timeout_minutes: float = 10,
    backend: Optional[str] = None,
    context_parallel_size: int = 1,
) -> Platform:
    """Start torch.distributed (one process needs no launcher) and Megatron's parallel groups,
    in Megatron's rank order (TP, CP, DP), every group's collectives waiting at most
    `timeout_minutes` for the other ranks (Megatron's --distributed-timeout-minutes)."""
    import datetime

    platform = setup()
    # A bare `python pretrain_gpt.py` is a world of one: give torch.distributed what a launcher
    # would, so the code path is the same with or without one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(
            backend=backend or platform.backend, timeout=timeout, **_restart_store(timeout)
        )
    world = dist.get_world_size()
    if world % (tensor_model_parallel_size * context_parallel_size):
        raise ValueError(
            f"world size {world} is not divisible by --tensor-model-parallel-size "
            f"{tensor_model_parallel_size} x --context-parallel-size {context_parallel_size}"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            context_parallel_size=context_parallel_size,
            create_gloo_process_groups=False,
            # Megatron's groups wait 30 minutes by default, whatever the world's timeout
            distributed_timeout_minutes=timeout_minutes,
        )
    return platform


@contextlib.contextmanager
def world_of_one():
    """Megatron's parallel state for the block, to build a model (on the meta device, say) in a
    process that has none, a tool's: a world of one, gone after it. A process with one keeps it."""
    if parallel_state.model_parallel_is_initialized():
        yield
        return
    started = not dist.is_initialized()
    init_distributed(1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if started:
            dist.destroy_process_group()


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_mpu() -> types.SimpleNamespace:
    """The `mpu` object DeepSpeed's engine queries, answered from Megatron-Core's parallel_state.

    DeepSpeed's data-parallel group is every rank holding the same weights, data-parallel x
    context-parallel (as Megatron's distributed optimizer's): gradients are averaged over it and
    ZeRO partitions over it. Each context-parallel rank's loss carries its share of the
    sequence's mean, times the CP size, so that the average is the data-parallel mean
    (`training/trainer.py`).
    """
    ps = parallel_state

    def with_cp(fn):
        return functools.partial(fn, with_context_parallel=True)

    fns: dict[str, Callable] = {
        "get_model_parallel_world_size": ps.get_tensor_model_parallel_world_size,
        "get_model_parallel_rank": ps.get_tensor_model_parallel_rank,
        "get_model_parallel_group": ps.get_tensor_model_parallel_group,
        "get_tensor_model_parallel_world_size": ps.get_tensor_model_parallel_world_size,
        "get_tensor_model_parallel_rank": ps.get_tensor_model_parallel_rank,
        "get_tensor_model_parallel_group": ps.get_tensor_model_parallel_group,
        "get_data_parallel_world_size": with_cp(ps.get_data_parallel_world_size),
        "get_data_parallel_rank": with_cp(ps.get_data_parallel_rank),
        "get_data_parallel_group": with_cp(ps.get_data_parallel_group),
        "get_pipeline_model_parallel_world_size": ps.get_pipeline_model_parallel_world_size,
        "get_pipeline_model_parallel_rank": ps.get_pipeline_model_parallel_rank,
        "get_pipeline_model_parallel_group": ps.get_pipeline_model_parallel_group,
    }
    return types.SimpleNamespace(**fns)
