"""Flags of Megatron-LM and of Microsoft's Megatron-DeepSpeed: each is accepted or answered with its reason.

The two flag lists in tests/training/data/ were taken from those projects' parsers (the header line of
each names the repository and commit); each line is a flag and a sample value.
"""
import os

import pytest

from megatron.training.argument_foreign_flags import (FOREIGN_ALIASES, FOREIGN_NO_OPS, FOREIGN_REFUSALS,
                                                      FOREIGN_SETTINGS, FOREIGN_VALUE_FLAGS)
from megatron.training.argument_groups import ARGUMENT_GROUPS
from megatron.training.argument_rejections import REJECTED_FLAGS
from megatron.training.arguments import ArgumentError, build_parser, explicit_dests
from megatron.training.argument_types import ErrorRaisingParser

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
FLAG_LISTS = {"NVIDIA/Megatron-LM": "megatron_lm_flags.txt",
              "microsoft/Megatron-DeepSpeed": "microsoft_megatron_deepspeed_flags.txt"}
FOREIGN_ACCEPTED = {*FOREIGN_ALIASES, *FOREIGN_SETTINGS, *FOREIGN_NO_OPS, *FOREIGN_VALUE_FLAGS}
# A value our flag takes, for the aliases of flags that take one.
OUR_SAMPLE_VALUES = {"--layernorm-epsilon": ["1e-6"], "--kill-switch-path": ["/tmp/stop-now"]}


def read_flag_list(name):
    """(header line, [(flag, sample values)]) of one list in tests/training/data/."""
    with open(os.path.join(DATA_DIR, name)) as f:
        lines = f.read().splitlines()
    rows = [line.split() for line in lines if line.strip() and not line.startswith("#")]
    return lines[0], [(row[0], row[1:]) for row in rows]


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def parse(parser, words):
    """The parsed flags, or the ArgumentError's message."""
    try:
        return vars(parser.parse_args(words))
    except ArgumentError as error:
        return str(error)


@pytest.mark.parametrize("repository", sorted(FLAG_LISTS))
def test_every_flag_is_accepted_or_refused_by_name(parser, repository):
    header, flags = read_flag_list(FLAG_LISTS[repository])
    assert header.startswith(f"# {repository} at commit ") and len(flags) > 300
    unanswered = []
    for flag, values in flags:
        result = parse(parser, [flag, *values])
        if flag in REJECTED_FLAGS:
            if result != f"{flag}: {REJECTED_FLAGS[flag]}":
                unanswered.append((flag, result))
        elif isinstance(result, str) and (flag not in result or "unrecognized arguments" in result):
            unanswered.append((flag, result))
    assert not unanswered, f"{len(unanswered)} flags of {repository} not answered by name: {unanswered[:5]}"


def test_profile_with_microsofts_value_is_answered(parser):
    """--profile is Megatron-LM's switch; Microsoft Megatron-DeepSpeed's --profile pt|pt-full is answered by name."""
    assert parse(parser, ["--profile"])["profile"] is True
    assert parse(parser, [])["profile"] is False
    message = parse(parser, ["--profile", "pt-full"])
    assert message.startswith("argument --profile: takes no value here") and "--use-pytorch-profiler" in message


def test_the_table_names_only_flags_of_the_two_lists():
    listed = {flag for name in FLAG_LISTS.values() for flag, _ in read_flag_list(name)[1]}
    stale = sorted((set(FOREIGN_REFUSALS) | FOREIGN_ACCEPTED) - listed)
    assert not stale, f"entries of argument_foreign_flags.py that neither parser has: {stale}"
    assert not set(FOREIGN_REFUSALS) & FOREIGN_ACCEPTED


def test_no_entry_names_a_flag_of_our_own_groups():
    """A feature that lands in argument_groups.py takes its flag over: its table entry must go."""
    ours = ErrorRaisingParser()
    for add_group in ARGUMENT_GROUPS:
        add_group(ours)
    shadowed = sorted(flag for flag in {*REJECTED_FLAGS, *FOREIGN_ACCEPTED} if flag in ours._option_string_actions)
    assert not shadowed, f"remove these from argument_rejections.py / argument_foreign_flags.py: {shadowed}"


@pytest.mark.parametrize("alias, ours", sorted(FOREIGN_ALIASES.items()))
def test_alias_parses_to_our_flags_value(parser, alias, ours):
    values = OUR_SAMPLE_VALUES.get(ours, [])
    flags = parse(parser, [alias, *values])
    assert isinstance(flags, dict) and flags == parse(parser, [ours, *values]) != parse(parser, [])
    assert explicit_dests([alias, *values]) == explicit_dests([ours, *values])


def test_settings_set_our_flags_value(parser):
    assert parse(parser, ["--skip-train"]) == parse(parser, ["--eval-only", "true"])
    assert parse(parser, ["--skip-train"])["eval_only"] is True
    scaling = parse(parser, ["--no-query-key-layer-scaling", "--apply-query-key-layer-scaling"])
    assert scaling["apply_query_key_layer_scaling"] is True and scaling == parse(parser, [])
    assert explicit_dests(["--skip-train"]) == explicit_dests(["--eval-only"]) == {"eval_only"}


@pytest.mark.parametrize("flag", sorted(FOREIGN_NO_OPS))
def test_no_op_switch_changes_nothing(parser, flag):
    assert parse(parser, [flag]) == parse(parser, [])
    assert parse(parser, [flag, "--hidden-size", "64"]) == parse(parser, ["--hidden-size", "64"])


def test_value_flags_accept_only_what_this_trainer_does(parser):
    assert parse(parser, ["--transformer-impl", "local"]) == parse(parser, [])
    message = parse(parser, ["--transformer-impl", "transformer_engine"])
    assert message.startswith("--transformer-impl transformer_engine: Transformer Engine is not used")
    assert message.endswith("only --transformer-impl local is accepted")


def test_normalization_takes_both_spellings(parser):
    assert parse(parser, ["--normalization", "layernorm"]) == parse(parser, [])
    assert parse(parser, ["--normalization", "rmsnorm"])["normalization"] == "RMSNorm"
    assert parse(parser, ["--normalization", "RMSNorm"])["normalization"] == "RMSNorm"
    assert "must be one of LayerNorm, RMSNorm" in parse(parser, ["--normalization", "scalenorm"])


@pytest.mark.parametrize("flag, words", [
    ("--rotary-interleaved", ["two halves", "--use-rope-scaling"]),
    ("--rope-type", ["Llama 3's scaling"]),
    ("--fp8-param-gather", ["FP8", "planned", "--fp8-format"]),
    ("--fp8-hybrid", ["--fp8-format hybrid"]),
    ("--ds-sequence-parallel-fpdt-chunk-size", ["FPDT", "planned", "--ds-sequence-parallel-size"]),
    ("--use-distributed-optimizer", ["DeepSpeed", "zero_optimization.stage"]),
    ("--moe-router-topk", ["mixture-of-experts"]),
    ("--train-data-path", ["--train-weighted-split-paths"]),
    ("--iterations-to-skip", ["--skip-train-iteration-range"]),
])
def test_refusal_says_what_to_do(parser, flag, words):
    message = parse(parser, [flag, "2"])
    assert message.startswith(f"{flag}: ") and all(word in message for word in words)


def test_foreign_flags_are_hidden_from_help(parser):
    text = parser.format_help()
    assert not any(flag in text for flag in ("--use-flash-attn", "--norm-epsilon", "--moe-router-topk"))


@pytest.mark.parametrize("megatron_lm_name, ours", [("learned_absolute", "absolute"), ("rope", "rotary")])
def test_megatron_lm_position_embedding_names(parser, megatron_lm_name, ours):
    assert parse(parser, ["--position-embedding-type", megatron_lm_name])["position_embedding_type"] == ours
