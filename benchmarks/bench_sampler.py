"""Sampler benchmark: a step's sampling at gpt-oss's vocabulary (201,088 float32 logits a row).

For each batch size, the time of `Sampler.sample` (queueing the work and the ids' copy to the
host, up to the ids on the device; CUDA events around each call, so host time shows where it is
the longer) for:
    greedy      temperature 0: the argmax kernels
    race        temperature 1, nothing truncated (the API's defaults): the one-pass race kernel
    torch ops   the same rows through torch (`Sampler(race=False)`): scale, softmax, noise, argmax
    top_k 40, top_p 0.9   temperature 1 and a truncation: its cut from the best 1,024 candidates
                (a full sort where they cannot settle it: top_p on these random logits, flatter
                than a model's), then the race above it, or the torch ops
beside the time one read of the logits takes at the copy bandwidth measured in the same process.

    python3 benchmarks/bench_sampler.py [--batches 1,64,256,512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from copy_bandwidth import copy_bandwidth  # noqa: E402  (benchmarks/, the script's folder)
from cuda_timing import time_events  # noqa: E402

from inference.request import SamplingParams  # noqa: E402
from inference.sample.sampler import Sampler  # noqa: E402

VOCAB = 201_088
MODES = {
    "greedy": (Sampler(), SamplingParams(temperature=0)),
    "race": (Sampler(), SamplingParams()),
    "torch ops": (Sampler(race=False), SamplingParams()),
    "top_k 40 race": (Sampler(), SamplingParams(top_k=40)),
    "top_k 40 torch ops": (Sampler(race=False), SamplingParams(top_k=40)),
    "top_p 0.9 race": (Sampler(), SamplingParams(top_p=0.9)),
    "top_p 0.9 torch ops": (Sampler(race=False), SamplingParams(top_p=0.9)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256,512")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", type=Path, help="write all results here")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print(f"| batch | one read of the logits | {' | '.join(MODES)} |")
    print("| ---: | ---: |" + " ---: |" * len(MODES))
    rows = []
    for n in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(n, VOCAB, device="cuda") * 3
        read_s = n * VOCAB * 4 / (bandwidth / 2)  # the copy moves each byte twice (read + write)
        row = dict(batch=n, read_s=read_s)
        for mode, (sampler, params) in MODES.items():
            history = [[] for _ in range(n)]

            def step(sampler=sampler, params=params, history=history, logits=logits):
                sampler.sample(logits, [params] * n, history, [None] * n).tokens

            row[mode] = time_events(step, reps=args.reps)
        rows.append(row)
        cells = " | ".join(f"{row[m] * 1e3:.3f} ms" for m in MODES)
        print(f"| {n} | {read_s * 1e3:.3f} ms | {cells} |", flush=True)
        del logits
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), bandwidth=bandwidth, rows=rows)))


if __name__ == "__main__":
    main()
