"""Analyses of the engine descriptions `kiln.trt` reads: lint findings, diffs, Graphviz drawings, HTML reports and
the --json summaries."""
