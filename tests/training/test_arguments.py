"""parse_args: notations, refused flags, cross-flag validation, launch env, CPU rules, CLI surface."""
import json
import os

import pytest

from megatron.training.argument_foreign_flags import FOREIGN_REFUSALS
from megatron.training.argument_rejections import REJECTED_FLAGS
from megatron.training.config import build_config
from megatron.training.arguments import (ArgumentError, build_parser, format_args, parse_args, parse_args_or_exit,
                                         report_error_and_exit, write_args_listing)
from tests.conftest import REPO_ROOT

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CLI_SURFACE_FILE = os.path.join(DATA_DIR, "cli_surface.txt")
EXAMPLES_DIR = os.path.join(REPO_ROOT, "examples")

BASE = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--micro-batch-size": "2",
        "--seq-length": "32", "--max-position-embeddings": "32", "--train-samples": "1000", "--lr": "1e-3",
        "--data-path": "/data/corpus_text_document", "--vocab-file": "vocab.json", "--merge-file": "merges.txt"}


def argv(extra=(), drop=()):
    """BASE without the flags in ``drop``, then ``extra`` (a later flag repeats win in argparse)."""
    out = []
    for flag, value in BASE.items():
        if flag not in drop:
            out += [flag, value]
    return out + list(extra)


def world(size, rank=0):
    """The environment torchrun gives rank ``rank`` of a one-node job of ``size`` processes."""
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "test"}


def parse(extra=(), drop=(), env=None, cuda=False):
    return parse_args(argv(extra, drop), env=env or {}, cuda_available=cuda)


def error(extra=(), drop=(), env=None, cuda=False):
    with pytest.raises(ArgumentError) as info:
        parse(extra, drop, env, cuda)
    return str(info.value)


# ---- notations and value types -------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("6_000_000", 6_000_000), ("10e6", 10_000_000), ("2e3", 2000),
                                         ("1024", 1024), ("1_0e3", 10_000)])
def test_integer_notations_of_the_bigscience_scripts(text, value):
    assert parse(["--train-samples", text]).flags.train_samples == value


@pytest.mark.parametrize("text", ["1.5", "1e-3", "ten", "inf"])
def test_integer_flag_refuses_non_integers_naming_the_flag(text):
    message = error(["--train-samples", text])
    assert "--train-samples" in message and text in message


def test_float_and_rampup_notations():
    flags = parse(["--lr", "6e-5", "--min-lr", "6e-6", "--rampup-batch-size", "2", "2", "9_765_625",
                   "--global-batch-size", "8"]).flags
    assert (flags.lr, flags.min_lr, flags.rampup_batch_size) == (6e-5, 6e-6, [2, 2, 9_765_625])


@pytest.mark.parametrize("words, value", [(["true"], True), (["True"], True), (["1"], True), ([], True),
                                          (["false"], False), (["0"], False), (["no"], False)])
def test_eval_only_reads_booleans(words, value):
    assert parse(["--eval-only", *words, "--load", "/ckpt"]).flags.eval_only is value


def test_type_bool_flags_refuse_other_words():
    assert "--onnx-safe" in error(["--onnx-safe", "maybe"])
    assert parse(["--onnx-safe", "false"]).flags.onnx_safe is False
    assert parse(["--lazy-mpu-init", "false"]).flags.lazy_mpu_init is False
    assert "--lazy-mpu-init" in error(["--lazy-mpu-init", "true"])


def test_unknown_flag_and_abbreviation_are_errors():
    assert "unrecognized arguments: --no-such-flag" in error(["--no-such-flag"])
    assert "unrecognized arguments" in error(["--num-lay", "2"])


# ---- refused flags -------------------------------------------------------------------------------

# The foreign parsers' refusals are checked all at once in test_foreign_flags.py.
@pytest.mark.parametrize("flag", sorted(set(REJECTED_FLAGS) - set(FOREIGN_REFUSALS)))
def test_refused_flag_gives_its_reason(flag):
    message = error([flag, "1"])
    assert message == f"{flag}: {REJECTED_FLAGS[flag]}"


def test_long_run_features_are_not_available_yet():
    assert "not available yet" in error(["--reset-progress"])


@pytest.mark.parametrize("flag, message", [
    ("--batch-size", "--batch-size argument is no longer valid, use --micro-batch-size instead"),
    ("--warmup", "--warmup argument is no longer valid, use --lr-warmup-fraction instead"),
    ("--model-parallel-size", "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead"),
])
def test_deprecated_flags_keep_megatron_deepspeed_messages(flag, message):
    assert message in error([flag, "4"])


def test_refused_flags_are_hidden_from_help_and_namespace():
    parser = build_parser()
    assert "--inference" not in parser.format_help()
    assert not any(name.startswith("rejected_") for name in vars(parse().flags))


# ---- validation: each rule names its flags -------------------------------------------------------

VALIDATION_CASES = {
    "train both units": (["--train-iters", "10"], (), None, ["--train-iters", "--train-samples"]),
    "train no unit": ([], ["--train-samples"], None, ["--train-iters", "--train-samples"]),
    "iters + decay samples": (["--train-iters", "10", "--lr-decay-samples", "5"], ["--train-samples"], None,
                              ["--lr-decay-samples", "--train-iters"]),
    "iters + warmup samples": (["--train-iters", "10", "--lr-warmup-samples", "5"], ["--train-samples"], None,
                               ["--lr-warmup-samples", "--train-iters"]),
    "iters + rampup": (["--train-iters", "10", "--rampup-batch-size", "2", "2", "10"], ["--train-samples"], None,
                       ["--rampup-batch-size", "--train-iters"]),
    "samples + decay iters": (["--lr-decay-iters", "5"], (), None, ["--lr-decay-iters", "--train-samples"]),
    "samples + warmup iters": (["--lr-warmup-iters", "5"], (), None, ["--lr-warmup-iters", "--train-samples"]),
    "fraction + warmup samples": (["--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "5"], (), None,
                                  ["--lr-warmup-fraction", "--lr-warmup-samples"]),
    "tokens + fraction": (["--lr-warmup-tokens", "100", "--lr-warmup-fraction", "0.1"], (), None,
                          ["--lr-warmup-tokens", "--lr-warmup-fraction"]),
    "fraction 1": (["--lr-warmup-fraction", "1"], (), None, ["--lr-warmup-fraction"]),
    "warmup >= decay": (["--lr-warmup-samples", "600", "--lr-decay-samples", "500"], (), None,
                        ["--lr-warmup-samples", "--lr-decay-samples"]),
    "inverse sqrt without warmup": (["--lr-decay-style", "inverse-square-root"], (), None,
                                    ["--lr-decay-style inverse-square-root", "--lr-warmup-samples"]),
    "min lr > lr": (["--min-lr", "0.1"], (), None, ["--min-lr", "--lr"]),
    "both lr scheduler sources": (["--override-lr-scheduler", "--use-checkpoint-lr-scheduler"], (), None,
                                  ["--override-lr-scheduler", "--use-checkpoint-lr-scheduler", "exclusive"]),
    "save without interval": (["--save", "/tmp/ckpt"], (), None, ["--save", "--save-interval"]),
    "missing required": ([], ["--num-layers", "--seq-length"], None, ["--num-layers", "--seq-length"]),
    "missing lr": ([], ["--lr"], None, ["--lr"]),
    "seq and encoder seq": (["--encoder-seq-length", "32"], (), None, ["--seq-length", "--encoder-seq-length"]),
    "global batch not divisible": (["--global-batch-size", "6"], (), world(2),
                                   ["--global-batch-size 6", "--micro-batch-size 2", "data-parallel size 2", "4"]),
    "rampup step not divisible": (["--global-batch-size", "16", "--rampup-batch-size", "2", "2", "100"], (), world(2),
                                  ["--rampup-batch-size", "--micro-batch-size 2", "2, 6, 10"]),
    "rampup does not reach": (["--global-batch-size", "16", "--rampup-batch-size", "4", "8", "100"], (), None,
                              ["--rampup-batch-size", "--global-batch-size 16"]),
    "world vs tp x pp": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], (), world(6),
                         ["world size 6", "--tensor-model-parallel-size", "--pipeline-model-parallel-size"]),
    "fp16 with bf16": (["--fp16", "--bf16"], (), None, ["--fp16", "--bf16"]),
    "zero 2 with pp": (["--pipeline-model-parallel-size", "2", "--zero-stage", "2"], (), world(2),
                       ["--zero-stage", "--pipeline-model-parallel-size"]),
    "zero 3 with pp": (["--pipeline-model-parallel-size", "2", "--zero-stage", "3"], (), world(2),
                       ["--zero-stage", "ZeRO-3", "--pipeline-model-parallel-size 2"]),
    "data path and weighted": (["--train-weighted-split-paths", "T: 1 0:1 /d/a"], (), None,
                               ["--data-path", "--train-weighted-split-paths"]),
    "split with weighted": (["--train-weighted-split-paths", "T: 1 0:1 /d/a", "--split", "98,2,0"], ["--data-path"],
                            None, ["--split", "weighted"]),
    "valid weighted without train": (["--valid-weighted-split-paths", "V: 1 0:1 /d/a"], ["--data-path"], None,
                                     ["--valid-weighted-split-paths", "--train-weighted-split-paths"]),
    "no data": ([], ["--data-path"], None, ["--data-path", "--train-weighted-split-paths"]),
    "bert tokenizer": (["--tokenizer-type", "BertWordPieceCase"], (), None, ["--tokenizer-type", "BERT"]),
    "gpt2 tokenizer without files": ([], ["--merge-file"], None, ["--vocab-file", "--merge-file"]),
    "hf tokenizer without path": (["--tokenizer-type", "PretrainedFromHF"], (), None, ["--tokenizer-name-or-path"]),
    "legacy data impl": (["--data-impl", "lazy"], (), None, ["--data-impl"]),
    "bad partition method": (["--pp-partition-method", "bogus"], (), None, ["--pp-partition-method"]),
    "non-positive interval": (["--log-interval", "0"], (), None, ["--log-interval"]),
    "beta out of range": (["--adam-beta2", "1.0"], (), None, ["--adam-beta2"]),
    "negative min lr": (["--min-lr", "-1"], (), None, ["--min-lr"]),
}


@pytest.mark.parametrize("case", sorted(VALIDATION_CASES))
def test_validation_error_names_the_flags(case):
    extra, drop, env, words = VALIDATION_CASES[case]
    message = error(extra, drop, env)
    for word in words:
        assert word in message, f"{case}: {word!r} missing from {message!r}"


def test_valid_rampup_and_defaults():
    derived = parse(["--global-batch-size", "16", "--rampup-batch-size", "4", "4", "100"], env=world(2)).derived
    assert (derived.launch.world_size, derived.data_parallel_size, derived.global_batch_size) == (2, 2, 16)
    defaults = parse()
    assert (defaults.derived.global_batch_size, defaults.derived.seq_length) == (2, 32)
    assert defaults.flags.tokenizer_type == "GPT2BPETokenizer" and defaults.derived.zero_stage == 0


def test_fp16_is_refused_on_cpu_and_accepted_with_cuda():
    message = error(["--fp16"])
    assert "--fp16" in message and "CPU" in message and "--bf16" in message
    assert parse(["--fp16"], cuda=True).derived.fp16


def test_backend_rule_on_cpu_prints_one_notice_when_nccl_was_asked_for(capsys):
    derived = parse(["--distributed-backend", "nccl"]).derived
    lines = [line for line in capsys.readouterr().out.splitlines() if "--distributed-backend" in line]
    assert derived.distributed_backend == "gloo" and len(lines) == 1
    default = parse().derived
    assert default.distributed_backend == "gloo" and not any("--distributed-backend" in n for n in default.notices)
    assert parse(cuda=True).derived.distributed_backend == "nccl"
    assert parse(["--distributed-backend", "gloo"], cuda=True).derived.distributed_backend == "gloo"


def test_notices_print_on_rank_0_only(capsys):
    parse(env=world(2, rank=1))
    assert capsys.readouterr().out == ""
    parsed = parse(env=world(2, rank=0))
    assert capsys.readouterr().out.count("notice: ") == len(parsed.derived.notices) >= 1


# ---- launchers through parse_args ----------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["--local_rank", "--local-rank"])
def test_torch_distributed_launch_local_rank_spellings(spelling):
    launch = parse([f"{spelling}=1"], env={**world(2, rank=1)}).derived.launch
    assert (launch.rank, launch.local_rank, launch.world_size, launch.source) == (1, 1, 2, "torch.distributed.launch")


def test_slurm_ranks_and_parallel_sizes():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[3-6]"}
    derived = parse(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], env=env).derived
    launch = derived.launch
    assert (launch.rank, launch.world_size, launch.local_rank, derived.data_parallel_size) == (5, 8, 1, 2)
    assert (launch.master_addr, launch.source, derived.global_batch_size) == ("gpu3", "slurm", 4)


def test_explicit_flags_are_the_dests_given():
    explicit = parse(["--clip-grad", "1.0", "--no-bias-gelu-fusion", "--deepspeed"]).explicit
    assert {"clip_grad", "bias_gelu_fusion", "deepspeed", "num_layers"} <= explicit
    assert not {"weight_decay", "fp16", "global_batch_size"} & explicit


# ---- entry-point helpers -------------------------------------------------------------------------

def test_parse_args_or_exit_prints_the_error(capsys, monkeypatch):
    monkeypatch.setattr("os.environ", {})
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit(argv(["--batch-size", "8"]))
    assert info.value.code == 2
    assert "error: --batch-size: --batch-size argument is no longer valid" in capsys.readouterr().err


@pytest.mark.parametrize("rank, waited", [("0", False), ("1", True)])
def test_an_error_every_rank_met_is_reported_by_rank_0_first(capsys, monkeypatch, rank, waited):
    """Rank 0 reports at once; another rank only after the grace period in which a launcher stops it
    once rank 0 has exited, so the message cannot be lost to a rank that exited first."""
    sleeps = []
    monkeypatch.setattr("time.sleep", sleeps.append)
    with pytest.raises(SystemExit) as info:
        report_error_and_exit(ArgumentError("--foo is wrong"), 2, {"RANK": rank}, grace_seconds=3.0)
    assert info.value.code == 2
    assert sleeps == ([3.0] if waited else [])
    assert "error: --foo is wrong" in capsys.readouterr().err


def test_args_listing_is_sorted_and_written(tmp_path):
    parsed = parse(["--encoder-seq-length", "32"], ["--seq-length"], env=world(2))
    text = format_args(parsed)
    names = [line.split()[0] for line in text.splitlines()[1:-1]]
    assert names == sorted(names) and "micro_batch_size" in names
    values = {line.split()[0]: line.split()[-1] for line in text.splitlines()[1:-1]}
    assert (values["seq_length"], values["world_size"], values["data_parallel_size"]) == ("32", "2", "2")
    path = write_args_listing(parsed, str(tmp_path / "logs"))
    assert os.path.basename(path).startswith("args_") and open(path).read() == text
    assert os.listdir(tmp_path / "logs") == [os.path.basename(path)]


# ---- CLI surface ---------------------------------------------------------------------------------

def current_cli_surface():
    """One line per option string: "FLAG default=REPR", or "FLAG refused" for the refused flags."""
    lines = []
    for action in build_parser()._actions:
        for option in action.option_strings:
            if option in ("-h", "--help"):
                continue
            state = "refused" if option in REJECTED_FLAGS else f"default={action.default!r}"
            lines.append(f"{option} {state}")
    return sorted(lines)


def test_cli_surface_is_frozen():
    """Adding, removing, refusing a flag or changing a default must be a deliberate edit of cli_surface.txt."""
    with open(CLI_SURFACE_FILE) as f:
        frozen = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#")]
    current = current_cli_surface()
    added, removed = sorted(set(current) - set(frozen)), sorted(set(frozen) - set(current))
    assert not added and not removed, (
        f"the command line changed; review and update {CLI_SURFACE_FILE}\n new: {added}\n gone: {removed}")


# ---- ds_config: loaded, compared with the given flags, completed ---------------------------------

@pytest.fixture
def ds_file(tmp_path):
    """Write a ds_config (a dict as JSON, or raw text) and return its path."""
    def write(config, name="ds_config.json"):
        path = tmp_path / name
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        return str(path)
    return write


def printed_notices(capsys):
    return [line[len("notice: "):] for line in capsys.readouterr().out.splitlines() if line.startswith("notice: ")]


def with_ds(path, *extra):
    return ["--deepspeed", "--deepspeed_config", path, *extra]


def test_bad_json_names_the_file_and_line(ds_file):
    path = ds_file('{"train_batch_size": 8,\n "fp16": {enabled: true}}')
    message = error(with_ds(path))
    assert path in message and "line 2" in message and "--deepspeed_config" in message


@pytest.mark.parametrize("content", [None, "[1, 2]"])
def test_missing_or_non_object_config_names_the_file(ds_file, tmp_path, content):
    path = ds_file(content) if content else str(tmp_path / "absent.json")
    assert path in error(with_ds(path))


def test_micro_batch_must_match(ds_file):
    message = error(with_ds(ds_file({"train_micro_batch_size_per_gpu": 4})))
    assert "--micro-batch-size 2" in message and "train_micro_batch_size_per_gpu 4" in message


def test_global_batch_compared_only_when_given(ds_file):
    path = ds_file({"train_batch_size": 16})
    message = error(with_ds(path, "--global-batch-size", "8"))
    assert "--global-batch-size 8" in message and "train_batch_size 16" in message
    parsed = parse(with_ds(path), env=world(2))
    assert parsed.derived.global_batch_size == 16 and parsed.derived.ds_config["train_batch_size"] == 16
    assert "global_batch_size" not in parsed.explicit and parsed.flags.global_batch_size is None


def test_gradient_accumulation_steps_gives_or_checks_the_global_batch(ds_file):
    path = ds_file({"gradient_accumulation_steps": 3})
    assert parse(with_ds(path), env=world(2)).derived.global_batch_size == 12
    message = error(with_ds(path, "--global-batch-size", "8"), env=world(2))
    assert "gradient_accumulation_steps 3" in message and "8" in message


def test_auto_values_are_filled_from_the_flags(ds_file):
    path = ds_file({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                    "gradient_accumulation_steps": "auto", "data_types": {"grad_accum_dtype": "auto"}})
    config = parse(with_ds(path, "--global-batch-size", "8", "--clip-grad", "0.7")).derived.ds_config
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"], config["gradient_clipping"]) == (8, 2, 0.7)
    assert "gradient_accumulation_steps" not in config and "data_types" not in config
    bf16 = parse(with_ds(path, "--bf16")).derived.ds_config
    assert bf16["data_types"] == {"grad_accum_dtype": "fp32"}


def test_precision_flags_against_the_config(ds_file, capsys):
    assert "fp16.enabled is false" in error(with_ds(ds_file({"fp16": {"enabled": False}}), "--fp16"), cuda=True)
    assert "--fp16" in error(with_ds(ds_file({"bf16": {"enabled": True}}), "--fp16"), cuda=True)
    assert parse(with_ds(ds_file({"bf16": {"enabled": True}}), "--bf16")).derived.bf16
    capsys.readouterr()
    adopted = parse(with_ds(ds_file({"bf16": {"enabled": True}})))
    assert adopted.derived.bf16 and str(adopted.derived.params_dtype) == "torch.bfloat16"
    assert adopted.flags.bf16 is False
    assert sum("bf16.enabled" in n for n in printed_notices(capsys)) == 1
    message = error(with_ds(ds_file({"fp16": {"enabled": True}})))
    assert "--fp16" in message and "CPU" in message


def test_zero_stage_against_the_config(ds_file):
    message = error(with_ds(ds_file({"zero_optimization": {"stage": 0}}), "--zero-stage", "1"))
    assert "--zero-stage 1" in message and "zero_optimization.stage 0" in message
    assert parse(with_ds(ds_file({"zero_optimization": {"stage": 2}}))).derived.zero_stage == 2
    assert parse(with_ds(ds_file({}), "--zero-stage", "1")).derived.ds_config["zero_optimization"] == {"stage": 1}
    assert parse(with_ds(ds_file({}))).derived.zero_stage == 0
    assert parse(with_ds(ds_file({"zero_optimization": {"stage": 3}}))).derived.zero_stage == 3
    assert "zero_optimization.stage" in error(with_ds(ds_file({"zero_optimization": {"stage": 4}})))
    message = error(with_ds(ds_file({"zero_optimization": {"stage": 2}}), "--pipeline-model-parallel-size", "2"),
                    env=world(2))
    assert "zero_optimization.stage" in message and "--pipeline-model-parallel-size 2" in message


@pytest.mark.parametrize("flags, config, notices, effective", [
    (["--clip-grad", "0.5"], {"gradient_clipping": 1.0}, 1, 1.0),
    (["--clip-grad", "1.0"], {"gradient_clipping": 1.0}, 0, 1.0),
    ([], {"gradient_clipping": 0.3}, 0, 0.3),
    (["--clip-grad", "0.5"], {}, 0, 0.5),
])
def test_gradient_clipping_of_the_config_wins_with_one_notice(ds_file, capsys, flags, config, notices, effective):
    derived = parse(with_ds(ds_file(config), *flags)).derived
    lines = [n for n in printed_notices(capsys) if "gradient_clipping" in n]
    assert len(lines) == notices and all("--clip-grad" in n for n in lines)
    assert derived.clip_grad == effective == derived.ds_config["gradient_clipping"]


BIGSCIENCE_FP16_BLOCK = {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                   "min_loss_scale": 1, "initial_scale_power": 12}


@pytest.mark.parametrize("flags, overridden", [
    (["--loss-scale", "12"], ["loss_scale"]),
    (["--loss-scale", "12", "--initial-loss-scale", "65536", "--min-loss-scale", "2", "--loss-scale-window", "1000",
      "--hysteresis", "4"], ["loss_scale", "initial_scale_power", "min_loss_scale", "loss_scale_window", "hysteresis"]),
    (["--initial-loss-scale", "4096", "--loss-scale-window", "500", "--hysteresis", "2", "--min-loss-scale", "1"], []),
])
def test_loss_scale_flags_one_notice_per_overridden_key(ds_file, capsys, flags, overridden):
    derived = parse(with_ds(ds_file({"fp16": BIGSCIENCE_FP16_BLOCK}), "--fp16", *flags), cuda=True).derived
    notices = printed_notices(capsys)
    for key in ("loss_scale", "initial_scale_power", "min_loss_scale", "loss_scale_window", "hysteresis"):
        count = sum(n.startswith(f"fp16.{key} =") for n in notices)
        assert count == (1 if key in overridden else 0), (key, notices)
    assert derived.ds_config["fp16"] == BIGSCIENCE_FP16_BLOCK


def test_fp16_keys_filled_from_given_flags_else_deepspeed_defaults(ds_file):
    block = parse(with_ds(ds_file({"fp16": {"enabled": True}}), "--loss-scale-window", "500"),
                  cuda=True).derived.ds_config["fp16"]
    assert block == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 500,
                     "hysteresis": 2, "min_loss_scale": 1}
    built = parse(["--fp16", "--loss-scale", "128"], cuda=True).derived.ds_config["fp16"]
    assert built == {"enabled": True, "loss_scale": 128, "initial_scale_power": 32, "loss_scale_window": 1000,
                     "hysteresis": 2, "min_loss_scale": 1}
    assert "power of 2" in error(["--fp16", "--initial-loss-scale", "1000"], cuda=True)


def test_loss_scale_flags_without_fp16_give_one_notice(capsys):
    parse(["--bf16", "--loss-scale", "12", "--hysteresis", "2"])
    lines = [n for n in printed_notices(capsys) if "--loss-scale" in n]
    assert len(lines) == 1 and "--hysteresis" in lines[0] and "without --fp16" in lines[0]


@pytest.mark.parametrize("config, stage, accum, notice", [
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, 1, "fp32", "grad_accum_dtype"),
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}, 1, "fp32", "stage 0 -> 1"),
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, 2, "fp32", "grad_accum_dtype"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}, 0, "bf16", None),
])
def test_bf16_accumulates_in_fp32_unless_the_config_says(ds_file, capsys, config, stage, accum, notice):
    derived = parse(with_ds(ds_file(config), "--bf16")).derived
    final = derived.ds_config
    assert (final["zero_optimization"]["stage"], final["data_types"]["grad_accum_dtype"]) == (stage, accum)
    assert derived.zero_stage == stage
    lines = [n for n in printed_notices(capsys) if "grad_accum_dtype" in n]
    assert len(lines) == (1 if notice else 0) and all(notice in n for n in lines)


def test_bf16_gradients_go_to_their_fp32_accumulators_immediately_unless_the_config_says(ds_file):
    assert parse(["--bf16"]).derived.ds_config["bf16"]["immediate_grad_update"] is True
    kept = {"bf16": {"enabled": True, "immediate_grad_update": False}}
    assert parse(with_ds(ds_file(kept), "--bf16")).derived.ds_config["bf16"]["immediate_grad_update"] is False
    assert "immediate_grad_update" not in parse([]).derived.ds_config.get("bf16", {})  # fp32


def test_bf16_fp32_accumulation_at_stage_0_is_refused_when_explicit(ds_file):
    path = ds_file({"bf16": {"enabled": True}, "zero_optimization": {"stage": 0},
                    "data_types": {"grad_accum_dtype": "fp32"}})
    message = error(with_ds(path, "--bf16"))
    assert "grad_accum_dtype" in message and "stage 0" in message


@pytest.mark.parametrize("config, stage, notices", [
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 0}}, 1, 1),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}, 1, 0),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, 2, 0),
])
def test_fp16_at_stage_0_runs_at_stage_1(ds_file, capsys, config, stage, notices):
    derived = parse(with_ds(ds_file(config), "--fp16"), cuda=True).derived
    assert derived.zero_stage == stage and derived.ds_config["zero_optimization"]["stage"] == stage
    lines = [n for n in printed_notices(capsys) if "fp16 at zero_optimization.stage 0" in n]
    assert len(lines) == notices and all("DeepSpeed#8393" in n for n in lines)


def test_sgd_with_zero_is_allowed_explicitly():
    assert parse(["--optimizer", "sgd", "--zero-stage", "1"]).derived.ds_config["zero_allow_untested_optimizer"]
    assert "zero_allow_untested_optimizer" not in parse(["--optimizer", "sgd"]).derived.ds_config
    assert "zero_allow_untested_optimizer" not in parse(["--zero-stage", "1"]).derived.ds_config


def test_fp32_training_has_no_data_types():
    assert "data_types" not in parse().derived.ds_config


@pytest.mark.parametrize("config, words", [
    ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}}, ["min_difficulty", "positive integer"]),
    ({"checkpoint": {"load_universal": "yes"}}, ["load_universal", "true or false"]),
    ({"optimizer": {"type": "Adam"}}, ["optimizer", "--optimizer"]),
    ({"scheduler": {"type": "WarmupLR"}}, ["scheduler", "--lr-decay-style"]),
])
def test_unsupported_config_blocks_are_refused(ds_file, config, words):
    message = error(with_ds(ds_file(config)))
    for word in words:
        assert word in message


def test_universal_checkpoint_flag_sets_load_universal(ds_file):
    """--universal-checkpoint and the ds_config key are one setting; ZeRO stage 0 loads it at stage 1."""
    at_stage_0 = parse(["--universal-checkpoint", "--zero-stage", "0"])
    assert at_stage_0.derived.ds_config["zero_optimization"]["stage"] == 1
    assert any("universal checkpoint loads at zero_optimization.stage 1" in notice for notice in at_stage_0.derived.notices)
    by_flag = parse(["--universal-checkpoint", "--zero-stage", "1"])
    by_key = parse(with_ds(ds_file({"checkpoint": {"load_universal": True}, "zero_optimization": {"stage": 2}})))
    for parsed in (by_flag, by_key):
        assert parsed.derived.ds_config["checkpoint"] == {"load_universal": True}
        assert build_config(parsed, tokenizer_vocab_size=1000).checkpoint.universal_checkpoint
    assert not build_config(parse(["--zero-stage", "1"]), tokenizer_vocab_size=1000).checkpoint.universal_checkpoint


def test_disabled_curriculum_is_accepted(ds_file):
    assert parse(with_ds(ds_file({"curriculum_learning": {"enabled": False}}))).flags.deepspeed


UNKNOWN_KEY_CASES = {
    "top level, ignored by DeepSpeed": ({"train_batch_sizee": 4, "gradient_clippping": 0.5},
                                        ["unknown keys train_batch_sizee (did you mean train_batch_size?), "
                                         "gradient_clippping (did you mean gradient_clipping?)", "does not read them"]),
    "in a plain block": ({"data_types": {"grad_accum_dtyp": "fp32"}, "bf16": {"enabled": True}},
                         ["unknown key data_types.grad_accum_dtyp (did you mean grad_accum_dtype?)", "does not read it"]),
    "in a disabled-by-default block": ({"flops_profiler": {"enabled": True, "profile_stp": 3}},
                                       ["unknown key flops_profiler.profile_stp (did you mean profile_step?)"]),
    "in zero_optimization": ({"zero_optimization": {"stage": 1, "reduce_bucket_sise": 5}},
                             ["unknown key zero_optimization.reduce_bucket_sise (did you mean reduce_bucket_size?)",
                              "refuses it"]),
    "two levels down": ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memroy": 1}}},
                        ["unknown key zero_optimization.offload_optimizer.pin_memroy (did you mean pin_memory?)"]),
    "in a monitor": ({"tensorboard": {"enabled": False, "output_pth": "tb"}},
                     ["unknown key tensorboard.output_pth (did you mean output_path?)"]),
    "a wrong type": ({"zero_optimization": {"stage": 1, "overlap_comm": "sometimes"}},
                     ["zero_optimization.overlap_comm", "'sometimes'"]),
    "a removed block": ({"elasticity": {"enabled": True}}, ["refuses the ds_config", "elasticity"]),
}


@pytest.mark.parametrize("case", sorted(UNKNOWN_KEY_CASES))
def test_a_key_deepspeed_does_not_know_is_named_with_the_nearest(ds_file, case):
    config, words = UNKNOWN_KEY_CASES[case]
    path = ds_file(config)
    message = error(with_ds(path))
    assert path in message and "DeepSpeed 0." in message
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"


def test_every_key_deepspeed_reads_is_accepted(ds_file):
    """Many of DeepSpeed's blocks at once, and a disabled block's keys (which DeepSpeed does not read)."""
    config = {"train_batch_size": 2, "steps_per_print": 10, "wall_clock_breakdown": False, "gradient_clipping": 1.0,
              "zero_allow_untested_optimizer": True, "prescale_gradients": False, "communication_data_type": "fp32",
              "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                                    "overlap_comm": True, "contiguous_gradients": True, "round_robin_gradients": False},
              "bf16": {"enabled": True, "immediate_grad_update": True}, "data_types": {"grad_accum_dtype": "fp32"},
              "checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False},
              "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False, "number_checkpoints": None,
                                           "synchronize_checkpoint_boundary": False, "profile": False},
              "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1,
                                 "detailed": True, "output_file": None},
              "tensorboard": {"enabled": False, "output_path": "tb", "job_name": "run"},
              "comms_logger": {"enabled": False, "verbose": False, "prof_all": True, "debug": False},
              "data_efficiency": {"enabled": False, "data_routing": {"enabled": False, "random_ltd": {
                  "enabled": False, "total_layer_num": 24, "random_ltd_layer_num": 22}}},
              "curriculum_learning": {"enabled": False}}
    assert parse(with_ds(ds_file(config))).derived.ds_config["zero_optimization"]["overlap_comm"] is True


@pytest.mark.parametrize("name", sorted(name for name in os.listdir(EXAMPLES_DIR) if name.endswith(".json")))
def test_the_example_ds_configs_hold_only_known_keys(name):
    assert parse(with_ds(os.path.join(EXAMPLES_DIR, name)), cuda=True).derived.ds_config


def test_config_source_notices(ds_file, capsys):
    path = ds_file({})
    parse(["--deepspeed_config", path])
    assert sum("without --deepspeed" in n for n in printed_notices(capsys)) == 1
    parse()
    assert sum("built from the flags" in n for n in printed_notices(capsys)) == 1
    parse(with_ds(path))
    assert not [n for n in printed_notices(capsys) if "ds_config" in n or "deepspeed" in n]
    parsed = parse(["--deepscale", "--deepscale_config", ds_file({"train_batch_size": 4})])
    assert parsed.derived.global_batch_size == 4 and any("deprecated" in n for n in printed_notices(capsys))


class FakeMPU:
    """The data-parallel size DeepSpeedConfig asks for, without process groups."""

    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp

    def get_model_parallel_world_size(self):
        return 1

    def get_sequence_parallel_world_size(self):
        return 1

    def get_sequence_data_parallel_world_size(self):
        return self.dp


def test_deepspeed_reads_the_completed_config(ds_file, monkeypatch):
    from deepspeed.runtime import config as ds_runtime_config
    monkeypatch.setattr(ds_runtime_config.dist, "get_rank", lambda: 0)  # no process group: rank 0 of FakeMPU's DP
    derived = parse(with_ds(ds_file({"bf16": {"enabled": True}}), "--global-batch-size", "16", "--clip-grad", "0.5"),
                    env=world(2)).derived
    ds = ds_runtime_config.DeepSpeedConfig(derived.ds_config, mpu=FakeMPU(derived.data_parallel_size))
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (16, 2, 4)
    assert (ds.zero_optimization_stage, ds.grad_accum_dtype, ds.gradient_clipping) == (1, "fp32", 0.5)
    assert ds.bfloat16_config.enabled and not ds.float16_config.enabled


# ---- a BigScience tr11-style launch, scaled down -------------------------------------------------

TR11_DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 64, "gradient_clipping": 1.0,
                  "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "steps_per_print": 2000,
                  "wall_clock_breakdown": False}


def tr11_argv(tmp_path, ds_path):
    """tr11-176B-ml.slurm's flag blocks (GPT_ARGS, OUTPUT_ARGS, DATA_ARGS, DEEPSPEED_ARGS), tiny sizes."""
    train = tmp_path / "train-splits.txt"
    train.write_text('"train: 1 0:0.95 /data/en/en_text_document, 0.5 0:0.95 /data/fr/fr_text_document"\n')
    valid = tmp_path / "valid-splits.txt"
    valid.write_text('"valid-en: 1 0.95:1 /data/en/en_text_document" "valid-fr: 1 0.95:1 /data/fr/fr_text_document"\n')
    gpt_args = ["--pp-partition-method", "type:transformer|embedding", "--num-layers", "4", "--hidden-size", "64",
                "--pad-vocab-size-to", "250880", "--num-attention-heads", "4", "--seq-length", "64",
                "--max-position-embeddings", "64", "--micro-batch-size", "2", "--rampup-batch-size", "16", "16",
                "2_000", "--global-batch-size", "64", "--train-samples", "220_000_000", "--tokenizer-type",
                "PretrainedFromHF", "--tokenizer-name-or-path", "/tokenizers/bloom", "--init-method-std", "0.0048",
                "--embed-layernorm", "--sync-tp-duplicated-parameters", "--bf16", "--seed", "42",
                "--position-embedding-type", "alibi",
                "--checkpoint-activations", "--abort-on-unmet-fused-kernel-constraints", "--kill-switch-path",
                str(tmp_path / "kill-switch"), "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                "--adam-eps", "1e-8", "--lr", "6e-5", "--min-lr", "6e-6", "--lr-decay-style", "cosine",
                "--lr-decay-samples", "200_000_000", "--lr-warmup-samples", "216_320", "--clip-grad", "1.0",
                "--weight-decay", "1e-1"]
    output_args = ["--log-interval", "1", "--save-interval", "100", "--eval-interval", "1000", "--eval-iters", "1",
                   "--tensorboard-dir", str(tmp_path / "tb"), "--tensorboard-queue-size", "5",
                   "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
                   "--log-validation-ppl-to-tensorboard"]
    data_args = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
                 "--train-weighted-split-paths-path", str(train), "--valid-weighted-split-paths-path", str(valid),
                 "--data-impl", "mmap", "--num-workers", "2", "--valid-num-workers", "0"]
    deepspeed_args = ["--deepspeed", "--deepspeed_config", ds_path, "--zero-stage", "0",
                      "--deepspeed-activation-checkpointing"]
    launcher_args = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                     "--distributed-backend", "nccl", "--exit-duration-in-mins", "5990",
                     "--log-level", "info", "--log-level-replica", "error"]
    return gpt_args + output_args + data_args + deepspeed_args + launcher_args


def test_tr11_style_arguments_parse(tmp_path, ds_file, capsys):
    parsed = parse_args(tr11_argv(tmp_path, ds_file(TR11_DS_CONFIG)), env=world(8), cuda_available=False)
    flags, derived = parsed.flags, parsed.derived
    assert (derived.launch.world_size, derived.data_parallel_size, derived.global_batch_size) == (8, 2, 64)
    assert flags.rampup_batch_size == [16, 16, 2000] and flags.train_samples == 220_000_000
    assert (flags.position_embedding_type, flags.pad_vocab_size_to, flags.embed_layernorm) == ("alibi", 250880, True)
    assert derived.bf16 and derived.zero_stage == 1 and derived.distributed_backend == "gloo"
    assert flags.valid_num_workers == 0 and flags.exit_duration_in_mins == 5990
    notices = printed_notices(capsys)
    assert any("stage 0 -> 1" in n for n in notices) and any("using gloo" in n for n in notices)
    assert not any("gradient_clipping" in n for n in notices)


@pytest.mark.parametrize("refused", [["--reset-progress"]])
def test_tr11_style_arguments_with_refused_flags(tmp_path, ds_file, refused):
    argv_tr11 = tr11_argv(tmp_path, ds_file(TR11_DS_CONFIG)) + refused
    with pytest.raises(ArgumentError, match="not available yet"):
        parse_args(argv_tr11, env=world(8), cuda_available=False)


def test_tr11_style_arguments_resume_universal_checkpoints(tmp_path, ds_file):
    """tr11's bf16 at ZeRO stage 0 runs at stage 1, where a universal checkpoint can be restored."""
    argv_tr11 = tr11_argv(tmp_path, ds_file(TR11_DS_CONFIG)) + ["--universal-checkpoint"]
    derived = parse_args(argv_tr11, env=world(8), cuda_available=False).derived
    assert derived.ds_config["checkpoint"] == {"load_universal": True} and derived.zero_stage == 1


# ---- --help --------------------------------------------------------------------------------------

def help_sections():
    """{group title: its part of --help}, split at the group headings."""
    sections, title = {}, None
    for line in build_parser().format_help().splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = ""
        elif title is not None:
            sections[title] += line + "\n"
    return sections


def test_help_puts_flags_in_their_groups():
    sections = help_sections()
    assert "--kill-switch-path" in sections["training"] and "--exit-interval" in sections["training"]
    assert "--log-level " in sections["logging"] and "--log-level-replica" in sections["logging"]
    assert "--kill-switch-path" not in sections["network size"] and "--log-level" not in sections["network size"]


def test_help_shows_the_defaults_worth_showing():
    text = " ".join(build_parser().format_help().split())
    for shown in ("(default: 128)", "(default: 1234)", "(default: 0.01)", "(default: linear)", "(default: infer)"):
        assert shown in text
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: True)" not in text


@pytest.mark.parametrize("zero, extra, words", [
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, [], ["offload_optimizer.device \"nvme\"", "NVMe"]),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, [], ["offload_param.device \"nvme\"", "NVMe"]),
    ({"stage": 2, "offload_optimizer": {"device": "disk"}}, [], ["offload_optimizer.device 'disk'", '"cpu"']),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, [], ["offload_optimizer", "stage 1, 2 or 3"]),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, ["--optimizer", "sgd"], ["CPU Adam", "--optimizer adam"]),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, [], ["offload_param", "ZeRO-3"]),
])
def test_offload_settings_that_cannot_run_are_refused(ds_file, zero, extra, words):
    message = error(with_ds(ds_file({"zero_optimization": zero}), *extra))
    assert all(word in message for word in words), message


def test_cpu_offload_is_accepted_at_zero_1_2_and_3(ds_file):
    for stage in (1, 2, 3):
        parsed = parse(with_ds(ds_file({"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}})))
        assert parsed.derived.ds_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    zero = {"stage": 3, "offload_param": {"device": "cpu"}}
    parsed = parse(with_ds(ds_file({"zero_optimization": zero})))
    assert parsed.derived.ds_config["zero_optimization"]["offload_param"] == {"device": "cpu"}


def test_microsoft_offload_flags_are_ds_config_keys(ds_file):
    zero = parse(with_ds(ds_file({"zero_optimization": {"stage": 3}}), "--remote-device", "cpu", "--use-pin-memory",
                         "--cpu-optimizer", "--cpu_torch_adam")).derived.ds_config
    assert zero["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert zero["zero_force_ds_cpu_optimizer"] is False
    only_optimizer = parse(with_ds(ds_file({"zero_optimization": {"stage": 1}}), "--cpu-optimizer")).derived.ds_config
    assert only_optimizer["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert "zero_force_ds_cpu_optimizer" not in only_optimizer


@pytest.mark.parametrize("zero, extra, words", [
    ({"stage": 3}, ["--remote-device", "nvme"], ["offload_param.device \"nvme\"", "NVMe"]),
    ({"stage": 2}, ["--remote-device", "cpu"], ["offload_param", "ZeRO-3"]),
    ({"stage": 3, "offload_param": {"device": "none"}}, ["--remote-device", "cpu"], ["--remote-device", '"none"']),
    ({"stage": 3}, ["--use-pin-memory"], ["--use-pin-memory", "--remote-device cpu"]),
    ({"stage": 2}, ["--cpu_torch_adam"], ["--cpu_torch_adam", "--cpu-optimizer"]),
])
def test_microsoft_offload_flags_that_cannot_run_are_refused(ds_file, zero, extra, words):
    message = error(with_ds(ds_file({"zero_optimization": zero}), *extra))
    assert all(word in message for word in words), message


def test_zero_3_checkpoints_need_the_engines_replacements(ds_file, tmp_path, monkeypatch):
    import deepspeed

    from megatron.training.engine import replacements

    flags = with_ds(ds_file({"zero_optimization": {"stage": 3}}), "--save", str(tmp_path / "ckpt"),
                    "--save-interval", "10", "--allow-untested-deepspeed")
    assert parse(flags).derived.zero_stage == 3
    try:
        with monkeypatch.context() as patched:
            patched.setattr(deepspeed, "__version__", "0.16.4")
            message = error(flags)
        assert "--save at ZeRO stage 3" in message and "checkpoint_io.zero3_model_states" in message
    finally:
        replacements.check_deepspeed(False)


# ---- --sequence-parallel -------------------------------------------------------------------------

def model_config_error(extra, env):
    with pytest.raises(ArgumentError) as info:
        build_config(parse(extra, env=env), tokenizer_vocab_size=1000)
    return str(info.value)


def test_sequence_parallel_needs_tp_and_whole_blocks_of_the_sequence(ds_file):
    tp2 = ["--tensor-model-parallel-size", "2"]
    assert build_config(parse(tp2 + ["--sequence-parallel"], env=world(2)), tokenizer_vocab_size=1000).model \
        .sequence_parallel
    assert not build_config(parse(["--sequence-parallel"]), tokenizer_vocab_size=1000).model.sequence_parallel
    message = model_config_error(tp2 + ["--sequence-parallel", "--seq-length", "31"], world(2))
    assert "--seq-length" in message and "--tensor-model-parallel-size" in message
    message = model_config_error(tp2 + ["--sequence-parallel", "--checkpoint-activations", "--partition-activations"],
                                 world(2))
    assert "--sequence-parallel" in message and "--partition-activations" in message
    # the pipeline engine must not cut activations into TP shares: each TP rank's block is its own
    pp2 = tp2 + ["--pipeline-model-parallel-size", "2", "--sequence-parallel"]
    assert parse(pp2, env=world(4)).derived.ds_config["pipeline"] == {"pipe_partitioned": False,
                                                                      "grad_partitioned": False}
    assert "pipeline" not in parse(tp2 + ["--pipeline-model-parallel-size", "2"], env=world(4)).derived.ds_config
    message = error(with_ds(ds_file({"pipeline": {"pipe_partitioned": True}}), *pp2), env=world(4))
    assert "pipeline.pipe_partitioned" in message and "set it to false" in message


def test_tp_comm_overlap_needs_sequence_parallelism():
    tp2 = ["--tensor-model-parallel-size", "2"]
    config = build_config(parse(tp2 + ["--sequence-parallel", "--tp-comm-overlap"], env=world(2)),
                          tokenizer_vocab_size=1000)
    assert config.model.tp_comm_overlap and config.model.sequence_parallel
    message = model_config_error(tp2 + ["--tp-comm-overlap"], world(2))
    assert "--tp-comm-overlap" in message and "--sequence-parallel" in message
    assert not build_config(parse(["--tp-comm-overlap"]), tokenizer_vocab_size=1000).model.tp_comm_overlap  # TP 1


@pytest.mark.parametrize("method", ["flops", "type:transformer|embedding", "parameters", "uniform"])
def test_partition_methods_reach_the_config(method):
    parsed = parse(["--pp-partition-method", method, "--pipeline-model-parallel-size", "2"], env=world(2))
    assert build_config(parsed, tokenizer_vocab_size=1000).parallel.pp_partition_method == method
