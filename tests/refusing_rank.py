"""A command whose rank `REFUSING_RANK` alone refuses, the others working on (a path that one
node lacks, say): its line must still be told, and the job end, under a launcher."""

import os
import time

from megatron_focus import cli


def main():
    if os.environ.get("RANK") == os.environ["REFUSING_RANK"]:
        raise ValueError(f"rank {os.environ['RANK']} alone refuses")
    time.sleep(120)


if __name__ == "__main__":
    cli.run(main)
