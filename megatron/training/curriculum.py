"""Sequence-length curriculum learning: the ds_config's ``curriculum_learning`` block, run by the trainer.

The block (Megatron-DeepSpeed's keys):

    "curriculum_learning": {"enabled": true, "curriculum_type": "seqlen",
                            "min_difficulty": 64, "max_difficulty": 2048,    (= --seq-length)
                            "schedule_type": "fixed_linear",
                            "schedule_config": {"total_curriculum_step": 36000, "difficulty_step": 8}}

The length L(t) of iteration t (1-based) comes from DeepSpeed's own CurriculumScheduler:

    fixed_linear   L(t) = min(max, floor((t / T) * (max - min) + min) rounded down to a multiple of d)
    fixed_root     the same with (t / T) ** (1 / root_degree)                      (T = total_curriculum_step,
                                                                                     d = difficulty_step)
    fixed_discrete L(t) = difficulty[i] for the first i with t <= max_step[i], else difficulty[-1]

(DeepSpeed 0.19 also raises the rounded length to the first multiple of d at or above min.) Once
L reaches max it stays there. Every micro batch of iteration t is cut to its first L(t) tokens
(tokens, labels, loss mask, position ids, and the attention mask to [:L, :L]); the consumed
tokens grow by global batch x L(t), which is what --train-tokens, --lr-warmup-tokens and
--lr-decay-tokens count. Evaluation always runs at the full --seq-length. The engine is told
whenever the length changes, evaluation included (a pipeline keeps the activation shapes of its
first send). engine/curriculum_scheduler.py runs the schedule.

DeepSpeed 0.19 refuses the legacy top-level block in its own config, so the trainer runs the
schedule and the block is removed from the config handed to ``deepspeed.initialize``
(config.DeepSpeedSettings). The current length is saved in every checkpoint; a resumed run
continues the schedule from it.
"""
import numbers
from dataclasses import dataclass

BLOCK = "curriculum_learning"
SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete")
LENGTH_MULTIPLE = 8  # Tensor Core friendly lengths, as Megatron-DeepSpeed's recipe asks


class CurriculumConfigError(ValueError):
    """A curriculum_learning block the trainer cannot run; the message names the key."""


@dataclass(frozen=True)
class CurriculumConfig:
    """A checked ``curriculum_learning`` block (seqlen type).

    Attributes:
        min_difficulty: the first sequence length (a multiple of 8).
        max_difficulty: the final length, --seq-length.
        schedule_type: fixed_linear, fixed_root or fixed_discrete.
        schedule_config: the block's schedule_config, as given.
    """

    min_difficulty: int
    max_difficulty: int
    schedule_type: str
    schedule_config: dict

    def scheduler_config(self) -> dict:
        """The dictionary DeepSpeed's CurriculumScheduler takes."""
        return {"curriculum_type": "seqlen", "min_difficulty": self.min_difficulty,
                "max_difficulty": self.max_difficulty, "schedule_type": self.schedule_type,
                "schedule_config": dict(self.schedule_config)}


def _positive_int(value, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CurriculumConfigError(f"{BLOCK}.{name} in {where} must be a positive integer, got {value!r}")
    return value


def _length(value, name: str, where: str, seq_length: int) -> int:
    _positive_int(value, name, where)
    if value % LENGTH_MULTIPLE or value > seq_length:
        raise CurriculumConfigError(f"{BLOCK}.{name} in {where} is {value}: every curriculum length must be a "
                                    f"multiple of {LENGTH_MULTIPLE} and at most --seq-length {seq_length}")
    return value


def _check_root_schedule(schedule: dict, where: str, root: bool) -> None:
    for key in ("total_curriculum_step", "difficulty_step"):
        _positive_int(schedule.get(key), f"schedule_config.{key}", where)
    if schedule["difficulty_step"] % LENGTH_MULTIPLE:
        raise CurriculumConfigError(f"{BLOCK}.schedule_config.difficulty_step in {where} is "
                                    f"{schedule['difficulty_step']}: it must be a multiple of {LENGTH_MULTIPLE}")
    degree = schedule.get("root_degree")
    if root and (isinstance(degree, bool) or not isinstance(degree, numbers.Real) or degree <= 0):
        raise CurriculumConfigError(f"{BLOCK}.schedule_config.root_degree in {where} must be a number > 0 with "
                                    f"fixed_root, got {degree!r}")


def _check_discrete_schedule(schedule: dict, where: str, seq_length: int) -> None:
    lengths, steps = schedule.get("difficulty"), schedule.get("max_step")
    if not isinstance(lengths, list) or not isinstance(steps, list) or len(lengths) != len(steps) + 1 or not steps:
        raise CurriculumConfigError(f"{BLOCK}.schedule_config in {where}: fixed_discrete needs a list 'difficulty' "
                                    f"of lengths and a list 'max_step' one shorter (the last length runs to the "
                                    f"end), got difficulty={lengths!r} max_step={steps!r}")
    for index, length in enumerate(lengths):
        _length(length, f"schedule_config.difficulty[{index}]", where, seq_length)
    for index, step in enumerate(steps):
        _positive_int(step, f"schedule_config.max_step[{index}]", where)
    if any(later <= earlier for earlier, later in zip(steps, steps[1:])):
        raise CurriculumConfigError(f"{BLOCK}.schedule_config.max_step in {where} must increase, got {steps}")
    if lengths[-1] != seq_length:
        raise CurriculumConfigError(f"{BLOCK}.schedule_config.difficulty in {where} must end at --seq-length "
                                    f"{seq_length} (training ends at full length), got {lengths}")


def curriculum_config(ds_config: dict, where: str, seq_length: int) -> CurriculumConfig | None:
    """The checked block of ``ds_config`` (``where`` names the file), or None when absent or disabled."""
    block = ds_config.get(BLOCK)
    if block is None:
        return None
    if not isinstance(block, dict):
        raise CurriculumConfigError(f"{BLOCK} in {where} must be a JSON object, got {block!r}")
    enabled = block.get("enabled", False)
    if not isinstance(enabled, bool):
        raise CurriculumConfigError(f"{BLOCK}.enabled in {where} must be true or false, got {enabled!r}")
    if not enabled:
        return None
    if block.get("curriculum_type") != "seqlen":
        raise CurriculumConfigError(f"{BLOCK}.curriculum_type in {where} is {block.get('curriculum_type')!r}: only "
                                    f"\"seqlen\" (sequence-length curriculum) is supported")
    minimum = _length(block.get("min_difficulty"), "min_difficulty", where, seq_length)
    maximum = _positive_int(block.get("max_difficulty"), "max_difficulty", where)
    if maximum != seq_length:
        raise CurriculumConfigError(f"{BLOCK}.max_difficulty in {where} is {maximum} but --seq-length is "
                                    f"{seq_length}: they must be equal (the curriculum ends at the full length)")
    schedule_type, schedule = block.get("schedule_type"), block.get("schedule_config")
    if schedule_type not in SCHEDULE_TYPES:
        raise CurriculumConfigError(f"{BLOCK}.schedule_type in {where} is {schedule_type!r}: use one of "
                                    f"{', '.join(SCHEDULE_TYPES)}")
    if not isinstance(schedule, dict):
        raise CurriculumConfigError(f"{BLOCK}.schedule_config in {where} must be a JSON object, got {schedule!r}")
    if schedule_type == "fixed_discrete":
        _check_discrete_schedule(schedule, where, seq_length)
    else:
        _check_root_schedule(schedule, where, root=schedule_type == "fixed_root")
    return CurriculumConfig(minimum, maximum, schedule_type, dict(schedule))
