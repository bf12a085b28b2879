"""pretrain_gpt.py in which rank $FAIL_RANK raises FileNotFoundError while the trainer opens
TensorBoard, after its data loaders (and their worker processes) exist. The other ranks go on and
meet the failed rank in their next collective.
"""
import os
import runpy
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    from megatron.training import dist_utils
    from megatron.training.tb_logger import TensorBoardLogger

    open_logger = TensorBoardLogger.__init__

    def failing_init(self, *args, **kwargs):
        if dist_utils.rank() == int(os.environ["FAIL_RANK"]):
            raise FileNotFoundError(2, "No such file or directory", "/injected/tensorboard")
        open_logger(self, *args, **kwargs)

    TensorBoardLogger.__init__ = failing_init
    runpy.run_path(os.path.join(REPO_ROOT, "pretrain_gpt.py"), run_name="__main__")
