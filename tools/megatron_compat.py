"""Write docs/megatron-compat.md: each Megatron-LM flag, and what this trainer does with it.

python tools/megatron_compat.py
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_focus.config.compat import compat_table, megatron_flags  # noqa: E402
from megatron_focus.config.flags import build_parser  # noqa: E402

DOC = os.path.join(ROOT, "docs", "megatron-compat.md")

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    with open(DOC, "w") as f:
        f.write(compat_table(megatron_flags(), build_parser()))
    print(f"wrote {DOC}")
