"""pretrain_gpt.py whose rank 1 dies while writing the checkpoint tagged $CRASH_AT_TAG.

Rank 1 first waits $CRASH_DELAY seconds (default 3), so that rank 0 has written all its own files:
the moment at which DeepSpeed on its own already pointed ``latest`` at the partial checkpoint.
"""
import os
import runpy
import sys
import time

import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_write_own_files = DeepSpeedEngine._save_checkpoint


def _dying_save(self, save_dir, tag, *args, **kwargs):
    if tag == os.environ["CRASH_AT_TAG"] and dist.get_rank() == 1:
        time.sleep(float(os.environ.get("CRASH_DELAY", "3")))
        os._exit(17)
    return _write_own_files(self, save_dir, tag, *args, **kwargs)


if __name__ == "__main__":
    DeepSpeedEngine._save_checkpoint = _dying_save
    sys.path.insert(0, REPO_ROOT)
    runpy.run_path(os.path.join(REPO_ROOT, "pretrain_gpt.py"), run_name="__main__")
