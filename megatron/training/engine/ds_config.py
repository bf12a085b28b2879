"""The DeepSpeed config: loaded, checked against the flags the user gave, and completed from them.

DeepSpeed is always the engine. Without --deepspeed_config (with or without --deepspeed), the
config is built from the flags, with a notice; pretrain_gpt.py then runs as Megatron-DeepSpeed's
scripts with --deepspeed do. A --deepspeed_config without --deepspeed is used as well
(Megatron-DeepSpeed would have ignored it), with a notice.

Rules, applied key by key (a key set to "auto" counts as absent):

| Flag | ds_config key | Rule |
|---|---|---|
| --micro-batch-size | train_micro_batch_size_per_gpu | must match; filled from the flag |
| --global-batch-size | train_batch_size (gradient_accumulation_steps) | must match when the flag is given; else taken from the config; filled |
| --fp16, --bf16 | fp16.enabled, bf16.enabled | a given flag must match; a config that enables one without the flag turns it on (notice); filled |
| --zero-stage | zero_optimization.stage | must match when the flag is given; else the config's, else 0; filled |
| --clip-grad | gradient_clipping | the config wins (one notice when a given flag differs); else filled from the flag |
| --remote-device, --use-pin-memory (ZeRO-3) | zero_optimization.offload_param.device, .pin_memory | set from a given flag; a config that says otherwise is an error (nvme refused) |
| --cpu-optimizer, --cpu_torch_adam | zero_optimization.offload_optimizer.device "cpu", zero_force_ds_cpu_optimizer false | the same |
| --loss-scale, --initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis | fp16.loss_scale, .initial_scale_power, .min_loss_scale, .loss_scale_window, .hysteresis | with fp16: the config wins (one notice per key where a given flag differs); absent keys come from a given flag, else DeepSpeed's default (all from the flags when the config is built from them) |

With bf16, gradients accumulate in fp32: ``data_types.grad_accum_dtype = "fp32"`` unless the config
sets it, with a notice; and ``bf16.immediate_grad_update`` is true unless the config sets it: the
BF16_Optimizer then adds each parameter's gradient into its fp32 accumulator as soon as backward
has it and drops the bf16 copy, instead of zeroing the bf16 gradients before each micro-batch's
backward (which makes autograd add every new gradient to the zeros) and adding them all at its end.
The sums are the same bit for bit; it saves a read and a write of every bf16 gradient per
micro-batch and holds each only briefly. (DeepSpeed's ``bf16.check_grad_overflow`` defaults to true: a NaN or Inf
gradient skips the step at every ZeRO stage.) DeepSpeed 0.19 runs bf16 + fp32 accumulation as its BF16_Optimizer, which it
only allows at ZeRO stage 1 (stage 0 raises "unsupported mix"); Megatron-DeepSpeed's "bf16 needs
stage 0" was that same optimizer, so stage 0 becomes 1 in that case (said in the notice). At ZeRO
stage 3 (PP 1 only) ``zero_optimization.memory_efficient_linear`` is false unless the config sets it
(engine/zero3.py says why). Refused: ZeRO stage 3 with pipeline parallelism (named as such), --save or
--load at stage 3 where the engine's checkpoint replacements are off, stage >= 2 with pipeline
parallelism, fp16 without CUDA,
a universal checkpoint (--universal-checkpoint, which sets ``checkpoint.load_universal``; the key
alone counts as the flag) at ZeRO stage 0, and ``optimizer``/``scheduler`` blocks (the optimizer
and the LR schedule come from the flags). With --optimizer sgd or --use-bnb-optimizer at ZeRO stage >= 1,
``zero_allow_untested_optimizer`` is set (as in the BigScience configs) unless the config sets it.
The ``curriculum_learning`` block is checked against the flags by validation.py (curriculum.py).

Every other key must be one the installed DeepSpeed reads (check_known_keys): DeepSpeed ignores a
top-level key it does not know (``train_batch_sizee``: the batch silently comes from elsewhere) and
raises a pydantic traceback, after the model is built, for one inside a block such as
``zero_optimization``. The known keys are not a list kept here: DeepSpeed's own config parser reads
the final ds_config, and every key it did not read (nor hand whole to one of its pydantic models,
which refuse unknown fields themselves) is refused, with the nearest known key. The keys of a block
with ``"enabled": false`` are not checked: DeepSpeed does not read them.
With --sequence-parallel, TP > 1 and PP > 1, ``pipeline.pipe_partitioned`` and ``grad_partitioned``
are set to false (refused when the config sets them true): the stages exchange whole per-rank blocks.
"""
import difflib
import json
import logging
import math
import typing

import deepspeed
import pydantic
from deepspeed.runtime.config import DeepSpeedConfig, _reject_removed_config_keys
from deepspeed.utils import logger as deepspeed_logger

from megatron.core.dtypes import canonical_dtype_name
from megatron.training.argument_types import ArgumentError
from megatron.training.curriculum import BLOCK as CURRICULUM_BLOCK
from megatron.training.engine.replacements import ALLOW_FLAG, is_enabled

FP16_DEFAULTS = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1}  # DeepSpeed 0.19's DeepSpeedFP16Config
# (args dest, flag, fp16 key): how the Megatron loss-scale flags map onto the ds_config fp16 block.
LOSS_SCALE_FLAGS = (("loss_scale", "--loss-scale", "loss_scale"),
                    ("initial_loss_scale", "--initial-loss-scale", "initial_scale_power"),
                    ("min_loss_scale", "--min-loss-scale", "min_loss_scale"),
                    ("loss_scale_window", "--loss-scale-window", "loss_scale_window"),
                    ("hysteresis", "--hysteresis", "hysteresis"))
_MISSING = object()
ZERO3_CHECKPOINT_REPLACEMENTS = ("checkpoint_io.zero3_model_states", "checkpoint_io.zero3_gathered_module",
                                 "checkpoint_io.zero3_one_writer", "checkpoint_io.zero3_module_reads",
                                 "checkpoint_io.zero3_universal_reads")


def load_ds_config(path: str) -> dict:
    """The JSON object in ``path``; ArgumentError naming the file (and line) when it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ArgumentError(f"--deepspeed_config: cannot read {path}: {exc.strerror}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ArgumentError(f"--deepspeed_config: {path} is not valid JSON: {exc.msg} at line "
                            f"{exc.lineno} column {exc.colno}") from None
    if not isinstance(config, dict):
        raise ArgumentError(f"--deepspeed_config: {path} must hold a JSON object, got {type(config).__name__}")
    return config


def _given(block, key):
    value = block.get(key, _MISSING)
    return _MISSING if value == "auto" else value


def _block(config, key, where):
    block = config.setdefault(key, {})
    if not isinstance(block, dict):
        raise ArgumentError(f"{key} in {where} must be a JSON object, got {block!r}")
    return block


class _Resolution:
    """One pass over the config; methods follow the table of the module docstring."""

    def __init__(self, args, explicit, data_parallel_size, pipeline_parallel_size, cuda_available):
        self.args, self.explicit, self.notices = args, explicit, []
        self.enabled = {"fp16": bool(args.fp16), "bf16": bool(args.bf16)}  # precision after the config's say
        self.dp, self.pp, self.cuda_available = data_parallel_size, pipeline_parallel_size, cuda_available
        self.path = args.deepspeed_config or args.deepscale_config
        self.from_flags = self.path is None
        self.where = "the ds_config built from the flags" if self.from_flags else self.path
        self.config = {} if self.from_flags else load_ds_config(self.path)

    def key_int(self, block, key, name, minimum=1):
        value = _given(block, key)
        if value is not _MISSING and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ArgumentError(f"{name} in {self.where} must be an integer >= {minimum}, got {value!r}")
        return value

    def source_notices(self):
        args = self.args
        if args.deepscale_config and not args.deepspeed_config:
            self.notices.append("--deepscale_config is deprecated; read as --deepspeed_config")
        if self.from_flags:
            self.notices.append("no --deepspeed_config: the DeepSpeed engine runs with a ds_config built "
                                "from the flags")
        elif not (args.deepspeed or args.deepscale):
            self.notices.append(f"--deepspeed_config {self.path} without --deepspeed: DeepSpeed is always "
                                f"the engine here, the file is used")

    def refuse_unsupported(self):
        config = self.config
        if "bfloat16" in config and "bf16" not in config:
            config["bf16"] = config.pop("bfloat16")
        for key in ("optimizer", "scheduler"):
            if key in config:
                raise ArgumentError(f"{key} in {self.where} is not supported: the optimizer and the LR "
                                    f"schedule come from the flags (--optimizer, --lr, --lr-decay-style, ...); "
                                    f"remove the {key} block")

    def batch(self):
        args, config = self.args, self.config
        micro = args.micro_batch_size
        config_micro = self.key_int(config, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu")
        if config_micro is not _MISSING and config_micro != micro:
            raise ArgumentError(f"--micro-batch-size {micro} does not match train_micro_batch_size_per_gpu "
                                f"{config_micro} in {self.where}: make them equal (or drop the key)")
        config_global = self.key_int(config, "train_batch_size", "train_batch_size")
        accumulation = self.key_int(config, "gradient_accumulation_steps", "gradient_accumulation_steps")
        if "global_batch_size" in self.explicit:
            if config_global is not _MISSING and config_global != args.global_batch_size:
                raise ArgumentError(f"--global-batch-size {args.global_batch_size} does not match "
                                    f"train_batch_size {config_global} in {self.where}: make them equal "
                                    f"(or drop the key)")
            global_batch = args.global_batch_size
        elif config_global is not _MISSING:
            global_batch = config_global
        elif accumulation is not _MISSING:
            global_batch = micro * accumulation * self.dp
        else:
            global_batch = micro * self.dp
        if accumulation is not _MISSING and micro * accumulation * self.dp != global_batch:
            raise ArgumentError(
                f"gradient_accumulation_steps {accumulation} in {self.where} gives a global batch of "
                f"{micro * accumulation * self.dp} (micro batch {micro} x data parallel {self.dp}), not "
                f"{global_batch}: drop gradient_accumulation_steps (it is derived) or fix it")
        if accumulation is _MISSING:
            config.pop("gradient_accumulation_steps", None)  # "auto": DeepSpeed derives it
        config["train_micro_batch_size_per_gpu"] = micro
        config["train_batch_size"] = global_batch

    def precision(self):
        for name in ("fp16", "bf16"):
            block = _block(self.config, name, self.where)
            enabled = _given(block, "enabled")
            if enabled is not _MISSING and not isinstance(enabled, bool):
                raise ArgumentError(f"{name}.enabled in {self.where} must be true or false, got {enabled!r}")
            if self.enabled[name] and enabled is False:
                raise ArgumentError(f"--{name} is given but {name}.enabled is false in {self.where}: "
                                    f"set it to true, or drop --{name}")
            if not self.enabled[name] and enabled is True:
                self.enabled[name] = True
                self.notices.append(f"{name}.enabled in {self.where}: training in {name} (as if --{name})")
            block["enabled"] = self.enabled[name]
        if self.enabled["fp16"] and self.enabled["bf16"]:
            raise ArgumentError(f"--fp16 and --bf16 (fp16.enabled, bf16.enabled in {self.where}) are "
                                f"exclusive: choose one")
        if self.enabled["fp16"] and not self.cuda_available:
            raise ArgumentError("--fp16 needs a CUDA GPU: DeepSpeed cannot run fp16 on CPU (\"Type fp16 is "
                                "not supported on your device\"); use --bf16 with a bf16 ds_config, or fp32")

    def loss_scaling(self):
        given = [flag for dest, flag, _ in LOSS_SCALE_FLAGS if dest in self.explicit]
        if not self.enabled["fp16"]:
            if given:
                self.notices.append(f"{', '.join(given)}: no effect without --fp16 (loss scaling is for fp16)")
            return
        block = self.config["fp16"]
        for dest, flag, key in LOSS_SCALE_FLAGS:
            flag_value = self._flag_to_fp16_key(dest, flag)
            config_value = _given(block, key)
            if config_value is _MISSING:
                explicit_or_built = dest in self.explicit or self.from_flags
                block[key] = flag_value if explicit_or_built else FP16_DEFAULTS[key]
            elif dest in self.explicit and config_value != flag_value:
                self.notices.append(f"fp16.{key} = {config_value} in {self.where} wins over {flag} "
                                    f"{getattr(self.args, dest)}")

    def _flag_to_fp16_key(self, dest, flag):
        value = getattr(self.args, dest)
        if dest == "loss_scale":
            return 0 if value is None else value
        if dest == "initial_loss_scale":
            power = math.log2(value) if value > 0 else math.nan
            if not power.is_integer():
                raise ArgumentError(f"{flag} {value} is not a power of 2: DeepSpeed takes it as "
                                    f"fp16.initial_scale_power (scale = 2**power)")
            return int(power)
        return int(value) if float(value).is_integer() else value

    def clipping(self):
        value = _given(self.config, "gradient_clipping")
        if value is _MISSING:
            self.config["gradient_clipping"] = self.args.clip_grad
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ArgumentError(f"gradient_clipping in {self.where} must be a number >= 0, got {value!r}")
        if "clip_grad" in self.explicit and value != self.args.clip_grad:
            self.notices.append(f"gradient_clipping = {value} in {self.where} wins over --clip-grad "
                                f"{self.args.clip_grad}")

    def zero_stage(self):
        block = _block(self.config, "zero_optimization", self.where)
        config_stage = self.key_int(block, "stage", "zero_optimization.stage", minimum=0)
        if "zero_stage" in self.explicit:
            if config_stage is not _MISSING and config_stage != self.args.zero_stage:
                raise ArgumentError(f"--zero-stage {self.args.zero_stage} does not match "
                                    f"zero_optimization.stage {config_stage} in {self.where}: make them equal")
            stage, named = self.args.zero_stage, "--zero-stage"
        elif config_stage is not _MISSING:
            stage, named = config_stage, f"zero_optimization.stage in {self.where}"
        else:
            stage, named = 0, "the default ZeRO stage"
        if stage not in (0, 1, 2, 3):
            raise ArgumentError(f"{named} is {stage}: ZeRO stages are 0, 1, 2 and 3")
        if stage == 3 and self.pp > 1:
            raise ArgumentError(f"{named} is 3 with --pipeline-model-parallel-size {self.pp}: ZeRO-3 runs at PP 1 "
                                f"only (DeepSpeed's pipeline engine cannot partition parameters); use stage 0 or 1 "
                                f"with PP > 1, or PP 1")
        if stage >= 2 and self.pp > 1:
            raise ArgumentError(f"{named} is {stage} with --pipeline-model-parallel-size {self.pp}: DeepSpeed's "
                                f"pipeline engine cannot run ZeRO stage 2 or more; use stage 0 or 1, or PP 1")
        if stage == 3 and _given(block, "memory_efficient_linear") is _MISSING:
            block["memory_efficient_linear"] = False  # keep torch's F.linear process-wide (zero3.py)
        block["stage"] = stage

    def universal_checkpoint(self):
        """--universal-checkpoint sets checkpoint.load_universal, as in Megatron-DeepSpeed; the key alone
        counts as the flag. DeepSpeed restores a universal checkpoint through its ZeRO optimizer only, so
        stage 0 (fp32 here: bf16 and fp16 already run at stage 1) runs at stage 1: the same Adam, its
        state split over the data-parallel ranks."""
        block = _block(self.config, "checkpoint", self.where)
        key = _given(block, "load_universal")
        if key is not _MISSING and not isinstance(key, bool):
            raise ArgumentError(f"checkpoint.load_universal in {self.where} must be true or false, got {key!r}")
        if not (self.args.universal_checkpoint or key is True):
            return
        block["load_universal"] = True
        if self.config["zero_optimization"]["stage"] == 0:
            self.config["zero_optimization"]["stage"] = 1
            self.notices.append("a universal checkpoint loads at zero_optimization.stage 1: DeepSpeed restores it "
                                "only through its ZeRO optimizer (the same Adam; stage 0 -> 1)")

    def grad_accumulation(self):
        types = _block(self.config, "data_types", self.where)
        accum = _given(types, "grad_accum_dtype")
        stage = self.config["zero_optimization"]["stage"]
        if not self.enabled["bf16"]:
            if accum is _MISSING:
                types.pop("grad_accum_dtype", None)
            if not types:
                del self.config["data_types"]
            return
        bf16 = _block(self.config, "bf16", self.where)
        if _given(bf16, "immediate_grad_update") is _MISSING:
            bf16["immediate_grad_update"] = True
        if accum is _MISSING:
            types["grad_accum_dtype"] = "fp32"
            message = "bf16: gradients accumulate in fp32 (data_types.grad_accum_dtype = \"fp32\""
            if stage == 0:
                self.config["zero_optimization"]["stage"] = 1
                message += ("; DeepSpeed runs it as BF16_Optimizer, which needs zero_optimization.stage 1: "
                            "stage 0 -> 1, as Megatron-DeepSpeed's bf16 + stage 0 ran the same optimizer")
            self.notices.append(message + "); set data_types.grad_accum_dtype in the ds_config to change it")
        elif canonical_dtype_name(accum) == "fp32" and stage == 0:
            raise ArgumentError(f"data_types.grad_accum_dtype {accum!r} with bf16 at zero_optimization.stage 0 "
                                f"in {self.where}: DeepSpeed cannot run this mix; use stage 1 (its "
                                f"BF16_Optimizer) or grad_accum_dtype \"bf16\"")

    def fp16_stage(self):
        """fp16 at stage 0 runs at stage 1: DeepSpeed 0.19's engine.backward does not scale the loss
        for its non-ZeRO fp16 optimizers while their step() divides the gradients by the loss scale
        (deepspeedai/DeepSpeed#8393), so the model would barely move. Stage 1, Megatron-DeepSpeed's fp16
        setting, does the same math with the optimizer state split over the data-parallel ranks."""
        if self.enabled["fp16"] and self.config["zero_optimization"]["stage"] == 0:
            self.config["zero_optimization"]["stage"] = 1
            self.notices.append("fp16 at zero_optimization.stage 0 runs at stage 1: DeepSpeed 0.19 does not "
                                "scale the loss for its stage-0 fp16 optimizer (deepspeedai/DeepSpeed#8393)")

    def offload_flags(self):
        """Microsoft Megatron-DeepSpeed's offload flags as ds_config keys, which a config that sets them
        otherwise contradicts: --remote-device cpu|nvme -> offload_param.device, --use-pin-memory ->
        offload_param.pin_memory, --cpu-optimizer -> offload_optimizer.device "cpu", --cpu_torch_adam
        -> zero_force_ds_cpu_optimizer false (torch's AdamW steps on the CPU instead of DeepSpeed's CPU
        Adam, model_setup.build_optimizer)."""
        args, block = self.args, self.config["zero_optimization"]
        wanted = []
        if args.remote_device != "none":
            wanted.append(("offload_param", "device", args.remote_device, "--remote-device"))
        if args.use_pin_memory:
            wanted.append(("offload_param", "pin_memory", True, "--use-pin-memory"))
        if args.cpu_optimizer:
            wanted.append(("offload_optimizer", "device", "cpu", "--cpu-optimizer"))
        for key, setting, value, flag in wanted:
            settings = block.setdefault(key, {})
            given = _given(settings, setting)
            if given is not _MISSING and given != value:
                raise ArgumentError(f"{flag} asks for zero_optimization.{key}.{setting} = {json.dumps(value)} but "
                                    f"{self.where} sets {json.dumps(given)}: drop one")
            settings[setting] = value
        if args.use_pin_memory and (block.get("offload_param") or {}).get("device", "none") != "cpu":
            raise ArgumentError("--use-pin-memory pins the parameter partitions offloaded to the CPU: give "
                                "--remote-device cpu (or offload_param.device \"cpu\" in the ds_config)")
        if args.cpu_torch_adam:
            if (block.get("offload_optimizer") or {}).get("device", "none") != "cpu":
                raise ArgumentError("--cpu_torch_adam runs torch's AdamW on the CPU: give --cpu-optimizer (or "
                                    "offload_optimizer.device \"cpu\" in the ds_config)")
            if self.config.get("zero_force_ds_cpu_optimizer", False) is not False:
                raise ArgumentError(f"--cpu_torch_adam with zero_force_ds_cpu_optimizer true in {self.where}: "
                                    f"drop one")
            self.config["zero_force_ds_cpu_optimizer"] = False

    def offload(self):
        """ZeRO's offload to the CPU: the optimizer (stage >= 1, with DeepSpeed's CPU Adam,
        engine.build_optimizer) and, at stage 3, the parameters. NVMe offload is refused by name."""
        self.offload_flags()
        block = self.config["zero_optimization"]
        for key in ("offload_optimizer", "offload_param"):
            device = (block.get(key) or {}).get("device", "none")
            if device == "nvme":
                raise ArgumentError(f"zero_optimization.{key}.device \"nvme\" in {self.where}: NVMe offload is "
                                    f"not supported; use \"cpu\" (or \"none\")")
            if device not in ("none", "cpu"):
                raise ArgumentError(f"zero_optimization.{key}.device {device!r} in {self.where}: only "
                                    f"\"cpu\" (or \"none\") is supported")
        device = (block.get("offload_optimizer") or {}).get("device", "none")
        if device == "cpu" and block["stage"] == 0:
            raise ArgumentError(f"zero_optimization.offload_optimizer in {self.where} needs ZeRO stage 1, 2 or 3")
        if device == "cpu" and self.args.optimizer != "adam":
            raise ArgumentError(f"zero_optimization.offload_optimizer in {self.where} runs DeepSpeed's CPU Adam: "
                                f"use --optimizer adam, or no offload")
        if (block.get("offload_param") or {}).get("device", "none") != "none" and block["stage"] != 3:
            raise ArgumentError(f"zero_optimization.offload_param in {self.where} is a ZeRO-3 feature: set "
                                f"zero_optimization.stage to 3 (--zero-stage 3), or remove it")

    def zero3_checkpoints(self):
        """ZeRO-3 checkpoints get the trainer's layout through the engine's replacements of DeepSpeed's
        checkpoint methods (checkpoint_io.py); where those are off (--allow-untested-deepspeed on another
        DeepSpeed) --save and --load are refused at stage 3 now rather than at the first save."""
        given = [flag for flag, value in (("--save", self.args.save), ("--load", self.args.load)) if value]
        if self.config["zero_optimization"]["stage"] != 3 or not given:
            return
        off = [name for name in ZERO3_CHECKPOINT_REPLACEMENTS if not is_enabled(name)]
        if off:
            raise ArgumentError(f"{' and '.join(given)} at ZeRO stage 3 need the engine's replacements of DeepSpeed's "
                                f"checkpoint methods ({', '.join(off)}), which are off on DeepSpeed "
                                f"{deepspeed.__version__} ({ALLOW_FLAG}): use a supported DeepSpeed, or stage 0-2")

    def sequence_parallel_pipeline(self):
        """DeepSpeed's pipeline engine sends 1/TP of each activation per TP rank and all-gathers it on the
        next stage (``pipeline.pipe_partitioned``, ``grad_partitioned``, on by default), which presumes
        activations replicated over TP; under --sequence-parallel each TP rank holds other positions."""
        if not (self.args.sequence_parallel and self.args.tensor_model_parallel_size > 1 and self.pp > 1):
            return
        pipeline = _block(self.config, "pipeline", self.where)
        for key in ("pipe_partitioned", "grad_partitioned"):
            if _given(pipeline, key) not in (_MISSING, False):
                raise ArgumentError(f"pipeline.{key} in {self.where} sends a TP share of each activation, which "
                                    f"--sequence-parallel has already split by position; set it to false")
            pipeline[key] = False

    def optimizer_support(self):
        """DeepSpeed refuses optimizers outside its ZeRO list (SGD, bitsandbytes' AdamW8bit) at stage >= 1
        unless told otherwise."""
        untested = self.args.optimizer == "sgd" or self.args.use_bnb_optimizer
        if untested and self.config["zero_optimization"]["stage"] >= 1:
            self.config.setdefault("zero_allow_untested_optimizer", True)


class _ReadKeys(dict):
    """A ds_config block that records, in ``reads`` (shared by every block of one config), what
    DeepSpeed's parser does with it: ("read", path) per key looked up, ("whole", path) when the block
    is iterated (a pydantic model's ``**block``, a loop over its items), ("handed", path) when a
    nested block is handed out (a pydantic model given the block itself validates it whole)."""

    def __init__(self, block: dict, path: tuple, reads: list):
        super().__init__(block)
        self.path, self.reads = path, reads

    def _lookup(self, key):
        self.reads.append(("read", self.path + (key,)))
        value = dict.get(self, key)
        if isinstance(value, dict):
            self.reads.append(("handed", self.path + (key,)))
            return _ReadKeys(value, self.path + (key,), self.reads)
        return value

    def __getitem__(self, key):
        if not dict.__contains__(self, key):
            self.reads.append(("read", self.path + (key,)))
            raise KeyError(key)
        return self._lookup(key)

    def get(self, key, default=None):
        if dict.__contains__(self, key):
            return self._lookup(key)
        self.reads.append(("read", self.path + (key,)))
        return default

    def __contains__(self, key):
        self.reads.append(("read", self.path + (key,)))
        return dict.__contains__(self, key)

    def keys(self):
        return _ReadKeyView(self)

    def __iter__(self):
        self.reads.append(("whole", self.path))
        return dict.__iter__(self)

    def items(self):
        return [(key, self._lookup(key)) for key in self]

    def values(self):
        return [value for _, value in self.items()]


class _ReadKeyView(set):
    """``block.keys()``: a membership test reads one key, a loop reads the whole block."""

    def __init__(self, block: _ReadKeys):
        super().__init__(dict.keys(block))
        self.block = block

    def __contains__(self, key):
        return key in self.block

    def __iter__(self):
        return iter(list(self.block))


def _dotted(path) -> str:
    return ".".join(str(part) for part in path)


def _nearest(key, known) -> str:
    close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _unread_keys(config: dict, reads: list) -> list[str]:
    """Each key of ``config`` DeepSpeed neither read nor validated whole, as "path (did you mean X?)"."""
    read = {path for kind, path in reads if kind == "read"}
    whole = {path for kind, path in reads if kind == "whole"}
    handed = {path for kind, path in reads if kind == "handed"}
    unknown = []

    def visit(block, path):
        untouched = path in handed and not any(key[:-1] == path for key in read)
        if path in whole or untouched or block.get("enabled", True) is False:
            return
        known = {key[-1] for key in read if key[:-1] == path}
        for key, value in block.items():
            if path + (key,) not in read:
                unknown.append(_dotted(path + (key,)) + _nearest(key, known))
            elif isinstance(value, dict):
                visit(value, path + (key,))

    visit(config, ())
    return unknown


def _model_fields(title: str, location: tuple) -> set[str]:
    """The field names and aliases of the DeepSpeed pydantic model ``title`` at ``location`` inside it."""
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    models = [cls for cls in subclasses(pydantic.BaseModel)
              if cls.__name__ == title and cls.__module__.startswith("deepspeed")]
    model = models[0] if models else None
    for name in location:
        fields = {} if model is None else {**model.model_fields, **{f.alias: f for f in model.model_fields.values()
                                                                     if f.alias}}
        annotation = fields[name].annotation if name in fields else None
        candidates = (annotation, *typing.get_args(annotation))
        model = next((cls for cls in candidates if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel)),
                     None)
    if model is None:
        return set()
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def _validation_message(error: pydantic.ValidationError, config: dict, reads: list, where: str) -> str:
    """The first problem of a DeepSpeed model's ValidationError, named by its path in the ds_config."""
    problem = error.errors()[0]
    location = tuple(problem["loc"])

    def holds(prefix):
        block = config
        for part in prefix + location[:-1]:
            block = block.get(part) if isinstance(block, dict) else None
        return isinstance(block, dict) and location[-1] in block

    handed = [path for kind, path in reversed(reads) if kind in ("handed", "whole")]
    prefix = next((path for path in handed + [()] if holds(path)), ())
    name = _dotted(prefix + location)
    if problem["type"] == "extra_forbidden":
        known = _model_fields(error.title, location[:-1])
        return (f"unknown key {name}{_nearest(location[-1], known)} in {where}: DeepSpeed "
                f"{deepspeed.__version__} refuses it; fix or remove it")
    return f"{name} in {where}: {problem['msg']} (DeepSpeed {deepspeed.__version__}), got {problem['input']!r}"


def check_known_keys(config: dict, where: str):
    """Refuse a ds_config key the installed DeepSpeed does not know, naming it and the nearest known key.

    DeepSpeed's own parser (DeepSpeedConfig._initialize_params, without the process group it would
    ask for the world size) reads ``config`` through recording blocks; see the module docstring.
    """
    reads = []
    recorded = _ReadKeys(config, (), reads)
    parser = object.__new__(DeepSpeedConfig)
    parser.global_rank, parser.world_size = 0, 1
    level = deepspeed_logger.level
    deepspeed_logger.setLevel(logging.ERROR)  # its warnings (deprecated keys) come again when the engine starts
    try:
        _reject_removed_config_keys(recorded)
        DeepSpeedConfig._initialize_params(parser, recorded)
    except pydantic.ValidationError as exc:
        raise ArgumentError(_validation_message(exc, config, reads, where)) from None
    except Exception as exc:  # DeepSpeed's own checks: assertions, DeepSpeedConfigError, ValueError
        raise ArgumentError(f"DeepSpeed {deepspeed.__version__} refuses the ds_config {where}: "
                            f"{str(exc).strip()}") from None
    finally:
        deepspeed_logger.setLevel(level)
    unknown = _unread_keys(config, reads)
    if unknown:
        keys = "key " + unknown[0] if len(unknown) == 1 else "keys " + ", ".join(unknown)
        raise ArgumentError(f"unknown {keys} in {where}: DeepSpeed {deepspeed.__version__} does not read "
                            f"{'it' if len(unknown) == 1 else 'them'} and would go on without; fix or remove "
                            f"{'it' if len(unknown) == 1 else 'them'}")


def resolve_ds_config(args, explicit, data_parallel_size, pipeline_parallel_size, cuda_available):
    """Load (or build) the ds_config, check it against the flags, complete it; return (config, notices).

    ``args`` is only read. The effective global batch, precision, clipping, ZeRO stage and loss
    scaling are the final config's keys (validation.DerivedValues reads them from there).
    ``explicit`` is the set of dests given on the command line.
    """
    resolution = _Resolution(args, explicit, data_parallel_size, pipeline_parallel_size, cuda_available)
    resolution.source_notices()
    resolution.refuse_unsupported()
    resolution.batch()
    resolution.precision()
    resolution.loss_scaling()
    resolution.clipping()
    resolution.zero_stage()
    resolution.grad_accumulation()
    resolution.fp16_stage()
    resolution.universal_checkpoint()
    resolution.offload()
    resolution.zero3_checkpoints()
    resolution.optimizer_support()
    resolution.sequence_parallel_pipeline()
    check_known_keys({key: value for key, value in resolution.config.items() if key != CURRICULUM_BLOCK},
                     resolution.where)
    return resolution.config, resolution.notices


def add_deepspeed_flags(parser) -> None:
    """DeepSpeed's own flags (--deepspeed, --deepspeed_config, ...) and the engine's version escape."""
    deepspeed.add_config_arguments(parser)
    parser.add_argument(ALLOW_FLAG, action="store_true",
                        help="Run on a DeepSpeed outside the supported versions, with the engine's replacements "
                             "of DeepSpeed's methods off (listed in a warning at start)")
