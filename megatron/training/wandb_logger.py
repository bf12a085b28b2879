"""A Weights & Biases run beside TensorBoard (Megatron-LM's --wandb-project, --wandb-exp-name,
--wandb-save-dir), fed by tb_logger.TensorBoardLogger so both get the same tags and values.

W&B keeps one value per metric in a row of its history: the scalars TensorBoard writes at one iteration
go into one row with ``iteration`` (the x-axis of every chart, through ``define_metric``), and a
second value of a metric at the same iteration (the validation loss at the end of training) starts a
new row, so none is lost. The x-axes of TensorBoard's "vs samples", "vs tokens" and "vs gigaflos"
tags are logged as their own metrics (``x/samples``, ``x/tokens``, ``x/gigaflos (without
embeddings)``) to plot against.

The run is offline (files only, under ``{directory}/wandb``; ``wandb sync`` uploads them later) when
WANDB_MODE says so, and also when this machine has no W&B API key or cannot reach the W&B server
(compute nodes often have no network): a run that cannot upload must not hang or stop training.
"""
import netrc
import os
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_BASE_URL = "https://api.wandb.ai"
ITERATION = "iteration"
REACH_TIMEOUT_SECONDS = 3.0


@dataclass(frozen=True)
class WandbSettings:
    """project: --wandb-project; name: --wandb-exp-name (None: W&B names the run); directory: where the
    run files go (--wandb-save-dir, else the wandb/ directory in --save)."""

    project: str
    name: str | None
    directory: str


def offline_reason(env: Mapping[str, str]) -> str | None:
    """Why the run cannot upload from here (no API key, no route to the server), or None when it can."""
    url = urllib.parse.urlparse(env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    if not env.get("WANDB_API_KEY"):
        try:
            known = netrc.netrc().authenticators(host) is not None
        except (OSError, netrc.NetrcParseError):
            known = False
        if not known:
            return "no W&B API key (WANDB_API_KEY or wandb login)"
    try:
        socket.create_connection((host, port), timeout=REACH_TIMEOUT_SECONDS).close()
    except OSError:
        return f"the W&B server {host} cannot be reached"
    return None


class WandbRun:
    """One W&B run: scalars at an iteration, the configuration, finish."""

    def __init__(self, settings: WandbSettings, env: Mapping[str, str] | None = None):
        import wandb

        env = os.environ if env is None else env
        mode = env.get("WANDB_MODE")
        if mode is None:
            reason = offline_reason(env)
            mode = "offline" if reason else "online"
            if reason:
                print(f"> wandb: {reason}: the run is written offline under {settings.directory}/wandb; "
                      f"upload it with `wandb sync`", flush=True)
        os.makedirs(settings.directory, exist_ok=True)
        self.run = wandb.init(project=settings.project, name=settings.name, dir=settings.directory, mode=mode)
        self.run.define_metric(ITERATION)
        self.run.define_metric("*", step_metric=ITERATION)
        self.pending = {}

    def log(self, tag: str, value: float, iteration: int):
        """``tag`` = ``value`` at ``iteration``, in the row of that iteration's scalars."""
        if self.pending and (self.pending[ITERATION] != iteration or tag in self.pending):
            self.flush()
        self.pending[ITERATION] = iteration
        self.pending[tag] = value

    def log_axis(self, axis: str, value: float, iteration: int):
        """The x-axis ``x/{axis}`` (samples, tokens, gigaflos) of the row of ``iteration``: one value per
        iteration, given with each of its metrics."""
        if self.pending and self.pending[ITERATION] != iteration:
            self.flush()
        self.pending[ITERATION] = iteration
        self.pending[f"x/{axis}"] = value

    def update_config(self, configuration: Mapping[str, object]):
        self.run.config.update(dict(configuration), allow_val_change=True)

    def flush(self):
        if self.pending:
            self.run.log(self.pending)
            self.pending = {}

    def finish(self):
        self.flush()
        self.run.finish()
