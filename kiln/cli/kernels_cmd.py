"""kiln kernels list|warm|verify: kiln's compiled C kernel libraries in their private cache ($KILN_CACHE_DIR/kernels).

list shows each library (name, cache key, built, verified, path) for this compiler and CPU; warm builds them all
now; verify re-hashes every cached library against the record kiln wrote when it built it and exits 1 when one
has no record or another hash (with --remove, those are deleted; kiln rebuilds what it needs). list and warm
need a C compiler (exit 2 without one); verify does not."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("list", "warm", "verify"),
                   help="list the libraries, build them all now, or check every cached library's hash")
    p.add_argument("--remove", action="store_true", help="verify: delete each library that fails the check")


def run(args: argparse.Namespace) -> int:
    from kiln import native
    from kiln.cli import console

    if args.action == "verify":
        return _verify(args.remove)
    tc = native.require_toolchain()
    console.info(f"C compiler: {tc.compiler} ({tc.version}); kernel cache: {native.kernel_folder()}")
    libraries = _libraries()
    if args.action == "warm":
        for label, name, generated in libraries:
            native.library(name, generated)
            console.info(f"built {label}: {native.state(name, generated).path}")
        return 0
    console.info(f"{'library':<21} {'key':<32} {'built':<5} {'verified':<8} path")
    shown = set()
    for label, name, generated in libraries:
        s = native.state(name, generated)
        shown.add(s.path)
        verified = "-" if not s.built else "yes" if s.problem is None else "NO"
        console.info(f"{label:<21} {s.key:<32} {'yes' if s.built else 'no':<5} {verified:<8} {s.path}"
                     + (f" ({s.problem}: refused at load and rebuilt)" if s.problem else ""))
    others = [path for path, _ in native.verify_cache() if path not in shown]
    if others:
        console.info(f"{len(others)} more cached libraries (generated pointwise programs, other compilers or "
                     "kiln versions): `kiln kernels verify` checks them all")
    return 0


def _libraries() -> list[tuple[str, str, str]]:
    """(label, catalog name, rendered text) of every library kiln's tactics build, generated pointwise programs
    aside (one per program, built when a model needs it)."""
    from kiln.native import LIBRARIES, buildable
    from kiln.tactics.winograd import TILE_SIZES, rendered_source

    fixed = [(name, name, "") for name, spec in LIBRARIES.items() if not spec.rendered_by and buildable(name)]
    return fixed + [(f"winograd F({m}x{m},3x3)", "winograd", rendered_source(m)) for m in TILE_SIZES]


def _verify(remove: bool) -> int:
    from kiln import native
    from kiln.cli import console

    results = native.verify_cache()
    failed = [(path, problem) for path, problem in results if problem is not None]
    for path, problem in results:
        console.info(f"{'ok' if problem is None else 'REFUSED'}  {path}" + (f": {problem}" if problem else ""))
        if problem is not None and remove:
            native.remove_cached(path)
    console.info(f"{native.kernel_folder()}: {len(results) - len(failed)} libraries verified, {len(failed)} refused"
                 + (" and deleted" if remove and failed else ""))
    if failed and not remove:
        console.error("libraries without kiln's record or with another hash are refused at load; "
                      "`kiln kernels verify --remove` deletes them (kiln rebuilds what it needs)")
    return 1 if failed else 0
