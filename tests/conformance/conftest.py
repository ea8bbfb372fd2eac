"""The conformance summary line: passed / failed / excluded ONNX node cases."""
from __future__ import annotations

NODE_TESTS = "tests/conformance/test_backend.py::test_node"


def pytest_terminal_summary(terminalreporter) -> None:
    def count(outcome: str) -> int:
        reports = terminalreporter.stats.get(outcome, [])
        return sum(1 for r in reports if getattr(r, "nodeid", "").startswith(NODE_TESTS))

    passed, failed, excluded = count("passed"), count("failed"), count("xfailed")
    if passed + failed + excluded:
        terminalreporter.write_line(f"ONNX node conformance (onnx 1.23.2, kiln ops): {passed} passed, {failed} failed, "
                                    f"{excluded} excluded (tests/conformance/EXCLUDED.md) of "
                                    f"{passed + failed + excluded}")
