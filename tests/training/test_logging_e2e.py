"""What a real run reports: Megatron-DeepSpeed's log line field by field, its validation and milestone
lines, and the TensorBoard event files read back with tensorboard's EventAccumulator (docs/logging.md).

One run: 2 processes as a 2-stage pipeline (the loss lives on the last stage, which is also the rank
that logs and writes TensorBoard), global batch 4 of 64 tokens, 4 iterations, a log line every 2
iterations (so the printed loss is an average of two), evaluation every 2 iterations, a checkpoint
at iteration 4, and Megatron-DeepSpeed's TensorBoard flags.
"""
import glob
import importlib.util
import json
import math
import os
import re

import pytest

from tests.dist_utils import free_port
from tests.training.e2e_utils import read_scalars, run_pretrain, tiny_gpt_flags

pytestmark = pytest.mark.distributed

GBS, SEQ, LAYERS, HIDDEN, PADDED_VOCAB, WORLD_SIZE, TRAIN_ITERS, LOG_INTERVAL = 4, 64, 2, 64, 1152, 2, 4, 2
HAS_WANDB = importlib.util.find_spec("wandb") is not None
NO_WANDB = "wandb is not installed (pip install wandb, or the 'wandb' extra)"

# Megatron-DeepSpeed's line (docs/logging.md), fp32 so no loss scale; DeepSpeed counts no zeros, so no
# "num zeros" either; then our model TFLOP/s (MFU only when a GPU peak was measured).
LOG_LINE = re.compile(
    r"^ iteration (?P<iteration>[ \d]{8})/(?P<train_iters>[ \d]{8}) \|"
    r" consumed samples: (?P<samples>[ \d]{12}) \|"
    r" consumed tokens: (?P<tokens>[ \d]{12}) \|"
    r" elapsed time per iteration \(s\): (?P<time>\d+\.\d{2}) \|"
    r" learning rate: (?P<lr>\d\.\d{3}E[-+]\d{2}) \|"
    r" global batch size: (?P<gbs>[ \d]{5}) \|"
    r" lm loss: (?P<loss>\d\.\d{6}E[-+]\d{2}) \|"
    r" grad norm: (?P<grad_norm>\d+\.\d{3}) \|"
    r" number of skipped iterations: (?P<skipped>[ \d]{3}) \|"
    r" number of nan iterations: (?P<nan>[ \d]{3}) \|"
    r" samples per second: (?P<sps>\d+\.\d{3}) \|"
    r" TFLOPs: (?P<tflops>\d+\.\d{2}) \|"
    r" model TFLOP/s: (?P<model_tflops>\d+\.\d{2}) \|"
    r" ETA: (?P<eta>\d+:\d\d:\d\d) \|$")
VALIDATION_LINE = re.compile(r"^(?P<prefix>validation loss at .+?) \| lm loss value: (?P<loss>\d\.\d{6}E[-+]\d{2}) \| "
                             r"lm loss PPL: (?P<ppl>\d\.\d{6}E[-+]\d{2}) \| $")


def megatron_deepspeed_tflops(iteration_time):
    """Megatron-DeepSpeed's estimate per GPU: 24·3·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) / (t·world·1e12)
    (24 without GLU, 3 passes without activation checkpointing)."""
    b, s, n, h, v = GBS, SEQ, LAYERS, HIDDEN, PADDED_VOCAB
    return 24 * 3 * b * s * n * h ** 2 * (1 + s / (6 * h) + v / (16 * n * h)) / (iteration_time * WORLD_SIZE * 1e12)


def model_tflops(iteration_time):
    """Model FLOPs per GPU (docs/architecture.md): 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)) / (t·world·1e12)."""
    b, s, n, h, v = GBS, SEQ, LAYERS, HIDDEN, PADDED_VOCAB
    return 72 * b * s * n * h ** 2 * (1 + s / (6 * h) + v / (12 * n * h)) / (iteration_time * WORLD_SIZE * 1e12)


@pytest.fixture(scope="module")
def wandb_dir(tmp_path_factory) -> str | None:
    """--wandb-save-dir of the logged run, when wandb is installed (the run then also logs to W&B)."""
    return str(tmp_path_factory.mktemp("wandb")) if HAS_WANDB else None


@pytest.fixture(scope="module")
def logged_run(e2e_data, tmp_path_factory, wandb_dir):
    """The run; with wandb installed it also logs to W&B, offline: no API key and an unreachable server
    (WANDB_MODE unset, so the trainer has to notice that itself), W&B's own files kept in the test's
    directories."""
    tensorboard_dir = str(tmp_path_factory.mktemp("tensorboard"))
    checkpoint_dir = str(tmp_path_factory.mktemp("checkpoints"))
    wandb_flags, env = [], None
    if wandb_dir:
        wandb_flags = ["--wandb-project", "tiny", "--wandb-exp-name", "logged-run", "--wandb-save-dir", wandb_dir]
        home = str(tmp_path_factory.mktemp("wandb_home"))
        env = {"WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}", "WANDB_CONFIG_DIR": home,
               "WANDB_CACHE_DIR": home, "WANDB_DATA_DIR": home}
    flags = tiny_gpt_flags(e2e_data, seq_length=SEQ) + [
        "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", str(GBS),
        "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3", "--pad-vocab-size-to", str(PADDED_VOCAB),
        "--log-interval", str(LOG_INTERVAL), "--eval-interval", "2", "--eval-iters", "2",
        "--tensorboard-dir", tensorboard_dir, "--tensorboard-queue-size", "5", "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--save", checkpoint_dir, "--save-interval", "4"] + wandb_flags
    with pytest.MonkeyPatch.context() as patch:
        for name in ("WANDB_MODE", "WANDB_API_KEY"):
            patch.delenv(name, raising=False)
        result = run_pretrain(flags, nproc=WORLD_SIZE, env=env)
    result.assert_ok()
    lines = [LOG_LINE.match(text) for text in result.output.splitlines() if text.startswith(" iteration ")]
    return result, lines, read_scalars(tensorboard_dir), tensorboard_dir, checkpoint_dir


def values(scalars, tag):
    return [value for _, value in scalars[tag]]


def test_log_line_has_megatron_deepspeeds_fields_in_its_format(logged_run):
    _, lines, _, _, _ = logged_run
    assert len(lines) == TRAIN_ITERS // LOG_INTERVAL and all(lines), "a log line does not match Megatron-DeepSpeed's format"
    for match, iteration in zip(lines, (2, 4)):
        assert int(match["iteration"]) == iteration and int(match["train_iters"]) == TRAIN_ITERS
        assert int(match["samples"]) == GBS * iteration and int(match["tokens"]) == GBS * SEQ * iteration
        assert int(match["gbs"]) == GBS
        assert int(match["skipped"]) == 0 and int(match["nan"]) == 0
    # Linear decay to 0 over 4 x 4 samples, no warmup: lr = 1e-3·(1 - n/16) after n samples.
    assert [match["lr"] for match in lines] == ["5.000E-04", "0.000E+00"]


def test_log_line_loss_is_the_interval_average_and_grad_norm_the_last_iteration(logged_run):
    _, lines, scalars, _, _ = logged_run
    losses = values(scalars, "lm-loss-training/lm loss")  # this iteration's loss, iterations 1..4
    for match, (first, second) in zip(lines, ((0, 1), (2, 3))):
        assert float(match["loss"]) == pytest.approx((losses[first] + losses[second]) / 2, rel=1e-6)
        assert float(match["grad_norm"]) == pytest.approx(values(scalars, "grad-norm/grad-norm")[second], abs=6e-4)


def test_tensorboard_has_megatron_deepspeeds_tags(logged_run):
    _, _, scalars, _, _ = logged_run
    with_axes = {tag + suffix for tag, suffixes in {
        "learning-rate/learning-rate": ("", " vs samples", " vs tokens"),
        "batch-size/batch-size": ("", " vs samples"),
        "lm-loss-training/lm loss": ("", " vs samples", " vs tokens", " vs gigaflos (without embeddings)"),
        "grad-norm/grad-norm": ("", " vs samples", " vs tokens"),
        "iteration-time/iteration-time": ("", " vs samples", " vs tokens"),
        "lm-loss-validation/lm loss validation": ("", " vs samples", " vs tokens",
                                                  " vs gigaflos (without embeddings)"),
        "lm-loss-validation/lm loss validation ppl": ("", " vs samples", " vs tokens",
                                                      " vs gigaflos (without embeddings)"),
    }.items() for suffix in suffixes}
    expected = with_axes | {
        "steps-vs-samples/y=steps,x=samples", "steps-vs-samples/y=samples,x=steps",
        "steps-vs-tokens/y=steps,x=tokens", "steps-vs-tokens/y=tokens,x=steps",
        "iteration-time/samples per second", "iteration-time/samples per second per replica",
        "iteration-time/tokens per second", "iteration-time/tokens per second per replica",
        "iteration-time/TFLOPs per gpu (estimated)", "iteration-time/world_size", "time/train-step-time"}
    missing = expected - set(scalars)
    assert not missing, f"missing TensorBoard tags: {sorted(missing)}"
    assert not [tag for tag in scalars if tag.startswith("loss-scale/")], "loss scale written without --fp16"
    assert scalars["iteration-time/world_size"] == [(0, WORLD_SIZE)]


def test_vs_samples_and_vs_tokens_series_step_on_consumed_samples_and_tokens(logged_run):
    _, _, scalars, _, _ = logged_run
    iterations = [step for step, _ in scalars["lm-loss-training/lm loss"]]
    assert iterations == [1, 2, 3, 4]
    samples = {it: GBS * it for it in iterations}
    tokens = {it: GBS * SEQ * it for it in iterations}
    assert scalars["steps-vs-samples/y=samples,x=steps"] == [(it, samples[it]) for it in iterations]
    assert scalars["steps-vs-samples/y=steps,x=samples"] == [(samples[it], it) for it in iterations]
    assert scalars["steps-vs-tokens/y=tokens,x=steps"] == [(it, tokens[it]) for it in iterations]
    assert scalars["steps-vs-tokens/y=steps,x=tokens"] == [(tokens[it], it) for it in iterations]
    for tag in ("lm-loss-training/lm loss", "learning-rate/learning-rate", "grad-norm/grad-norm",
                "iteration-time/iteration-time", "lm-loss-validation/lm loss validation"):
        by_iteration = scalars[tag]
        assert scalars[f"{tag} vs samples"] == [(samples[it], value) for it, value in by_iteration], tag
        assert scalars[f"{tag} vs tokens"] == [(tokens[it], value) for it, value in by_iteration], tag
    assert scalars["batch-size/batch-size vs samples"] == [(samples[it], GBS) for it in iterations]


def test_tflops_and_rates_recomputed_from_the_logged_iteration_time(logged_run):
    _, lines, scalars, _, _ = logged_run
    times = scalars["iteration-time/iteration-time"]
    assert [step for step, _ in times] == [2, 4]
    for (step, seconds), match in zip(times, lines):
        assert float(match["time"]) == pytest.approx(seconds, abs=0.005 + 1e-6)
        tflops = dict(scalars["iteration-time/TFLOPs per gpu (estimated)"])[step]
        assert tflops == pytest.approx(megatron_deepspeed_tflops(seconds), rel=1e-5)
        assert float(match["tflops"]) == pytest.approx(megatron_deepspeed_tflops(seconds), abs=0.005 + 1e-6)
        assert dict(scalars["iteration-time/model TFLOP/s per gpu"])[step] == pytest.approx(model_tflops(seconds),
                                                                                          rel=1e-5)
        assert float(match["model_tflops"]) == pytest.approx(model_tflops(seconds), abs=0.005 + 1e-6)
        samples_per_second = GBS / seconds
        assert float(match["sps"]) == pytest.approx(samples_per_second, abs=6e-4 + 1e-5 * samples_per_second)
        assert dict(scalars["iteration-time/samples per second"])[step] == pytest.approx(samples_per_second, rel=1e-5)
        assert dict(scalars["iteration-time/tokens per second"])[step] == pytest.approx(samples_per_second * SEQ,
                                                                                        rel=1e-5)


def test_validation_lines_and_scalars(logged_run):
    result, _, scalars, _, _ = logged_run
    output_lines = result.output.splitlines()
    found = [(index, VALIDATION_LINE.match(text)) for index, text in enumerate(output_lines)
             if VALIDATION_LINE.match(text)]
    prefixes = [match["prefix"] for _, match in found]
    assert prefixes == ["validation loss at iteration 2", "validation loss at iteration 4",
                        "validation loss at the end of training for val data",
                        "validation loss at the end of training for test data"]
    for index, match in found:
        dashes = "-" * (len(output_lines[index]) + 1)
        assert output_lines[index - 1] == dashes and output_lines[index + 1] == dashes
        assert float(match["ppl"]) == pytest.approx(math.exp(float(match["loss"])), rel=2e-6)
    # Every validation goes to the validation tag at its iteration, the test set to its own tag.
    logged = [(step, value) for step, value in scalars["lm-loss-validation/lm loss validation"]]
    assert [step for step, _ in logged] == [2, 4, 4]
    assert [value for _, value in logged] == pytest.approx([float(m["loss"]) for _, m in found[:3]], rel=1e-6)
    assert values(scalars, "lm-loss-validation/lm loss validation ppl") == \
        pytest.approx([math.exp(value) for _, value in logged], rel=1e-5)
    assert scalars["lm-loss-test/lm loss test"] == [(4, pytest.approx(float(found[3][1]["loss"]), rel=1e-6))]


def test_milestone_lines(logged_run):
    result, _, _, _, checkpoint_dir = logged_run
    output = result.output
    for pattern in (r"^time to initialize megatron \(seconds\): \d+\.\d+$",
                    r"^\[after megatron is initialized\] datetime: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d $",
                    r"^estimated model parameters: [\d.e-]+$",
                    r"^setting training iterations to 4$",
                    r"^> building train, validation, and test datasets \.\.\.$",
                    r"^\[000-000\] \d\.\d{4}B / \d\.\d{4}B$", r"^\[000-001\] \d\.\d{4}B / \d\.\d{4}B$",
                    rf"^saving checkpoint at iteration       4 to {re.escape(checkpoint_dir)}$",
                    rf"^  successfully saved checkpoint at iteration       4 to {re.escape(checkpoint_dir)}$",
                    r"^\[Rank 1\] \(after 2 iterations\) memory \(MB\) \| "):
        assert re.search(pattern, output, re.MULTILINE), f"no line matching {pattern!r}"


def test_one_events_file_per_run(logged_run):
    _, _, _, tensorboard_dir, _ = logged_run
    assert len(glob.glob(os.path.join(tensorboard_dir, "events.out.tfevents.*"))) == 1


def test_eta_is_the_time_left_at_the_interval_speed(logged_run):
    _, lines, _, _, _ = logged_run
    for match in lines:
        left = (TRAIN_ITERS - int(match["iteration"])) * float(match["time"])
        hours, minutes, seconds = (int(part) for part in match["eta"].split(":"))
        assert abs(hours * 3600 + minutes * 60 + seconds - left) <= 0.5 + 0.005 * (TRAIN_ITERS - int(match["iteration"]))
    assert lines[-1]["eta"] == "0:00:00"


def test_summary_gives_the_last_losses_and_the_throughput(logged_run):
    result, lines, scalars, _, _ = logged_run
    summary = [line for line in result.output.splitlines() if line.startswith(" training summary |")]
    assert len(summary) == 3, summary
    fields = dict(re.findall(r" ([a-zA-Z][a-zA-Z /]*?): ([^|]+?) \|", " ".join(summary)))
    assert fields["iterations"] == f"{TRAIN_ITERS} ({TRAIN_ITERS} in this run)"
    assert int(fields["consumed samples"]) == GBS * TRAIN_ITERS and int(fields["consumed tokens"]) == GBS * SEQ * TRAIN_ITERS
    assert float(fields["train lm loss"]) == pytest.approx(float(lines[-1]["loss"]), rel=1e-6)
    validation = [line for line in result.output.splitlines() if "end of training for val data" in line][0]
    assert float(fields["validation lm loss"]) == pytest.approx(float(validation.split("value: ")[1].split()[0]), rel=1e-6)
    assert float(fields["test lm loss"]) == pytest.approx(scalars["lm-loss-test/lm loss test"][0][1], rel=1e-5)
    # The interval times at full precision (the log line rounds them to 10 ms, a third of an iteration here).
    samples_per_second = dict(scalars["iteration-time/samples per second"])
    seconds = sum(LOG_INTERVAL * GBS / samples_per_second[int(match["iteration"])] for match in lines)
    assert float(fields["samples per second"]) == pytest.approx(GBS * TRAIN_ITERS / seconds, rel=1e-3)
    assert float(fields["model TFLOP/s per GPU"]) == pytest.approx(model_tflops(seconds / TRAIN_ITERS), rel=1e-3)


# ---- Weights & Biases: the same scalars, read back from the offline run's transaction log -------------------

WANDB_LOG_BLOCK = 32768  # the .wandb file is a LevelDB-format log of wandb_internal_pb2.Record messages


def wandb_records(path: str) -> list:
    """The records of an offline run's .wandb file: after a 7-byte header (":W&B", magic, version), chunks
    of [crc32c (4), length (2, little-endian), type (1: whole, 2: first, 3: middle, 4: last)] + data that
    never cross a 32 KiB block (a block's last < 7 bytes are padding). ``wandb sync`` uploads these."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, pending, records = 7, b"", []
    while position + 7 <= len(data):
        if WANDB_LOG_BLOCK - position % WANDB_LOG_BLOCK < 7:
            position += WANDB_LOG_BLOCK - position % WANDB_LOG_BLOCK
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records) -> list[dict[str, float]]:
    """The rows of the history records, in order."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]


@pytest.fixture(scope="module")
def wandb_run(logged_run, wandb_dir):
    if not HAS_WANDB:
        pytest.skip(NO_WANDB)
    runs = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*"))
    assert len(runs) == 1, f"one rank writes one run, found {runs}"
    (log,) = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    return wandb_records(log)


def test_wandb_runs_offline_from_the_rank_that_writes_tensorboard(logged_run, wandb_run, wandb_dir):
    result = logged_run[0]
    noticed = [line for line in result.output.splitlines() if "the run is written offline" in line]
    assert len(noticed) == 1 and "no W&B API key" in noticed[0] and wandb_dir in noticed[0], noticed
    (run,) = [record.run for record in wandb_run if record.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("tiny", "logged-run")
    config = {item.key: json.loads(item.value_json) for record in wandb_run
              if record.WhichOneof("record_type") == "config" for item in record.config.update}
    assert config["model.num_layers"] == LAYERS and config["logging.wandb_project"] == "tiny"


def test_wandb_has_tensorboards_scalars(logged_run, wandb_run):
    """Every scalar TensorBoard has against the iteration, W&B has in the rows of that iteration, value for
    value (a second value at one iteration, the end-of-training validation, in a row of its own); every
    "vs samples/tokens/gigaflos" series is W&B's metric against its x/samples, x/tokens, x/gigaflos."""
    scalars, rows = logged_run[2], wandb_history(wandb_run)
    axis_only = {"steps-vs-samples/y=steps,x=samples": "steps-vs-samples/y=samples,x=steps",
                 "steps-vs-tokens/y=steps,x=tokens": "steps-vs-tokens/y=tokens,x=steps"}
    for tag, series in scalars.items():
        if tag in axis_only:
            expected = [(row[axis_only[tag]], row["iteration"]) for row in rows if axis_only[tag] in row]
        elif " vs " in tag:
            base, axis = tag.split(" vs ")
            expected = [(int(row[f"x/{axis}"]), row[base]) for row in rows if base in row]
        else:
            expected = [(row["iteration"], row[tag]) for row in rows if tag in row]
        assert [step for step, _ in series] == [step for step, _ in expected], tag
        assert [value for _, value in series] == pytest.approx([value for _, value in expected], rel=1e-6), tag
    logged = {tag for row in rows for tag in row if not tag.startswith(("_", "x/")) and tag != "iteration"}
    assert logged == {tag for tag in scalars if " vs " not in tag and tag not in axis_only}
    assert len(rows) > 4 and [row["iteration"] for row in rows] == sorted(row["iteration"] for row in rows)
