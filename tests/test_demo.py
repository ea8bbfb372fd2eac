"""`make demo` end to end: the bundled model builds, runs, prints its table and writes every export."""
import json

from kiln import demo


def test_demo_writes_engine_and_trtexec_exports(tmp_path, capsys):
    assert demo.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Max relative difference vs onnxruntime" in out and "=== Performance summary ===" in out
    for name in ("demo.onnx", "demo.kiln", "layer_info.json", "profile.json", "times.json"):
        assert (tmp_path / name).is_file(), name
    info = json.loads((tmp_path / "layer_info.json").read_text())
    assert info["Bindings"] == ["image", "probs"] and info["Layers"]
    assert json.loads((tmp_path / "profile.json").read_text())[0] == {"count": 50}
