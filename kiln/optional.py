"""Optional dependencies (onnxruntime, OpenVINO): imported only by the feature that needs them, through `require`,
which returns the module or raises a `MissingDependencyError` naming that feature and the pip command that
installs the extra; `available` answers without importing. `import kiln` and `kiln --help` never load them."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType

from kiln.errors import MissingDependencyError


def _import_onnxruntime() -> ModuleType:
    import onnxruntime

    return onnxruntime


def _import_openvino() -> ModuleType:
    _decline_openvino_telemetry()
    import openvino

    return openvino


def _decline_openvino_telemetry() -> None:
    """`import openvino` starts OpenVINO's usage telemetry (openvino_telemetry, through openvino.tools.ovc), which
    counts a machine without a consent file as consenting and sends an import event to Google Analytics from a
    process it forks off a sender thread. kiln's process declines it: a build tool should not send events, and a
    fork while another thread held the dynamic loader's lock left that child blocked in dlopen and `kiln build`'s
    exit waiting for it forever (seen on a fresh machine). Nothing is written to the user's consent file; other
    OpenVINO tools keep their setting."""
    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:   # no telemetry package (or another layout of it): nothing to decline
        return
    OptInChecker.check = lambda self, *args, **kwargs: ConsentCheckResult.DECLINED


@dataclass(frozen=True)
class OptionalDependency:
    """A package kiln builds and runs without; `extra` is its name in pyproject's [project.optional-dependencies]."""

    module_name: str
    extra: str
    load: Callable[[], ModuleType]   # a literal import statement: nothing is imported by a computed name

    @property
    def install_command(self) -> str:
        return f"pip install 'kiln[{self.extra}]'"


OPTIONAL_DEPENDENCIES = {d.module_name: d for d in (OptionalDependency("onnxruntime", "onnxruntime",
                                                                       _import_onnxruntime),
                                                    OptionalDependency("openvino", "openvino", _import_openvino))}


@cache
def available(module_name: str) -> bool:
    """Whether `module_name` is installed: found on the import path (not imported, so this is cheap)."""
    _dependency(module_name)
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):   # an import hook refusing it, or a module object without a spec
        return False


def require(module_name: str, purpose: str) -> ModuleType:
    """The module, imported; else a MissingDependencyError: "<purpose> needs <module>, which is not installed
    here; install it with: pip install 'kiln[<extra>]'" (or, for an install that fails to import, its error)."""
    dependency = _dependency(module_name)
    try:
        return dependency.load()
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_name:
            raise MissingDependencyError(module_name, f"{purpose} needs {module_name}, which is not installed here; "
                                                      f"install it with: {dependency.install_command}") from None
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MissingDependencyError(module_name, f"{purpose} needs {module_name}, which is installed but fails to "
                                                  f"import ({first}); reinstall it with: pip install "
                                                  f"--force-reinstall '{module_name}'") from None


def _dependency(module_name: str) -> OptionalDependency:
    try:
        return OPTIONAL_DEPENDENCIES[module_name]
    except KeyError:
        raise ValueError(f"{module_name!r} is not one of kiln's optional dependencies "
                         f"{sorted(OPTIONAL_DEPENDENCIES)}") from None
