"""AnnealingLR against hand-computed learning rates, its checkpoint state, and how DeepSpeed calls it."""
import math

import pytest
import torch

from megatron.training.lr_schedule import AnnealingLR, LRScheduleError


def make_optimizer():
    """Two parameter groups, so the test sees that every group gets the rate."""
    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [first]}, {"params": [second]}], lr=123.0)


def group_lrs(optimizer):
    return [group["lr"] for group in optimizer.param_groups]


def schedule(**overrides):
    settings = dict(max_lr=1.0, min_lr=0.1, warmup_steps=100, decay_steps=1100, decay_style="linear")
    settings.update(overrides)
    optimizer = make_optimizer()
    return AnnealingLR(optimizer, **settings), optimizer


def lrs_at(scheduler, sample_counts, tokens=None):
    """Step to each absolute sample count (and token count) and collect the rates."""
    rates = []
    for index, target in enumerate(sample_counts):
        token_num = None if tokens is None else tokens[index]
        scheduler.step(target - scheduler.num_steps, token_num)
        rates.append(scheduler.get_lr())
    return rates


@pytest.mark.parametrize("style, expected", [
    # W=100, D=1100, lr 1.0 -> 0.1. At 600: r = 0.5; at 350: r = 0.25.
    ("linear", [0.5, 1.0, 0.1 + 0.9 * 0.75, 0.55, 0.1, 0.1]),
    ("cosine", [0.5, 1.0, 0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1), 0.55, 0.1, 0.1]),
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
])
def test_sample_based_styles(style, expected):
    scheduler, optimizer = schedule(decay_style=style)
    assert group_lrs(optimizer) == [0.0, 0.0]  # the constructor sets step 0
    rates = lrs_at(scheduler, [50, 100, 350, 600, 1100, 1200])
    assert rates == pytest.approx(expected, rel=1e-12)
    assert group_lrs(optimizer) == [pytest.approx(expected[-1])] * 2


def test_iterations_converted_to_samples_by_the_caller():
    # --lr-warmup-iters 2, --lr-decay-iters 10 at GBS 8: W = 16, D = 80 samples; lr 1.0 -> 0.
    scheduler, optimizer = schedule(max_lr=1.0, min_lr=0.0, warmup_steps=2 * 8, decay_steps=10 * 8)
    rates = []
    for _ in range(11):
        scheduler.step(8)
        rates.append(optimizer.param_groups[0]["lr"])
    expected = [0.5, 1.0] + [1.0 - k / 8 for k in range(1, 9)] + [0.0]
    assert rates == pytest.approx(expected, abs=1e-12)


def test_warmup_fraction_gives_fractional_warmup_steps():
    # --lr-warmup-fraction 0.25 of D = 1000 samples: W = 250.0.
    scheduler, _ = schedule(min_lr=0.0, warmup_steps=0.25 * 1000, decay_steps=1000)
    assert lrs_at(scheduler, [125, 250, 625]) == pytest.approx([0.5, 1.0, 0.5])


def test_token_based_decay_starts_where_the_sample_warmup_ends():
    # W = 16 samples; 10 tokens per sample, tokens passed with Megatron-DeepSpeed's one-step lag.
    scheduler, _ = schedule(min_lr=0.0, warmup_steps=16, decay_steps=1000, decay_tokens=1000)
    rates = lrs_at(scheduler, [8, 16, 24, 32], tokens=[0, 80, 160, 1001])
    assert scheduler.warmup_tokens == 80
    assert rates == pytest.approx([0.5, 1.0, 1.0 - 80 / 920, 0.0])


def test_token_decay_records_warmup_tokens_when_the_warmup_is_not_a_batch_multiple():
    # W = 12 samples, steps of 8: the warmup ends at 16 samples; Megatron-DeepSpeed only recorded at n == W.
    scheduler, _ = schedule(min_lr=0.0, warmup_steps=12, decay_steps=1000, decay_tokens=1080)
    rates = lrs_at(scheduler, [8, 16, 24], tokens=[0, 80, 580])
    assert scheduler.warmup_tokens == 80
    assert rates == pytest.approx([8 / 12, 1.0, 0.5])


def test_token_decay_cosine_without_warmup():
    scheduler, _ = schedule(min_lr=0.0, warmup_steps=0, decay_steps=1000, decay_tokens=400, decay_style="cosine")
    assert lrs_at(scheduler, [8, 16], tokens=[100, 200]) == pytest.approx(
        [0.5 * (math.cos(math.pi / 4) + 1), 0.5])


def test_warmup_by_tokens_then_sample_decay():
    # Warmup ends when 100 tokens are consumed; the sample decay (D = 1000) counts from sample 0.
    scheduler, _ = schedule(min_lr=0.0, warmup_steps=0, decay_steps=1000, warmup_tokens=100)
    rates = lrs_at(scheduler, [8, 16, 24, 1001], tokens=[50, 100, 150, 5000])
    assert rates == pytest.approx([0.5, 1.0, 1.0 - 24 / 1000, 0.0])


def test_warmup_by_tokens_then_token_decay():
    scheduler, _ = schedule(min_lr=0.0, warmup_steps=0, decay_steps=1000, warmup_tokens=100, decay_tokens=1100)
    assert lrs_at(scheduler, [8, 16, 24], tokens=[25, 600, 1100]) == pytest.approx([0.25, 0.5, 0.0])


def test_inverse_square_root_in_samples():
    # lr = max(0.01, sqrt(100) / sqrt(n)) after the warmup, continuing past D = 1000.
    scheduler, _ = schedule(min_lr=0.01, warmup_steps=100, decay_steps=1000, decay_style="inverse-square-root")
    rates = lrs_at(scheduler, [50, 100, 400, 2500, 4_000_000])
    assert rates == pytest.approx([0.5, 1.0, 0.5, 0.2, 0.01])


def test_inverse_square_root_in_tokens():
    scheduler, _ = schedule(min_lr=0.0, warmup_steps=0, decay_steps=1000, decay_style="inverse-square-root",
                            warmup_tokens=100, decay_tokens=10 ** 6)
    assert lrs_at(scheduler, [8, 16, 24], tokens=[50, 100, 400]) == pytest.approx([0.5, 1.0, 0.5])


@pytest.mark.parametrize("overrides, message", [
    (dict(min_lr=-0.1), "--min-lr"),
    (dict(max_lr=0.05, min_lr=0.1), "--lr (0.05) must be >= --min-lr"),
    (dict(decay_steps=0, warmup_steps=0), "--lr-decay-samples"),
    (dict(warmup_steps=1100), "--lr-warmup-samples"),
    (dict(decay_style="exponential"), "--lr-decay-style"),
    (dict(decay_style="inverse-square-root", warmup_steps=0), "needs a warmup"),
    (dict(warmup_tokens=50), "one unit"),
    (dict(warmup_steps=0, warmup_tokens=500, decay_tokens=400), "--lr-warmup-tokens (500) must be smaller"),
    (dict(decay_tokens=0), "--lr-decay-tokens must be > 0"),
])
def test_invalid_settings_name_the_flags(overrides, message):
    with pytest.raises(LRScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        schedule(**overrides)


def test_token_schedule_without_tokens_is_refused():
    scheduler, _ = schedule(decay_tokens=1000)
    with pytest.raises(LRScheduleError, match="token_num"):
        scheduler.step(8)


# ---------------------------------------------------------------------------------------- state


def test_state_round_trip_continues_the_schedule():
    settings = dict(min_lr=0.0, warmup_steps=16, decay_steps=1000, decay_tokens=2000)
    original, _ = schedule(**settings)
    lrs_at(original, [8, 16, 24, 32], tokens=[0, 80, 160, 240])
    state = original.state_dict()
    assert set(state) >= {"max_lr", "warmup_steps", "num_steps", "warmup_tokens", "num_tokens", "decay_style",
                          "decay_steps", "min_lr"}
    resumed, optimizer = schedule(**settings)
    resumed.load_state_dict(state)
    assert (resumed.num_steps, resumed.num_tokens, resumed.warmup_tokens) == (32, 240, 80)
    assert group_lrs(optimizer) == [pytest.approx(original.get_lr())] * 2
    for target, tokens in [(40, 320), (48, 400)]:
        original.step(8, tokens)
        resumed.step(8, tokens)
        assert resumed.get_lr() == original.get_lr()


def test_loads_megatron_deepspeed_legacy_keys():
    resumed, optimizer = schedule(min_lr=0.0, warmup_steps=100, decay_steps=1100)
    resumed.load_state_dict({"start_lr": 1.0, "min_lr": 0.0, "warmup_iter": 100, "end_iter": 1100,
                             "decay_style": "linear", "num_iters": 600})
    assert resumed.num_steps == 600
    assert group_lrs(optimizer) == [pytest.approx(0.5)] * 2


@pytest.mark.parametrize("overrides, flag", [
    (dict(max_lr=2.0), "--lr)"),
    (dict(min_lr=0.2), "--min-lr"),
    (dict(warmup_steps=50), "--lr-warmup-samples"),
    (dict(decay_steps=2000), "--lr-decay-samples"),
    (dict(decay_style="cosine"), "--lr-decay-style"),
    (dict(decay_tokens=5000), "--lr-decay-tokens"),
])
def test_load_mismatch_names_the_flag_and_the_missing_overrides(overrides, flag):
    original, _ = schedule()
    original.step(200)
    changed, _ = schedule(**overrides)
    with pytest.raises(LRScheduleError) as raised:
        changed.load_state_dict(original.state_dict())
    message = str(raised.value)
    assert flag in message
    assert "--override-lr-scheduler" in message and "--use-checkpoint-lr-scheduler" in message


def test_override_keeps_the_flags_and_the_checkpoints_progress():
    # The checkpoint: lr 1.0 -> 0.1 linear, warmup 100 samples, decay to 1100, at 600 samples.
    original, _ = schedule()
    original.step(600)
    reports = []
    changed, optimizer = schedule(max_lr=2.0, decay_steps=2100, source="override", report=reports.append)
    changed.load_state_dict(original.state_dict())
    assert (changed.num_steps, changed.max_lr, changed.decay_steps) == (600, 2.0, 2100)
    # lr = 0.1 + (1 - (600 - 100) / (2100 - 100)) * (2.0 - 0.1) = 0.1 + 0.75 * 1.9
    assert group_lrs(optimizer) == [pytest.approx(0.1 + 0.75 * 1.9)] * 2
    assert len(reports) == 2 and all("--override-lr-scheduler" in line for line in reports)
    assert "learning rate: checkpoint 1.0, configured 2.0" in reports[0]


def test_use_checkpoint_takes_the_checkpoints_settings():
    original, _ = schedule()
    original.step(600)
    reports = []
    changed, optimizer = schedule(max_lr=2.0, min_lr=0.0, decay_style="cosine", source="checkpoint",
                                  report=reports.append)
    changed.load_state_dict(original.state_dict())
    assert (changed.max_lr, changed.min_lr, changed.decay_style, changed.num_steps) == (1.0, 0.1, "linear", 600)
    # the checkpoint's schedule: 0.1 + (1 - (600 - 100) / (1100 - 100)) * 0.9 = 0.55
    assert group_lrs(optimizer) == [pytest.approx(0.55)] * 2
    assert len(reports) == 3 and all("--use-checkpoint-lr-scheduler" in line for line in reports)


def test_load_mismatch_of_warmup_unit():
    original, _ = schedule(warmup_steps=0, warmup_tokens=100)
    original.step(8, 50)
    changed, _ = schedule(warmup_steps=0, warmup_tokens=200)
    with pytest.raises(LRScheduleError, match="token warmup: checkpoint 100, configured 200"):
        changed.load_state_dict(original.state_dict())
    by_samples, _ = schedule(warmup_steps=0)
    with pytest.raises(LRScheduleError, match="warmup unit: checkpoint tokens, configured samples"):
        by_samples.load_state_dict(original.state_dict())


# ---------------------------------------------------------------------------------------- DeepSpeed's calls


def deepspeed_style_step(scheduler, train_batch_size):
    """What deepspeed 0.19.8 ``engine._take_model_step`` does after an applied optimizer step."""
    try:
        scheduler.step(**{})
    except TypeError:
        scheduler.step(train_batch_size)


def test_bare_step_uses_the_providers():
    counters = {"gbs": 8, "tokens": 0}
    scheduler, optimizer = schedule(min_lr=0.0, warmup_steps=16, decay_steps=1000, decay_tokens=1000,
                                    increment_provider=lambda: counters["gbs"],
                                    token_provider=lambda: counters["tokens"])
    rates = []
    for _ in range(3):
        deepspeed_style_step(scheduler, train_batch_size=999)  # the providers win over the fallback
        counters["tokens"] += 8 * 10  # the trainer advances its counters after the step
        rates.append(optimizer.param_groups[0]["lr"])
    assert scheduler.num_steps == 24
    assert rates == pytest.approx([0.5, 1.0, 1.0 - 80 / 920])


def test_bare_step_without_provider_falls_back_to_deepspeeds_batch_size():
    scheduler, optimizer = schedule(min_lr=0.0, warmup_steps=16, decay_steps=80)
    with pytest.raises(TypeError, match="increment"):
        scheduler.step()
    deepspeed_style_step(scheduler, train_batch_size=8)
    assert scheduler.num_steps == 8
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)


def _deepspeed_engine(counters):
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = AnnealingLR(optimizer, max_lr=1.0, min_lr=0.0, warmup_steps=16, decay_steps=80,
                            decay_style="linear", increment_provider=lambda: counters["gbs"])
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10 ** 6}
    engine, _, _, engine_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                          config=config)
    assert engine_scheduler is scheduler
    return engine, scheduler


def _train_steps(engine, steps):
    rates = []
    for _ in range(steps):
        loss = engine(torch.ones(8, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        rates.append(engine.get_lr()[0])
    return rates


def _deepspeed_drives_the_schedule(rank, world_size, tmp_dir):
    counters = {"gbs": 8}
    engine, scheduler = _deepspeed_engine(counters)
    assert _train_steps(engine, 3) == pytest.approx([0.5, 1.0, 1.0 - 8 / 64])
    engine.save_checkpoint(tmp_dir, tag="step3")
    resumed, resumed_scheduler = _deepspeed_engine(counters)
    resumed.load_checkpoint(tmp_dir, tag="step3")
    assert resumed_scheduler.num_steps == 24
    counters["gbs"] = 16  # a rampup step: the engine's batch grows, the provider reports it
    resumed.set_train_batch_size(16)
    for _ in range(2):  # 2 micro batches of 8 per optimizer step
        loss = resumed(torch.ones(8, 4)).pow(2).mean()
        resumed.backward(loss)
        resumed.step()
    assert resumed_scheduler.num_steps == 40
    assert resumed.get_lr()[0] == pytest.approx(1.0 - 24 / 64)


@pytest.mark.distributed
def test_deepspeed_engine_steps_saves_and_loads_the_schedule(tmp_path):
    from tests.dist_utils import run_distributed
    run_distributed(_deepspeed_drives_the_schedule, 1, str(tmp_path))
