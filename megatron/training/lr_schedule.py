"""Megatron-DeepSpeed's learning-rate schedule (``AnnealingLR``): linear warmup, then constant, linear,
cosine or inverse-square-root decay, with progress counted in samples (and optionally tokens).

Units. The schedule's "steps" are **samples**: the trainer calls ``step(increment=global_batch_size)``
after every applied optimizer step, so a schedule given in iterations is converted by the caller
(``warmup_steps = --lr-warmup-iters * GBS``, ``decay_steps = --lr-decay-iters * GBS``). Tokens are the
consumed training tokens, passed as ``token_num`` (or read from ``token_provider``).

With n = num_steps (samples), k = num_tokens, W = warmup_steps, D = decay_steps, lr_max = max_lr,
lr_min = min_lr:

- warmup by samples (W > 0, n <= W):       lr = lr_max * n / W
- warmup by tokens (``warmup_tokens`` = Wt given, k <= Wt): lr = lr_max * k / Wt
- constant:                                lr = lr_max
- linear / cosine, step-based decay:       lr = lr_min                       if n > D
                                           r = (n - W) / (D - W)             otherwise
- linear / cosine, token-based decay (``decay_tokens`` = Dt given):
                                           lr = lr_min                       if k > Dt
                                           r = (k - Wt) / (Dt - Wt)          otherwise
  linear: lr = lr_min + (1 - r) (lr_max - lr_min);  cosine: lr = lr_min + (cos(pi r) + 1) / 2 (lr_max - lr_min)
- inverse-square-root:                     lr = max(lr_min, lr_max * sqrt(W) / sqrt(max(n, W)))
  (in tokens with Wt and k when ``decay_tokens`` is given). It needs a warmup, continues past D
  (D and Dt only choose the unit) and equals lr_max where the warmup ends.

After the decay the rate stays at lr_min (BigScience decayed over 200M of 220M samples and trained
on at the floor).

Where the token-based decay starts (Wt). With a warmup in samples, Wt is the token count at the
step that ends the warmup (the first step with n >= W; Megatron-DeepSpeed records it only when n == W
exactly, so with a warmup that is not a multiple of the global batch it never did and decayed from 0
tokens),
and it is 0 without a warmup. With a warmup in tokens (``warmup_tokens``), the warmup ends when the
consumed tokens pass ``warmup_tokens``; the token-based decay starts there, and a step-based decay
is measured from sample 0 (W = 0), as in Microsoft's Megatron-DeepSpeed ``--lr-warmup-tokens``.

Token counts lag. Megatron-DeepSpeed passes the tokens consumed *before* the current iteration, because the
counter is advanced after the train step; a trainer that calls ``step`` before advancing its
counters (or lets DeepSpeed call it through ``token_provider``) reproduces that lag.

Driving the schedule from DeepSpeed (0.19.8). ``engine._take_model_step`` calls
``lr_scheduler.step(**(lr_kwargs or {}))`` after every applied optimizer step and skips it on fp16
overflow, as Megatron-DeepSpeed's schedule expects. Give the scheduler an ``increment_provider`` (the current
global batch size, e.g. ``calculator.get_current_global_batch_size``) and, for token-based
schedules, a ``token_provider`` (consumed training tokens), then pass it as
``deepspeed.initialize(..., lr_scheduler=scheduler)``: the engine steps it with no arguments, and
saves/loads its state under ``lr_scheduler`` in ``mp_rank_*`` like Megatron-DeepSpeed's checkpoints. Without
an ``increment_provider`` a bare ``step()`` raises ``TypeError``, on which DeepSpeed falls back to
``step(engine.train_batch_size())`` (its "Megatron 2.0" path): also correct, since the trainer sets
the engine's batch size during rampup. The alternative, stepping the schedule in the trainer with
``lr_scheduler=None`` given to DeepSpeed, needs ``engine.was_step_applied()`` to skip overflow steps
and a client-state entry to checkpoint the schedule.

Resuming (``load_state_dict``). The checkpoint's progress (samples, tokens, where the token decay
starts) always continues. Its settings (peak and minimum rate, warmup, decay length and style) must
equal the configured ones, unless ``source`` says otherwise, as Megatron-DeepSpeed's flags do:
"override" (--override-lr-scheduler) keeps the configured values, "checkpoint"
(--use-checkpoint-lr-scheduler) takes the checkpoint's; each value that differs is reported.
"""
import math
from collections.abc import Callable

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
WARMUP_FLAGS = "--lr-warmup-samples / --lr-warmup-iters / --lr-warmup-fraction"
DECAY_FLAGS = "--lr-decay-samples / --lr-decay-iters (default --train-samples / --train-iters)"
OVERRIDE_NOTE = ("resume with the checkpoint's values, or add --override-lr-scheduler (keep the configured ones) or "
                 "--use-checkpoint-lr-scheduler (take the checkpoint's)")
SOURCES = ("check", "override", "checkpoint")

# Checked on load: state key -> (description, flags that set it).
_CHECKED_FIELDS = {
    "max_lr": ("learning rate", "--lr"),
    "min_lr": ("minimum learning rate", "--min-lr"),
    "warmup_steps": ("warmup (samples)", WARMUP_FLAGS),
    "decay_steps": ("decay length (samples)", DECAY_FLAGS),
    "decay_style": ("decay style", "--lr-decay-style"),
}
# Megatron-DeepSpeed's older key names, accepted on load.
_LEGACY_KEYS = {"max_lr": "start_lr", "warmup_steps": "warmup_iter", "decay_steps": "end_iter",
                "num_steps": "num_iters"}


class LRScheduleError(ValueError):
    """A learning-rate schedule that cannot work, or a checkpoint whose schedule differs from the flags."""


class AnnealingLR:
    """Warmup then decay of the learning rate of every parameter group, counted in samples.

    See the module docstring for the formulas, the units and how DeepSpeed drives it. Each call to
    ``step`` advances the sample counter, records the token count, and writes the new rate into
    ``optimizer.param_groups[*]['lr']``. The constructor sets the rate for step 0.
    """

    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: float,
                 decay_style: str, warmup_tokens: int | None = None, decay_tokens: int | None = None,
                 increment_provider: Callable[[], int] | None = None,
                 token_provider: Callable[[], int] | None = None, source: str = "check",
                 report: Callable[[str], None] = print):
        if source not in SOURCES:
            raise LRScheduleError(f"the schedule's source on resume must be one of {SOURCES}, got {source!r}")
        self.source, self.report = source, report
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.decay_style = decay_style
        self.decay_tokens = decay_tokens
        self.warmup_by_tokens = warmup_tokens is not None
        self.increment_provider = increment_provider
        self.token_provider = token_provider
        self._validate(warmup_tokens)
        self.num_steps = 0
        self.num_tokens = 0
        # Where the token-based decay starts: configured, or recorded when the sample warmup ends.
        self.warmup_tokens = warmup_tokens if self.warmup_by_tokens else 0
        self._apply_lr()

    def _validate(self, warmup_tokens):
        if self.decay_style not in DECAY_STYLES:
            raise LRScheduleError(f"--lr-decay-style must be one of {DECAY_STYLES}, got {self.decay_style!r}")
        if self.min_lr < 0.0:
            raise LRScheduleError(f"--min-lr must be >= 0, got {self.min_lr}")
        if self.max_lr < self.min_lr:
            raise LRScheduleError(f"--lr ({self.max_lr}) must be >= --min-lr ({self.min_lr})")
        if self.decay_steps <= 0:
            raise LRScheduleError(f"the LR decay length ({DECAY_FLAGS}) must be > 0, got {self.decay_steps} samples")
        if self.warmup_steps < 0 or self.warmup_steps >= self.decay_steps:
            raise LRScheduleError(f"the LR warmup ({WARMUP_FLAGS}: {self.warmup_steps} samples) must be >= 0 and "
                                  f"shorter than the decay ({DECAY_FLAGS}: {self.decay_steps} samples)")
        if self.decay_tokens is not None and self.decay_tokens <= 0:
            raise LRScheduleError(f"--lr-decay-tokens must be > 0, got {self.decay_tokens}")
        if self.warmup_by_tokens:
            if self.warmup_steps > 0:
                raise LRScheduleError(f"give the LR warmup in one unit: --lr-warmup-tokens ({warmup_tokens}) or "
                                      f"{WARMUP_FLAGS} ({self.warmup_steps} samples), not both")
            if warmup_tokens <= 0:
                raise LRScheduleError(f"--lr-warmup-tokens must be > 0, got {warmup_tokens}")
            if self.decay_tokens is not None and warmup_tokens >= self.decay_tokens:
                raise LRScheduleError(f"--lr-warmup-tokens ({warmup_tokens}) must be smaller than "
                                      f"--lr-decay-tokens ({self.decay_tokens})")
        if self.decay_style == "inverse-square-root":
            self._validate_inverse_square_root()

    def _validate_inverse_square_root(self):
        if self.decay_tokens is None and self.warmup_by_tokens:
            raise LRScheduleError("--lr-decay-style inverse-square-root with a token warmup (--lr-warmup-tokens) "
                                  "decays in tokens: also give --lr-decay-tokens")
        if self.decay_tokens is None and self.warmup_steps <= 0:
            raise LRScheduleError(f"--lr-decay-style inverse-square-root needs a warmup ({WARMUP_FLAGS}): "
                                  "lr = lr_max * sqrt(warmup) / sqrt(samples)")
        if self.decay_tokens is not None and not self.warmup_by_tokens and self.warmup_steps <= 0:
            raise LRScheduleError("--lr-decay-style inverse-square-root with --lr-decay-tokens needs a warmup "
                                  f"(--lr-warmup-tokens or {WARMUP_FLAGS})")

    # ---------------------------------------------------------------- the rate

    def _in_warmup(self) -> bool:
        if self.warmup_by_tokens:
            return self.num_tokens <= self.warmup_tokens
        return self.warmup_steps > 0 and self.num_steps <= self.warmup_steps

    def get_lr(self) -> float:
        """The learning rate at the current (num_steps, num_tokens); see the module docstring."""
        if self._in_warmup():
            if self.warmup_by_tokens:
                return self.max_lr * float(self.num_tokens) / float(self.warmup_tokens)
            return self.max_lr * float(self.num_steps) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if self.decay_style == "inverse-square-root":
            return self._inverse_square_root_lr()
        if self.decay_tokens is None:
            if self.num_steps > self.decay_steps:
                return self.min_lr
            warmup = 0 if self.warmup_by_tokens else self.warmup_steps
            ratio = float(self.num_steps - warmup) / float(self.decay_steps - warmup)
        else:
            if self.num_tokens > self.decay_tokens:
                return self.min_lr
            ratio = float(self.num_tokens - self.warmup_tokens) / float(self.decay_tokens - self.warmup_tokens)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _inverse_square_root_lr(self) -> float:
        if self.decay_tokens is None:
            reference, progress = self.warmup_steps, self.num_steps
        else:
            reference, progress = self.warmup_tokens, self.num_tokens
        if reference <= 0:  # a sample warmup ended with no tokens consumed yet
            return self.max_lr
        return max(self.min_lr, self.max_lr * math.sqrt(reference) / math.sqrt(max(progress, reference)))

    def _apply_lr(self):
        new_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = new_lr

    # ---------------------------------------------------------------- stepping

    def step(self, increment: int | None = None, token_num: int | None = None):
        """Advance by ``increment`` samples, record ``token_num`` consumed tokens, set the new rate.

        Missing arguments come from the providers given at construction; without an
        ``increment_provider`` a missing increment raises TypeError (DeepSpeed then retries with
        its train batch size). Without a token count the previous one is kept, unless the schedule
        depends on tokens, which raises LRScheduleError.
        """
        if increment is None:
            if self.increment_provider is None:
                raise TypeError("AnnealingLR.step() needs the increment (samples in this step) or an "
                                "increment_provider given at construction")
            increment = self.increment_provider()
        if token_num is None and self.token_provider is not None:
            token_num = self.token_provider()
        if token_num is None and (self.decay_tokens is not None or self.warmup_by_tokens):
            raise LRScheduleError("a token-based LR schedule (--lr-decay-tokens / --lr-warmup-tokens) needs "
                                  "token_num in step() or a token_provider given at construction")
        if token_num is not None:
            self.num_tokens = token_num
        previous_steps = self.num_steps
        self.num_steps += increment
        warmup_ends = (not self.warmup_by_tokens and self.warmup_steps > 0
                       and previous_steps < self.warmup_steps <= self.num_steps)
        if warmup_ends and self.decay_tokens is not None:
            self.warmup_tokens = self.num_tokens
        self._apply_lr()

    # ---------------------------------------------------------------- checkpointing

    def state_dict(self) -> dict:
        """Megatron-DeepSpeed's eight keys, plus ``decay_tokens`` and ``warmup_unit`` ("samples" or "tokens")."""
        return {
            "max_lr": self.max_lr,
            "warmup_steps": self.warmup_steps,
            "num_steps": self.num_steps,
            "warmup_tokens": self.warmup_tokens,
            "num_tokens": self.num_tokens,
            "decay_style": self.decay_style,
            "decay_steps": self.decay_steps,
            "min_lr": self.min_lr,
            "decay_tokens": self.decay_tokens,
            "warmup_unit": "tokens" if self.warmup_by_tokens else "samples",
        }

    def load_state_dict(self, state: dict):
        """Restore a checkpointed schedule (module docstring, "Resuming").

        With source "check", raises LRScheduleError naming every flag whose value differs from the
        checkpoint's (Megatron-DeepSpeed's five checked values, plus the token decay and the warmup
        unit when the checkpoint records them; Megatron-DeepSpeed's checkpoints do not). Accepts
        Megatron-DeepSpeed's legacy key names.
        """
        mismatches = [self._mismatch(key, description, flags, state)
                      for key, (description, flags) in _CHECKED_FIELDS.items()]
        mismatches += self._token_mismatches(state)
        mismatches = [m for m in mismatches if m]
        if mismatches and self.source == "check":
            raise LRScheduleError("AnnealingLR: the checkpoint's learning-rate schedule differs from the "
                                  "configured one: " + "; ".join(mismatches) + ". " + OVERRIDE_NOTE)
        if self.source == "checkpoint":
            self._take_settings(state)
        for mismatch in mismatches:
            kept = "the configured value (--override-lr-scheduler)" if self.source == "override" else \
                "the checkpoint's value (--use-checkpoint-lr-scheduler)"
            self.report(f"> learning-rate schedule, {mismatch}: using {kept}")
        self.num_steps = _read(state, "num_steps")
        self.num_tokens = state.get("num_tokens", 0)
        if not self.warmup_by_tokens or self.source == "checkpoint":
            self.warmup_tokens = state.get("warmup_tokens", 0)
        self._apply_lr()

    def _take_settings(self, state: dict):
        """--use-checkpoint-lr-scheduler: the checkpoint's settings replace the configured ones."""
        for key in _CHECKED_FIELDS:
            setattr(self, key, _read(state, key))
        self.max_lr = float(self.max_lr)
        self.decay_tokens = state.get("decay_tokens", self.decay_tokens)
        if "warmup_unit" in state:
            self.warmup_by_tokens = state["warmup_unit"] == "tokens"

    def _mismatch(self, key, description, flags, state) -> str | None:
        checkpoint_value = _read(state, key)
        configured = getattr(self, key)
        if checkpoint_value == configured:
            return None
        return f"{description}: checkpoint {checkpoint_value!r}, configured {configured!r} ({flags})"

    def _token_mismatches(self, state) -> list[str | None]:
        found = []
        if "decay_tokens" in state and state["decay_tokens"] != self.decay_tokens:
            found.append(f"token decay: checkpoint {state['decay_tokens']!r}, configured {self.decay_tokens!r} "
                         "(--lr-decay-tokens)")
        unit = "tokens" if self.warmup_by_tokens else "samples"
        if "warmup_unit" in state and state["warmup_unit"] != unit:
            found.append(f"warmup unit: checkpoint {state['warmup_unit']}, configured {unit} "
                         f"(--lr-warmup-tokens vs {WARMUP_FLAGS})")
        elif state.get("warmup_unit") == "tokens" and state["warmup_tokens"] != self.warmup_tokens:
            found.append(f"token warmup: checkpoint {state['warmup_tokens']!r}, configured {self.warmup_tokens!r} "
                         "(--lr-warmup-tokens)")
        return found


def _read(state: dict, key: str):
    """state[key], or its legacy name in Megatron-DeepSpeed's older checkpoints."""
    if key in state:
        return state[key]
    legacy = _LEGACY_KEYS.get(key)
    if legacy is not None and legacy in state:
        return state[legacy]
    raise LRScheduleError(f"the checkpoint's lr_scheduler state has no {key!r} entry (keys: {sorted(state)})")
