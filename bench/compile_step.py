"""``train.compile`` measured beside eager (issue 45 item 6): one local SGD step of a client, as
``run_local_training`` takes it (forward through ``algorithms.training.model_forward``, cross
entropy, backward, SGD step), eager and under each compile mode, with the compile time counted.

    python bench/compile_step.py                                  # CPU, 1 thread
    python bench/compile_step.py --device cuda --modes default,reduce-overhead

Per model and mode: the first step's seconds (Dynamo's trace and Inductor's build included), the
median of the next ``--steps`` steps in ms, the ratio to eager, and the steps after which the
compile has paid for itself (never, where a compiled step is not faster). Models: pfl's CIFAR CNN
(bench/pfl_cnn.py, 3 x 32 x 32) and HtCNN8's first member (1 x 28 x 28, FMNIST's shape), batch 10,
the size HtFLlib's and pfl's benchmarks step at. Prints the machine; ``--out`` writes JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from pfl_cnn import HIDDEN, pfl_cnn_layers  # noqa: E402

from htfl_dist.algorithms import training  # noqa: E402
from htfl_dist.models import SplitModel, build_model  # noqa: E402

MODELS = {
    "pfl_cnn": lambda: SplitModel(*pfl_cnn_layers(in_channels=3, image_size=32, hidden=HIDDEN, num_classes=10),
                                  feature_dim=HIDDEN),
    "htcnn1": lambda: build_model("htcnn1", num_classes=10, feature_dim=512, in_channels=1, image_size=28),
}
SHAPES = {"pfl_cnn": (3, 32, 32), "htcnn1": (1, 28, 28)}


def cpu_name() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} thread(s) of it)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(model_name: str, mode: str, device: torch.device, batch: int, steps: int) -> dict[str, float]:
    """The first step's seconds and the median of the next ``steps``, in ms."""
    torch.manual_seed(0)
    model = MODELS[model_name]().to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    forward = training.model_forward(mode, device)
    x = torch.randn(batch, *SHAPES[model_name], device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def one_step() -> float:
        synchronise(device)
        began = time.perf_counter()
        _, logits = forward(model, x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        synchronise(device)
        return time.perf_counter() - began

    first = one_step()
    for _ in range(3):  # settle (CUDA graph trees record on their first replays)
        one_step()
    timed = [one_step() for _ in range(steps)]
    return {"first_s": first, "step_ms": statistics.median(timed) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default=",".join(MODELS), help="of: " + ", ".join(MODELS))
    parser.add_argument("--modes", default="default", help="compile modes beside eager: default, reduce-overhead")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1, as pfl's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    modes = args.modes.split(",")
    if unknown or not set(modes) <= {"default", "reduce-overhead"}:
        print(f"bench/compile_step.py: unknown models {unknown} or modes {modes}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"machine: {machine}, torch {torch.__version__}, {args.threads} thread(s), batch {args.batch}")
    results = []
    for model_name in args.models.split(","):
        eager = step_times(model_name, "off", device, args.batch, args.steps)
        print(f"{model_name:8s} eager            {eager['step_ms']:8.2f} ms/step")
        for mode in modes:
            torch._dynamo.reset()
            training._COMPILED_FORWARDS.clear()
            compiled = step_times(model_name, mode, device, args.batch, args.steps)
            saved_ms = eager["step_ms"] - compiled["step_ms"]
            paid_after = (compiled["first_s"] * 1e3 / saved_ms) if saved_ms > 0 else None
            print(f"{model_name:8s} {mode:16s} {compiled['step_ms']:8.2f} ms/step "
                  f"({compiled['step_ms'] / eager['step_ms']:.2f}x eager), first step {compiled['first_s']:.1f} s, "
                  f"pays after {'never' if paid_after is None else f'{paid_after:,.0f} steps'}")
            results.append({"model": model_name, "mode": mode, "eager_ms": eager["step_ms"],
                            "compiled_ms": compiled["step_ms"], "first_s": compiled["first_s"],
                            "pays_after_steps": paid_after})
    if args.out:
        args.out.write_text(json.dumps({"machine": machine, "threads": args.threads, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
