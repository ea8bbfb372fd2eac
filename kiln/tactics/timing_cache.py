"""Timing cache: measured kernel times keyed by device and layer signature (trtexec --timingCacheFile).

File: {"kind": "kiln-timing-cache", "version": 1, "devices": {id: {...}}, "entries": {id: {signature: {tactic: ms}}}}
Validated on load (plain JSON, never executed); written atomically.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

from kiln import hardware
from kiln.errors import Error

CACHE_KIND, CACHE_VERSION = "kiln-timing-cache", 1


def device_description(threads: int) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:   # the installed version, without importing the library into every build
        ort_version = importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        ort_version = None
    return {"cpu": cpu, "isa": sorted(hardware.cpu_isa()), "threads": threads, "torch": torch.__version__,
            "onnxruntime": ort_version}


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


class TimingCache:
    def __init__(self, device: dict[str, Any], path: str | os.PathLike | None = None, deterministic: bool = False):
        self.device, self.device_id = device, digest(device)
        self.deterministic = deterministic
        self.path = Path(path) if path else None
        self.devices: dict[str, Any] = {self.device_id: device}
        self.entries: dict[str, dict[str, dict[str, float]]] = {}
        self.hits = self.misses = 0
        if self.path is not None and self.path.exists():
            self._load()
        elif deterministic:
            raise Error(f"--deterministic needs an existing timing cache (got {self.path}); build once with "
                        "--timing-cache to record the choices")

    def _load(self) -> None:
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise Error(f"{self.path}: timing cache is not valid JSON ({exc}); delete it to start a new one") from None
        if not isinstance(doc, dict) or doc.get("kind") != CACHE_KIND:
            raise Error(f"{self.path}: not a kiln timing cache (missing kind '{CACHE_KIND}')")
        if doc.get("version") != CACHE_VERSION:
            raise Error(f"{self.path}: timing cache version {doc.get('version')} is not {CACHE_VERSION}; delete it")
        entries, devices = doc.get("entries"), doc.get("devices")
        if not isinstance(entries, dict) or not isinstance(devices, dict):
            raise Error(f"{self.path}: timing cache has no 'entries'/'devices' objects")
        for dev, table in entries.items():
            if not isinstance(table, dict) or not all(
                    isinstance(v, dict) and all(isinstance(t, str) and isinstance(ms, (int, float)) for t, ms in v.items())
                    for v in table.values()):
                raise Error(f"{self.path}: timing cache entry for device {dev} is malformed")
        self.entries, self.devices = entries, {**devices, self.device_id: self.device}

    def get(self, signature: str, tactic: str, what: str = "") -> float | None:
        value = self.entries.get(self.device_id, {}).get(signature, {}).get(tactic)
        if value is None and self.deterministic:
            raise Error(f"deterministic build: the timing cache {self.path} has no timing of {tactic} for "
                        f"{what or 'a layer'} on this device; rebuild without --deterministic to record it")
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, signature: str, tactic: str, ms: float) -> None:
        self.entries.setdefault(self.device_id, {}).setdefault(signature, {})[tactic] = ms

    def save(self) -> None:
        if self.path is None:
            return
        from kiln.fileio import atomic_write_text

        doc = {"kind": CACHE_KIND, "version": CACHE_VERSION, "devices": self.devices, "entries": self.entries}
        atomic_write_text(self.path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
