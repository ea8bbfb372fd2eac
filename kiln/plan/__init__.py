"""The engine plan: kiln's data model (layers, tensors, weights, memory plan, profiles), its pickle-free file
format and last-use analysis. Every stage below the builder and the runtime speak in these types."""
from kiln.plan.model import HWC, LINEAR, Arg, Layer, MemoryPlan, Plan, ShapeRange, TensorDesc

__all__ = ["HWC", "LINEAR", "Arg", "Layer", "MemoryPlan", "Plan", "ShapeRange", "TensorDesc"]
