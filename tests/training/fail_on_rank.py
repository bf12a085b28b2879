"""pretrain_gpt.py in which rank $FAIL_RANK raises an error at a point of the run set up by $FAIL_AT:

    reporting    FileNotFoundError while the trainer opens TensorBoard (after the data loaders exist)
    iteration    RuntimeError when training iteration $FAIL_ITERATION starts

The other ranks go on and meet the failed rank in their next collective.
"""
import os
import runpy
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fail_here() -> bool:
    from megatron.training import dist_utils

    return dist_utils.rank() == int(os.environ["FAIL_RANK"])


def fail_while_opening_tensorboard():
    from megatron.training.tb_logger import TensorBoardLogger

    open_logger = TensorBoardLogger.__init__

    def failing_init(self, *args, **kwargs):
        if fail_here():
            raise FileNotFoundError(2, "No such file or directory", "/injected/tensorboard")
        open_logger(self, *args, **kwargs)

    TensorBoardLogger.__init__ = failing_init


def fail_at_iteration(iteration: int):
    from megatron.training.training import Trainer

    step = Trainer.train_step

    def failing_step(self):
        if fail_here() and self.progress.iteration + 1 == iteration:
            raise RuntimeError(f"injected failure at iteration {iteration}")
        return step(self)

    Trainer.train_step = failing_step


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    sys.argv = sys.argv[:1] + sys.argv[1:]
    if os.environ["FAIL_AT"] == "reporting":
        fail_while_opening_tensorboard()
    else:
        fail_at_iteration(int(os.environ["FAIL_ITERATION"]))
    runpy.run_path(os.path.join(REPO_ROOT, "pretrain_gpt.py"), run_name="__main__")
