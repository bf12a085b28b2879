"""pretrain_gpt.py whose disk fills while it saves the checkpoint tagged $FULL_AT_TAG.

On the ranks listed in $FULL_ON_RANKS (comma-separated), files written under that tag directory
hold $FULL_CAPACITY bytes in all; the write that would pass it fails with ENOSPC, as on a full disk
(tests/disk_faults.py injects it: the tests run as root, and no real disk is filled).
"""
import os
import runpy
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    from tests.disk_faults import full_disk

    arguments = sys.argv[1:]
    tag_directory = os.path.join(arguments[arguments.index("--save") + 1], os.environ["FULL_AT_TAG"])
    if os.environ.get("RANK", "0") in os.environ["FULL_ON_RANKS"].split(","):
        full_disk(pytest.MonkeyPatch(), tag_directory, capacity=int(os.environ["FULL_CAPACITY"]))
    runpy.run_path(os.path.join(REPO_ROOT, "pretrain_gpt.py"), run_name="__main__")
