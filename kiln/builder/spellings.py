"""`kiln.build(model, **options)`'s keywords: BuildOptions' own field names, and the CLI's spellings of the same
options (`calib`, `shapes="input:1x3x224x224"`, `layer_precisions="conv1:bf16,*:fp32"`,
`tactic_sources="-openvino"`, `builder_optimization_level=0`, `disable_pass`), so a script can move between
`kiln build ...` and Python without renaming. An unknown keyword is a ModelError naming it and the known ones."""
from __future__ import annotations

import dataclasses

from kiln.builder.options import BuildOptions
from kiln.errors import ModelError
from kiln.precision.policy import TYPE_NAMES, PrecisionOptions, parse_layer_precisions

PRECISION_FLAGS = ("fp16", "bf16", "int8", "best", "strongly_typed")
CLI_ALIASES = {"calib": "calibration", "calib_method": "calibration_method", "calib_cache": "calibration_cache",
               "shapes": "input_shapes", "disable_pass": "disabled_passes"}
EXTRA = ("layer_precisions", "layer_output_types", "precision_constraints", "builder_optimization_level", "threads",
         "min_shapes", "opt_shapes", "max_shapes")


def known_options() -> list[str]:
    fields = [f.name for f in dataclasses.fields(BuildOptions)]
    return sorted(set(fields) | set(PRECISION_FLAGS) | set(CLI_ALIASES) | set(EXTRA))


def build_options(options: dict) -> tuple[BuildOptions, int | None]:
    """(BuildOptions, threads or None) from kiln.build's keywords."""
    from kiln.tactics.registry import parse_sources

    options = dict(options)
    known = known_options()
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ModelError(f"unknown build option(s) {', '.join(unknown)}; known: {', '.join(known)}")
    for alias, name in CLI_ALIASES.items():
        if alias in options:
            if name in options:
                raise ModelError(f"build options '{alias}' and '{name}' are the same option; give one")
            options[name] = options.pop(alias)
    threads = options.pop("threads", None)
    if "builder_optimization_level" in options:
        options["autotune"] = int(options.pop("builder_optimization_level")) > 0
    _profile_spellings(options)
    if isinstance(options.get("input_shapes"), str):
        from kiln.frontend.profiles import parse_shape_list

        options["input_shapes"] = parse_shape_list(options["input_shapes"])
    if isinstance(options.get("tactic_sources"), str):
        options["tactic_sources"] = parse_sources(options["tactic_sources"])
    if isinstance(options.get("disabled_passes"), str):
        options["disabled_passes"] = [options["disabled_passes"]]
    for name in ("disabled_passes", "tactic_sources"):
        if options.get(name) is not None:
            options[name] = frozenset(options[name])
    _check_pass_names(options.get("disabled_passes") or ())
    precision = precision_options(options)
    if precision is not None:
        options["precision"] = precision
    return BuildOptions(**options), threads


def _check_pass_names(names) -> None:
    """A pass to disable that kiln does not run is a typo or an old name (TensorRT-style silence would build
    with the pass on): a ModelError naming it, the nearest names and where the list is."""
    import difflib

    from kiln.passes import DEFAULT_PIPELINE

    known = [p.name for p in DEFAULT_PIPELINE]
    for name in sorted(set(names) - set(known)):
        near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        raise ModelError(f"--disable-pass: kiln has no pass '{name}'{hint} (the passes: `kiln build MODEL -v` logs "
                         "each one; docs/architecture.md lists them)")


def _profile_spellings(options: dict) -> None:
    """min_shapes/opt_shapes/max_shapes as the CLI's --min/--opt/--max-shapes take them ("x:1x3x224x224,..."; a
    list of such strings makes one profile per entry) become `profiles`, in place."""
    specs = {bound: options.pop(f"{bound}_shapes", None) for bound in ("min", "opt", "max")}
    if all(v is None for v in specs.values()):
        return
    if options.get("profiles"):
        raise ModelError("give optimization profiles either as profiles=[...] or as min_shapes/opt_shapes/max_shapes,"
                         " not both")
    from kiln.frontend.profiles import profiles_from_specs

    lists = {bound: [v] if isinstance(v, str) else list(v or []) for bound, v in specs.items()}
    options["profiles"] = tuple(profiles_from_specs(lists["min"], lists["opt"], lists["max"]))


def precision_options(options: dict) -> PrecisionOptions | None:
    """PrecisionOptions from the flat flags (popped from `options`), or None where none was given; layer precisions
    as a dict or the CLI's "name:type,..." string, --layer-output-types merged under them as the CLI does."""
    flat = {k: options.pop(k) for k in PRECISION_FLAGS if k in options}
    layers = {}
    for key in ("layer_output_types", "layer_precisions"):
        spec = options.pop(key, None)
        if spec:
            layers.update(parse_layer_precisions(spec) if isinstance(spec, str) else
                          {name: TYPE_NAMES.get(str(kind).lower(), kind) for name, kind in dict(spec).items()})
    if layers:
        flat["layer_precisions"] = layers
    if "precision_constraints" in options:
        flat["constraints"] = options.pop("precision_constraints")
    if not flat:
        return None
    if "precision" in options:
        raise ModelError("give the precision either as precision=PrecisionOptions(...) or as flat flags "
                         f"({', '.join(sorted(flat))}), not both")
    return PrecisionOptions(**flat)
