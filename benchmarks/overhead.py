"""Per-call overhead of kiln's tactics (issue 19, item 8): each tactic's kernel on a tiny layer, where compute is
negligible, so the time is what one call costs (descriptor set-up, casts, dispatch). At BF16 speeds a ResNet-50
runs ~55 layers in ~5 ms, so a tactic that spends tens of microseconds per call loses there however fast it
computes. The autotuner times calls whole, so overhead already counts against a tactic; this shows how much.

    .venv/bin/python benchmarks/overhead.py [--calls 2000]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_info import cpu_line  # noqa: E402


def tiny_layers():
    """(label, LayerView) pairs: a 1x1 convolution on 8 channels at 4x4 and an 8x8 linear on 1 row, in FP32 and
    INT8 (u8 in and out, s8 weights per channel), a depthwise 3x3 FP32 convolution on the same map, a padded 3x3 INT8
    convolution (kiln's direct kernel), an attention layer of 2 heads, 4 tokens, head size 8, with a mask, a softmax
    over 8 channels and an Add."""
    import torch

    from kiln.tactics.base import LayerView

    conv_attrs = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "strides": [1, 1], "dilations": [1, 1], "group": 1}
    conv = LayerView("Conv", "", conv_attrs, ((1, 8, 4, 4), (8, 8, 1, 1), (8,)), ("float32",) * 3,
                     {1: torch.randn(8, 8, 1, 1), 2: torch.randn(8)}, ("float32",), 17, ((), (), ()))
    linear = LayerView("MatMul", "", {}, ((1, 8), (8, 8)), ("float32", "float32"), {1: torch.randn(8, 8)},
                       ("float32",), 17, ((), ()))
    quant = {"x_scale": 0.02, "x_zero_point": 3, "x_dtype": "uint8", "w_scale": [0.003] * 8, "w_zero_point": [0] * 8,
             "w_axis": 0, "y_scale": 0.05, "y_zero_point": 5, "y_dtype": "uint8"}
    w8 = torch.randint(-127, 128, (8, 8, 1, 1), dtype=torch.int8)
    qconv = LayerView("QConv", "kiln", {**conv_attrs, "quant": quant}, ((1, 8, 4, 4), (8, 8, 1, 1), (8,)),
                      ("uint8", "int8", "float32"), {1: w8, 2: torch.randn(8)}, ("uint8",), 17, ((), (), ()))
    qgemm = LayerView("QGemm", "kiln", {"transB": 1, "quant": quant}, ((1, 8), (8, 8)), ("uint8", "int8"),
                      {1: w8.reshape(8, 8)}, ("uint8",), 17, ((), ()))
    conv3 = {**conv_attrs, "kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "quant": quant}
    w3 = torch.randint(-127, 128, (8, 8, 3, 3), dtype=torch.int8)
    qconv3 = LayerView("QConv", "kiln", conv3, ((1, 8, 4, 4), (8, 8, 3, 3), (8,)), ("uint8", "int8", "float32"),
                       {1: w3, 2: torch.randn(8)}, ("uint8",), 17, ((), (), ()))
    heads = {"scale": 0.35, "k_steps": [{"transpose": [0, 1, 3, 2]}]}
    attention = LayerView("Attention", "kiln", heads, ((1, 2, 4, 8),) * 3 + ((1, 1, 4, 4),), ("float32",) * 4, {},
                          ("float32",), 17, ((),) * 4)
    softmax = LayerView("Softmax", "", {"axis": 1}, ((1, 8, 4, 4),), ("float32",), {}, ("float32",), 17, ((),))
    add = LayerView("Add", "", {}, ((1, 8, 4, 4),) * 2, ("float32",) * 2, {}, ("float32",), 17, ((), ()))
    dw_attrs = {**conv_attrs, "kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "group": 8}
    depthwise = LayerView("Conv", "", dw_attrs, ((1, 8, 4, 4), (8, 1, 3, 3), (8,)), ("float32",) * 3,
                          {1: torch.randn(8, 1, 3, 3), 2: torch.randn(8)}, ("float32",), 17, ((), (), ()))
    return [("conv 1x1 8ch 4x4", conv), ("depthwise 3x3 8ch 4x4", depthwise), ("linear 1x8x8", linear),
            ("INT8 conv 1x1 8ch 4x4", qconv),
            ("INT8 conv 3x3 8ch 4x4", qconv3), ("INT8 linear 1x8x8", qgemm), ("attention 2x4x8", attention),
            ("softmax 8ch 4x4 axis 1", softmax), ("add 8ch 4x4", add)]


def per_call_us(kernel, xs, calls: int) -> float:
    """Median of 5 rounds of `calls` back-to-back calls, microseconds per call."""
    import torch

    with torch.inference_mode():
        for _ in range(50):
            kernel(xs)
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                kernel(xs)
            rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def measure(calls: int) -> list[tuple[str, str, float]]:
    """(layer, tactic, µs per call) for every tactic of kiln's registry that supports each tiny layer."""
    from kiln.tactics.autotune import example_input
    from kiln.tactics.base import ANY, LINEAR
    from kiln.tactics.registry import GENERIC, REGISTRY

    rows = []
    for label, view in tiny_layers():
        for tactic in REGISTRY.get(view.op_type, []) + GENERIC:
            if not tactic.supports(view):
                continue
            for io, variant in (("", view), (" bf16 io", stored_bf16(view, tactic))):
                if variant is None:
                    continue
                formats = tactic.input_formats(variant)
                xs = [None if i in variant.const_inputs else
                      example_input(s, variant.input_dtypes[i], LINEAR if formats[i] == ANY else formats[i])
                      for i, s in enumerate(variant.input_shapes)]
                rows.append((label + io, tactic.name, per_call_us(tactic.prepare(variant), xs, calls)))
    return rows


def stored_bf16(view, tactic):
    """`view` as a BF16 plan hands it to `tactic` between two BF16 layers: the float activations it reads in bf16
    and its output stored bfloat16, as kiln.tactics.storage would store them (the plain view's FP32 tensors make a
    BF16 tactic round its input and widen its output per call, which a plan does only at a BF16 run's edges); None
    where the tactic reads and writes no bf16."""
    from kiln.tactics.storage import StorageGuess

    floats = frozenset(i for i, d in enumerate(view.input_dtypes) if d == "float32" and i not in view.const_inputs)
    guess = StorageGuess(inputs=floats, output_shape=view.input_shapes[0])
    variant, _, _ = guess.timing_view(view, tactic)
    return None if variant is view else variant


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="calls per timed round")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    print(cpu_line(), flush=True)   # first: every benchmark says which CPU its numbers come from
    import torch

    torch.set_num_threads(args.threads)
    print(f"threads={args.threads}; median of 5 rounds of {args.calls} calls; microseconds per call; "
          "'bf16 io': a BF16 tactic reading and writing bfloat16, as between two BF16 layers of a plan")
    for layer, tactic, us in measure(args.calls):
        print(f"{layer:30} {tactic:40} {us:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
