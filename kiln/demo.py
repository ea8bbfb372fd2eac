"""`make demo`: build a small deterministic CNN, run it, print its layer table and latency, write JSON exports.

python -m kiln.demo --out demo_out
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def demo_model(path: Path) -> None:
    """A small CNN made in code (seed 0): conv+BN+ReLU, depthwise conv + HardSwish, a residual block, a head."""
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + x)

    class DemoNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
            self.dw = nn.Sequential(nn.Conv2d(32, 32, 3, 1, 1, groups=32), nn.Hardswish(), nn.Conv2d(32, 64, 1))
            self.pool = nn.MaxPool2d(2)
            self.block = Block(64)
            self.head = nn.Linear(64, 10)

        def forward(self, x):
            x = self.block(self.pool(self.dw(self.stem(x))))
            return torch.softmax(self.head(torch.flatten(x.mean((2, 3), keepdim=True), 1)), dim=1)

    torch.manual_seed(0)
    model = DemoNet().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(1, 3, 64, 64)
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17, input_names=["image"],
                      output_names=["probs"], do_constant_folding=False)


def main(argv: list[str] | None = None) -> int:
    import kiln
    from kiln.cli import console
    from kiln.trt.layer_info import dumps
    from kiln.plan.serialize import atomic_write_text
    from kiln.cli.run import measure, profile
    from kiln.trt.profile import performance_summary, profile_json, times_json

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="demo_out")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console.setup_logging(False)
    onnx_path = out / "demo.onnx"
    demo_model(onnx_path)
    console.info(f"Exported demo model to {onnx_path}")
    engine = kiln.build(onnx_path)
    engine.save(out / "demo.kiln")
    engine = kiln.load(out / "demo.kiln")
    feeds = engine.random_inputs()
    outputs = engine.run(feeds)
    try:
        import onnxruntime as ort

        ref = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        err = float(np.abs(outputs["probs"] - ref).max() / np.abs(ref).max())
        console.info(f"Max relative difference vs onnxruntime: {err:.3g}")
    except ImportError:
        pass
    prof = profile(engine, feeds, 50)
    console.layer_table(engine.plan, prof)
    times = measure(engine, feeds, 100, 10, 0.0)
    for line in performance_summary(times):
        console.info(line)
    atomic_write_text(out / "layer_info.json", dumps(engine.layer_info("detailed")))
    atomic_write_text(out / "profile.json", profile_json(prof))
    atomic_write_text(out / "times.json", times_json(times))
    console.info(f"Wrote {out}/demo.kiln, layer_info.json, profile.json, times.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
