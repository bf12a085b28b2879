"""The length of each training iteration, from DeepSpeed's CurriculumScheduler (curriculum.py states the schedule)."""
from deepspeed.runtime.data_pipeline.constants import CURRICULUM_LEARNING_CURRENT_DIFFICULTY
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

from megatron.training.curriculum import CurriculumConfig


class SequenceLengthCurriculum:
    """The length of each training iteration, through DeepSpeed's CurriculumScheduler.

    ``length_for(iteration)`` is called once per iteration, in order, before its batches are read;
    ``current`` is the last length handed out (saved in checkpoints), ``restore`` puts it back.
    """

    def __init__(self, config: CurriculumConfig):
        self.scheduler = CurriculumScheduler(config.scheduler_config())
        self._current_key = CURRICULUM_LEARNING_CURRENT_DIFFICULTY

    @property
    def current(self) -> int:
        return self.scheduler.state[self._current_key]

    def restore(self, length: int) -> None:
        self.scheduler.state[self._current_key] = length

    def length_for(self, iteration: int) -> int:
        return self.scheduler.update_difficulty(iteration)
