"""The figures of tests/gpu/run_bnb_adam.sh: 8-bit against 32-bit AdamW on the 125M GPT.

    python tests/gpu/bnb_adam_report.py --logs OUT --checkpoints WORK --save-at 150

For adam32 and bnb8: the loss every 10 iterations and the mean of the last 5 logged losses, the
optimizer state held on the GPU (the bytes of the state tensors of the base optimizer in the
checkpoint at --save-at: Adam's moments, and for 8-bit their codes, block maxima and code books; the
fp32 master weights, the same for both, are not counted), the peak memory line and the step time
(mean of the logged intervals after the first). For bnb8_resumed: its losses against bnb8's after
--save-at: a lost 8-bit state would restart Adam's moments and move them far more than --resume-rtol
(bitwise equal under --deterministic). Exits 1 when bnb8 or bnb8_resumed logged nothing or the resumed
losses differ by more than --resume-rtol; adam32 is compared when its log is there.
"""
import argparse
import glob
import os
import re
import sys

import torch

from megatron.training.log_reader import iteration_records

MEMORY_LINE = re.compile(r"\[Rank 0\] \(after \d+ iterations\) memory \(MB\).*")


def state_bytes(checkpoint_dir: str, iteration: int) -> tuple[int, dict[str, int]]:
    """(bytes of the optimizer state tensors, bytes by dtype) in the iteration's optimizer file(s)."""
    total, by_dtype = 0, {}
    for path in glob.glob(os.path.join(checkpoint_dir, f"global_step{iteration}", "*optim_states.pt")):
        saved = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        stack = [saved["base_optimizer_state"]["state"]]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                stack.extend(item.values())
            elif torch.is_tensor(item):
                size = item.numel() * item.element_size()
                total += size
                by_dtype[str(item.dtype)] = by_dtype.get(str(item.dtype), 0) + size
    return total, by_dtype


def summarize(name: str, text: str, checkpoints: str, save_at: int) -> dict:
    records = iteration_records(text)
    losses = {record.iteration: record.number("lm loss") for record in records}
    times = [record.number("elapsed time per iteration (s)") for record in records[1:]]
    memory = MEMORY_LINE.search(text)
    summary = {"losses": losses, "step_time": sum(times) / len(times) if times else float("nan"),
               "memory": memory.group(0) if memory else "(no memory line)"}
    if os.path.isdir(os.path.join(checkpoints, name)):
        summary["state"] = state_bytes(os.path.join(checkpoints, name), save_at)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", required=True)
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--save-at", type=int, required=True)
    parser.add_argument("--resume-rtol", type=float, default=1e-4,
                        help="largest relative difference of the resumed losses (0: bitwise, with --deterministic)")
    args = parser.parse_args()
    runs = {}
    for name in ("adam32", "bnb8", "bnb8_resumed"):
        path = os.path.join(args.logs, f"{name}.log")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                runs[name] = summarize(name, f.read(), args.checkpoints, args.save_at)
    if not all(runs.get(name, {}).get("losses") for name in ("bnb8", "bnb8_resumed")):
        print("bnb8 or bnb8_resumed logged no iterations: see its log")
        return 1
    if "adam32" in runs:
        compare_with_32_bits(runs)
    bnb, resumed = runs["bnb8"], runs["bnb8_resumed"]
    after = {i: loss for i, loss in bnb["losses"].items() if i > args.save_at}
    differences = [abs(resumed["losses"][i] - loss) / abs(loss) if i in resumed["losses"] else float("inf")
                   for i, loss in after.items()]
    largest = max(differences, default=float("inf"))
    print(f"resumed from {args.save_at}: {len(resumed['losses'])} logged losses, largest relative difference from "
          f"bnb8's {largest:.2e} (allowed {args.resume_rtol:g})")
    return 0 if largest <= args.resume_rtol else 1


def compare_with_32_bits(runs: dict) -> None:
    adam, bnb = runs["adam32"], runs["bnb8"]
    print("iteration | adam32 loss | bnb8 loss | difference")
    for iteration in sorted(adam["losses"]):
        if iteration in bnb["losses"]:
            a, b = adam["losses"][iteration], bnb["losses"][iteration]
            print(f"{iteration:9d} | {a:11.4f} | {b:9.4f} | {b - a:+.4f}")
    for name in ("adam32", "bnb8"):
        losses = runs[name]["losses"]
        last = sorted(losses)[-5:]
        state, by_dtype = runs[name].get("state", (0, {}))
        dtypes = ", ".join(f"{dtype} {size / 2**20:.1f} MiB" for dtype, size in sorted(by_dtype.items()))
        print(f"{name}: final loss {losses[last[-1]]:.4f}, mean of the last 5 logged "
              f"{sum(losses[i] for i in last) / len(last):.4f}; optimizer state {state / 2**20:.1f} MiB ({dtypes}); "
              f"step time {runs[name]['step_time'] * 1000:.1f} ms; {runs[name]['memory']}")
    final = max(adam["losses"])
    print(f"final loss difference (bnb8 - adam32) at iteration {final}: {bnb['losses'][final] - adam['losses'][final]:+.4f}")

if __name__ == "__main__":
    sys.exit(main())
