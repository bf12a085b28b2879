"""pretrain_gpt.py with one rank killed in the middle of a save.

$CRASH_AT_TAG: rank 1 dies while writing the checkpoint of that tag. It first waits $CRASH_DELAY
seconds (default 3), so that rank 0 has written all its own files: the moment at which DeepSpeed on
its own already pointed ``latest`` at the partial checkpoint.

$CRASH_AT_MARKER: rank 0 dies while writing the ``saving.incomplete`` marker of that tag, the first
file of a save, leaving the temporary file a kill inside that write leaves.
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
    if tag == os.environ.get("CRASH_AT_TAG") and dist.get_rank() == 1:
        time.sleep(float(os.environ.get("CRASH_DELAY", "3")))
        os._exit(17)
    return _write_own_files(self, save_dir, tag, *args, **kwargs)


def _dying_pointer(write_pointer):
    def write(path, text):
        crash_tag, tag = os.environ.get("CRASH_AT_MARKER"), os.path.basename(os.path.dirname(path))
        if crash_tag and os.path.basename(path) == "saving.incomplete" and crash_tag in tag:
            with open(f"{path}.tmp{os.getpid()}", "w"):
                os._exit(17)
        return write_pointer(path, text)
    return write


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    from megatron.training import checkpointing

    DeepSpeedEngine._save_checkpoint = _dying_save
    checkpointing.write_pointer = _dying_pointer(checkpointing.write_pointer)
    runpy.run_path(os.path.join(REPO_ROOT, "pretrain_gpt.py"), run_name="__main__")
