"""Pretrain a GPT model with standard, XSA or Focus attention.

    python pretrain_gpt.py                       # tiny model, embedded corpus, CPU or GPU
    deepspeed --hostfile hostfile pretrain_gpt.py --attention focus+xsa ... --deepspeed_config ...

Flags follow Megatron-LM's pretrain_gpt.py; `python pretrain_gpt.py --help` lists them.
"""

import os
import sys
import time

from megatron_focus import cli
from megatron_focus.config.validation import check_paths
from megatron_focus.data import reads_data_files
from megatron_focus.training.arguments import parse_args


def main(argv=None) -> None:
    config = parse_args(argv)
    if not reads_data_files(config) and config.tensorboard_dir is None and config.save is None:
        # The zero-download default run keeps its curves and checkpoints in one folder.
        run = os.path.join("runs", f"{config.attention}-{time.strftime('%Y%m%d-%H%M%S')}")
        save = os.path.join(run, "checkpoints")
        config = config.replace(
            tensorboard_dir=os.path.join(run, "tensorboard"),
            save=save,
            load=config.load or save,  # resumable with the same command
        )
    check_paths(config)
    from megatron_focus.training.trainer import pretrain  # after parsing: --help stays fast

    pretrain(config)


if __name__ == "__main__":
    cli.run(
        main,
        sys.argv[1:],
        interrupted="interrupted (Ctrl-C): nothing saved since the last checkpoint; with "
        "--exit-signal-handler, Ctrl-C saves and then stops",
    )
