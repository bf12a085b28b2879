"""pretrain_gpt.py whose loss is NaN in the iterations listed in $NAN_ITERATIONS ("3" or "3,4,5").

Every call of the pipeline's loss function is one micro batch; with $MICRO_BATCHES micro batches per
iteration (and no evaluation), call c belongs to iteration c // $MICRO_BATCHES + 1. The loss of those
calls is multiplied by NaN, so their backward makes every gradient NaN.
"""
import os
import runpy
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    from megatron.training.engine.pipeline_module import LanguageModelLoss

    nan_iterations = {int(value) for value in os.environ["NAN_ITERATIONS"].split(",")}
    micro_batches = int(os.environ["MICRO_BATCHES"])
    compute_loss = LanguageModelLoss.__call__
    calls = []

    def poisoned_loss(self, logits, labels_and_mask):
        iteration = len(calls) // micro_batches + 1
        calls.append(iteration)
        loss = compute_loss(self, logits, labels_and_mask)
        return loss * float("nan") if iteration in nan_iterations else loss

    LanguageModelLoss.__call__ = poisoned_loss
    runpy.run_path(os.path.join(REPO_ROOT, "pretrain_gpt.py"), run_name="__main__")
