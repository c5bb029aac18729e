"""The trainer's checkpoints go through `training/checkpointing.py`'s `CheckpointStart` (before
any compute) and `CheckpointManager` (`load()`, then `save` after every step): a run resumed from
this trainer's folder and one continued from Megatron-LM's make the same calls, and the folder's
format is decided once, when the plan opens it."""

import os

import megatron_lm_record
from distributed import run_distributed
from tiny_runs import TINY, train

VOCAB = 200  # NullTokenizer: 201 ids with the end of document
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]


def _write_megatron_lm(folder: str) -> None:
    """Megatron-LM's checkpoint of TINY's model at iteration 7."""
    from megatron_focus import platform

    platform.init_distributed(1)
    record = megatron_lm_record.record(TINY + MOCK + ["--max-position-embeddings", "32"], VOCAB + 1)
    platform.manual_seed(8)
    megatron_lm_record.save(megatron_lm_record.gpt_model(record).eval(), folder, record)


def _resumed(argv: list) -> dict:
    """pretrain(argv), recording the trainer's calls to its CheckpointStart and its
    CheckpointManager, the format its plan names, and every folder whose format was asked."""
    from megatron_focus.checkpoint import torch_dist
    from megatron_focus.training import trainer
    from megatron_focus.training.arguments import parse_args

    calls, saved, asked, made = [], [], [], []
    is_megatron_lm = torch_dist.is_megatron_lm
    torch_dist.is_megatron_lm = lambda folder: asked.append(folder) or is_megatron_lm(folder)

    def recorded(cls, names):
        class Recorded(cls):
            def __init__(self, *args, **kwargs):
                made.append(self)
                super().__init__(*args, **kwargs)

        for name in names:

            def call(self, *args, _name=name, **kwargs):
                result = getattr(cls, _name)(self, *args, **kwargs)
                calls.append(_name)
                if _name == "save" and result is not None:
                    saved.append(result)
                return result

            setattr(Recorded, name, call)
        return Recorded

    trainer.CheckpointStart = recorded(trainer.CheckpointStart, ("check", "engine_config"))
    trainer.CheckpointManager = recorded(trainer.CheckpointManager, ("load", "save"))
    history = trainer.pretrain(parse_args(argv))
    plan = made[0].plan
    return {
        "calls": calls,
        "saved": saved,
        "format": plan.checkpoint.format,
        "path": plan.checkpoint.path,
        "asked": asked,
        "losses": len(history["losses"]),
    }


def test_both_formats_resume_through_the_same_calls_their_format_decided_once(tmp_path):
    from megatron_focus.checkpoint.saved import DEEPSPEED, MEGATRON_LM

    flags = TINY + MOCK + ["--data-cache-path", str(tmp_path / "cache")]
    ours, megatron = str(tmp_path / "ours"), str(tmp_path / "megatron")
    train(1, flags + ["--train-iters", "4", "--exit-interval", "2", "--save", ours])
    run_distributed(_write_megatron_lm, 1, megatron)

    resumed = run_distributed(
        _resumed, 1, flags + ["--train-iters", "4", "--load", ours, "--save", ours]
    )
    run = str(tmp_path / "run")
    continued = run_distributed(
        _resumed,
        1,
        flags + ["--train-iters", "9", "--load", megatron, "--save", run, "--no-load-optim"],
    )
    # before the data, the engine; then the manager, called at the start and after every step
    calls = ["check", "engine_config", "load", "save", "save"]
    assert resumed["calls"] == continued["calls"] == calls
    # the manager decides which steps save: the last one alone, as no --save-interval is given
    assert resumed["saved"] == [os.path.join(ours, "iter_0000004")]
    assert continued["saved"] == [os.path.join(run, "iter_0000009")]
    assert (resumed["format"], continued["format"]) == (DEEPSPEED, MEGATRON_LM)
    # the one folder each run reads, asked once, by the plan
    assert resumed["asked"] == [resumed["path"]] == [os.path.join(ours, "iter_0000002")]
    assert continued["asked"] == [continued["path"]] == [os.path.join(megatron, "iter_0000007")]
    assert resumed["losses"] == continued["losses"] == 2  # iterations 3-4; 8-9


def test_the_readers_answer_for_every_format_a_folder_can_hold():
    """Each format `SavedCheckpoint.open` can decide has a reader, and each reader answers the
    same questions (the trainer never branches on a format's name)."""
    import inspect

    from megatron_focus.checkpoint import saved
    from megatron_focus.training.saved_formats import READERS

    formats = {saved.DEEPSPEED, saved.MEGATRON_LM}
    assert set(READERS) == formats
    asked = ("fresh", "load_weights", "trained", "check_resume", "resume")
    for reader in READERS.values():
        assert isinstance(reader.reshards, tuple)
        for name in asked:
            method = getattr(type(reader), name)
            first = next(iter(READERS.values()))
            theirs = inspect.signature(getattr(type(first), name)).parameters
            assert list(inspect.signature(method).parameters) == list(theirs), (reader, name)


def test_the_format_flag_offers_the_registered_formats():
    """--ckpt-format's choices are the formats a save knows how to write, and no others."""
    from megatron_focus.config.flags import build_parser
    from megatron_focus.training.checkpointing import FORMATS

    flag = next(a for a in build_parser()._actions if a.dest == "ckpt_format")
    assert set(flag.choices) == set(FORMATS)
