"""kiln's graph IR."""
from kiln.ir.graph import Graph, Node, Value, format_shape, same_extent, same_shape

__all__ = ["Graph", "Node", "Value", "format_shape", "same_extent", "same_shape"]
