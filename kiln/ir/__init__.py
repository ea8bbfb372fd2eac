"""kiln's graph IR."""
from kiln.ir.graph import Graph, Node, Value, format_shape, same_extent, same_shape, shape_at_points

__all__ = ["Graph", "Node", "Value", "format_shape", "same_extent", "same_shape", "shape_at_points"]
