"""TensorRT's verbose build-log lines: each line kiln writes (a function returning the message, without the logger
prefix) beside the pattern the inspector reads it back with, so writer and reader cannot drift; plus the patterns
for the lines only TensorRT writes. Readers: `kiln.trt.build_log_reader` (whole logs), `kiln.trt.readers` (the
layer dump inside a log)."""
from __future__ import annotations

import re
import time
from typing import Sequence

from kiln.plan.model import TensorDesc
from kiln.trt.vocab import tensor_text

# ---- logger prefix: "[MM/DD/YYYY-HH:MM:SS] [I] [kiln] message" ---------------------------------------------------

KILN_TAG = "[kiln] "


def log_prefix(level: str, when_s: float | None = None) -> str:
    """trtexec's prefix for a message of `level` ("V", "I", "W", "E") logged at `when_s` (default: now)."""
    return f"[{time.strftime('%m/%d/%Y-%H:%M:%S', time.localtime(when_s))}] [{level}] "


# read by the build-log reader, one part at a time (dates with 1-2 digit fields, with or without brackets)
PREFIX_DATE = re.compile(r"^\s*\[?\d{1,2}/\d{1,2}/\d{2,4}-\d{1,2}:\d{2}:\d{2}\]\s?")
PREFIX_LEVEL = re.compile(r"^\[(?:V|I|W|E|F)\]\s?")
PREFIX_TAG = re.compile(r"^\[(?:TRT|kiln)\]\s?")
# TensorRT's python logger
PREFIX_PYTHON = re.compile(r"^\[TensorRT\] (?:VERBOSE|INFO|WARNING|ERROR|INTERNAL_ERROR): ")
# read by the layer-dump reader, all at once
LOG_PREFIX = re.compile(r"^(?:\[\d\d/\d\d/\d{4}-\d\d:\d\d:\d\d\] )?(?:\[[A-Z]\] )?(?:\[(?:TRT|kiln)\] )?")
DATED = re.compile(r"^\[\d\d/\d\d/\d{4}-\d\d:\d\d:\d\d\]")

# ---- sections: "=== Build Options ===" then "key: value" lines -----------------------------------------------------


def section_header(title: str) -> str:
    return f"=== {title} ==="


SECTION_HEADER = re.compile(r"^=== (.+?) ===$")
SECTION_KEY_VALUE = re.compile(r"^\s*([^:]{1,80}?):\s*(.*)$")
PERFORMANCE_SUMMARY = "Performance summary"
SECTIONS = {"Model Options": "options", "Build Options": "options", "System Options": "options",
            "Inference Options": "options", "Reporting Options": "options",
            "Device Information": "device", PERFORMANCE_SUMMARY: "performance"}   # title -> BuildLog field
VERSIONS = [(re.compile(r"^TensorRT version: (\S+)"), "TensorRT {}"),
            (re.compile(r"\[TensorRT v(\d+)\]"), None),
            (re.compile(r"^kiln (?:version:? )?v?(\d+\.\d+\S*)"), "kiln {}")]

# ---- the pass manager ----------------------------------------------------------------------------------------------

APPLYING_OPTIMIZATIONS = "Applying generic optimizations to the graph for inference."


def original_layers(count: int) -> str:
    return f"Original: {count} layers"


ORIGINAL = re.compile(r"^Original: (\d+) layers")


def after_layers(milestone: str, count: int, detail: str = "") -> str:
    """"After <milestone>: N layers", with kiln's `detail` in parentheses when given."""
    return f"After {milestone}: {count} layers" + (f" ({detail})" if detail else "")


AFTER = re.compile(r"^After (.+?): (\d+) layers")


def skipping_disabled(pass_name: str) -> str:
    return f"Skipping {pass_name} (disabled)"


SKIPPING = re.compile(r"^Skipping (\w+) \(disabled\)$")


def running(pass_name: str, subject: str) -> str:
    return f"Running: {pass_name} on {subject}"


RUNNING = re.compile(r"^Running: (\S+) on (.*)$")


def fusing(pass_name: str, a: str, b: str) -> str:
    return f"{pass_name}: Fusing {a} with {b}"


FUSING = re.compile(r"^(\w+): Fusing (.+?) with (.+)$")


def not_fusing(pass_name: str, a: str, b: str, reason: str) -> str:
    """kiln's addition: a candidate that did not fuse, naming the unmet condition."""
    return f"{pass_name}: Not fusing {a} with {b}: {reason}"


NOT_FUSING = re.compile(r"^(\w+): Not fusing (.+?) with (.+?): (.*)$")


def removing(subject: str) -> str:
    return f"Removing {subject}"


REMOVING = re.compile(r"^Removing (.+)$")


def pass_note(pass_name: str, message: str) -> str:
    return f"{pass_name}: {message}"


PASS_NOTE = re.compile(r"^([A-Z][A-Za-z0-9]+): (.+)$")   # a note only where its pass has a "Running:" line


def optimization_completed(seconds: float) -> str:
    return f"Graph construction and optimization completed in {seconds:.6f} seconds."


# graph-optimizer lines only TensorRT writes
QDIN_PAIR = re.compile(r"^(QuantizeDoubleInputNodes): fusing \((.+) and (.+)\) into (.+)$")
QDIN = re.compile(r"^(QuantizeDoubleInputNodes): fusing (.+) into (.+)$")
SWAPPING = re.compile(r"^Swapping (.+?) with (.+)$")
DUPLICATE = re.compile(r"^Eliminating (.+) which duplicates \((\w+)\) (.+)$")
SLICE = re.compile(r"^Eliminating slice (.+?) by retargeting (.+?) from (.+?) to (.+)$")
CONCAT = re.compile(r"^Eliminating concatenation (.+)$")
RETARGETING = re.compile(r"^Retargeting (.+?) to (.+)$")
GENERATING_COPY = re.compile(r"^Generating copy for (.+?) to (.+?) because (.+?)\.?$")
NOT_CONCAT = re.compile(r"^Not eliminating concatenation (.+?): (.+)$")   # kiln's: why a Concat stays whole


def eliminating_concatenation(layer: str) -> str:
    return f"Eliminating concatenation {layer}"


def retargeting(tensor: str, target: str) -> str:
    """A Concat input its producer writes straight into the Concat's output `target`."""
    return f"Retargeting {tensor} to {target}"


def generating_copy(tensor: str, target: str, reason: str) -> str:
    return f"Generating copy for {tensor} to {target} because {reason}."


def not_eliminating_concatenation(layer: str, reason: str) -> str:
    return f"Not eliminating concatenation {layer}: {reason}"

MERGING = re.compile(r"^Merging layers: (.+)$")
SWAP_TYPE = re.compile(r"^(?:Swap|Convert) the layer type of (.+) from (\w+) to (\w+)$|"
                       r"^Convert layer type of (.+) from (\w+) to (\w+)$")

# ---- the autotuner -------------------------------------------------------------------------------------------------


def computing_costs(layer: str) -> str:
    return f"=============== Computing costs for {layer}"


COMPUTING_COSTS = re.compile(r"^=+ Computing costs for (.+)$")


def timing_runner(layer: str, runner: str) -> str:
    return f"--------------- Timing Runner: {layer} ({runner})"


TIMING_RUNNER = re.compile(r"^-+ Timing Runner: (.*?)(?: \(([^()\s]+)\))?$")


def tactic_time(tactic_name: str, tactic_value: int, time_ms: float) -> str:
    return f"Tactic Name: {tactic_name} Tactic: 0x{tactic_value:016x} Time: {time_ms:g}"


TACTIC_TIME = re.compile(r"^(?:Tactic Name: (\S+) )?Tactic: (\S+) [Tt]ime:? ([-+0-9.eE]+|inf|nan)")
FASTEST_TACTIC = re.compile(r"Fastest Tactic: (\S+) Time: ([-+0-9.eE]+)")   # TensorRT 8's summary of a runner


def chose_runner(runner: str, tactic_value: int) -> str:
    return f">>>>>>>>>>>>>>> Chose Runner Type: {runner} Tactic: 0x{tactic_value:016x}"


CHOSE_RUNNER = re.compile(r"^>+ Chose Runner Type: (.+?) Tactic: (\S+)")

# ---- the builder: the engine's layers, memory, build time ----------------------------------------------------------

ENGINE_LAYER_INFORMATION = "Engine Layer Information:"   # the builder's verbose dump
LAYER_INFORMATION = "Layer Information:"                 # kiln run / trtexec --dumpLayerInfo, before oneline's dump
LAYER_DUMP_HEADERS = (ENGINE_LAYER_INFORMATION, "Layers:", LAYER_INFORMATION)   # "Layers:": layer_info.oneline


def engine_layer(runner: str, name: str, tactic_value: int, inputs: Sequence[TensorDesc],
                 outputs: Sequence[TensorDesc]) -> str:
    """One layer of the "Engine Layer Information" dump: `Layer(Runner): name, Tactic: 0x..., ins -> outs`."""
    ins = ", ".join(tensor_text(t) for t in inputs)
    outs = ", ".join(tensor_text(t) for t in outputs)
    return f"Layer({runner}): {name}, Tactic: 0x{tactic_value:016x}, {ins} -> {outs}"


ENGINE_LAYER = re.compile(r"^Layer\(\w*\): ")
ENGINE_LAYER_FIELDS = re.compile(r"^Layer\((?P<type>[^()]*)\): (?P<name>.*?), Tactic: (?P<tactic>[-\w]+),(?P<io>.*)$")
# one tensor of its lists: `in[Float(1,3)]` (kiln, TensorRT 8) or `in (Half[1,40])` (TensorRT 10)
ENGINE_LAYER_TENSOR = re.compile(r"(?P<name>.*?)(?:\[(?P<dt>\w+)\((?P<d>[-\d,: ]*)\)\]"
                                 r"| \((?P<dt2>\w+)\[(?P<d2>[-\d,: ]*)\]\))(?:, |$)")
ONELINE_LAYER = re.compile(r"^Name: .*, LayerType: ")   # kiln.trt.layer_info.oneline


def total_activation_memory(total_bytes: int, unshared_bytes: int) -> str:
    return f"Total Activation Memory: {total_bytes} bytes ({unshared_bytes} bytes without reuse)"


def total_weights_memory(total_bytes: int) -> str:
    return f"Total Weights Memory: {total_bytes} bytes"


MEMORY = [re.compile(r"^(Total per-runner (?:device|host) persistent memory) is (\d+)"),
          re.compile(r"^Allocated (activation device memory) of size (\d+)"),
          re.compile(r"^(Total [\w -]*[Mm]emory): (.+)$"),   # kiln's two lines above, TensorRT's
          re.compile(r"^(?:Peak|Max) ([\w -]*[Mm]emory)(?: is|:) (.+)$")]
MEMORY_CHANGE = re.compile(r"^\[MemUsageChange\] (.+?): (.+)$")


def engine_built(seconds: float) -> str:
    return f"Engine built in {seconds:.5f} sec."
