"""pretrain_gpt.py in which tensor-parallel rank 1 nudges its copy of the first layer's input layer norm
weight by $DRIFT just before iteration $DRIFT_AT_ITERATION: a TP-duplicated parameter drifting apart."""
import os
import runpy
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    import torch

    from megatron.training.training import Trainer

    train_step = Trainer.train_step

    def drifting_step(self):
        if self.progress.iteration + 1 == int(os.environ["DRIFT_AT_ITERATION"]) and self.groups.tp_rank == 1:
            with torch.no_grad():
                parameters = dict(self.engine.module.named_parameters())
                parameters["3.input_layernorm.weight"].add_(float(os.environ["DRIFT"]))
        return train_step(self)

    Trainer.train_step = drifting_step
    runpy.run_path(os.path.join(REPO_ROOT, "pretrain_gpt.py"), run_name="__main__")
