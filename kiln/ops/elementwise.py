"""Elementwise ONNX ops (unary, binary, variadic, comparisons) in torch."""
from __future__ import annotations


import torch
import torch.nn.functional as F

from kiln.ops.registry import OpKind, register

E = OpKind.ELEMENTWISE


def _unary(op_type: str, fn):
    register(op_type, E)(lambda attrs, xs: [fn(attrs, xs[0])])


# ---- activations (TensorRT: Activation layers) ----
_unary("Relu", lambda a, x: torch.relu(x))
_unary("Sigmoid", lambda a, x: torch.sigmoid(x))
_unary("Tanh", lambda a, x: torch.tanh(x))
_unary("LeakyRelu", lambda a, x: F.leaky_relu(x, a.get("alpha", 0.01)))
_unary("Elu", lambda a, x: F.elu(x, a.get("alpha", 1.0)))
_unary("Selu", lambda a, x: a.get("gamma", 1.0507009873554805) * torch.where(
    x > 0, x, a.get("alpha", 1.6732632423543772) * (torch.exp(x) - 1)))
_unary("Softplus", lambda a, x: F.softplus(x))
_unary("Softsign", lambda a, x: x / (1 + x.abs()))
_unary("HardSigmoid", lambda a, x: torch.clamp(a.get("alpha", 0.2) * x + a.get("beta", 0.5), 0, 1))
_unary("HardSwish", lambda a, x: F.hardswish(x))
_unary("Mish", lambda a, x: F.mish(x))
# opset 24; kiln's SwishFusion writes it for x * Sigmoid(x) (SiLU)
_unary("Swish", lambda a, x: F.silu(x) if a.get("alpha", 1.0) == 1.0 else x * torch.sigmoid(a["alpha"] * x))
_unary("ThresholdedRelu", lambda a, x: torch.where(x > a.get("alpha", 1.0), x, torch.zeros_like(x)))
_unary("Gelu", lambda a, x: F.gelu(x, approximate=a.get("approximate", "none")))

# ---- unary math ----
_unary("Sqrt", lambda a, x: torch.sqrt(x))
_unary("Exp", lambda a, x: torch.exp(x))
_unary("Log", lambda a, x: torch.log(x))
_unary("Neg", lambda a, x: torch.neg(x))
_unary("Abs", lambda a, x: torch.abs(x))
_unary("Reciprocal", lambda a, x: torch.reciprocal(x))
_unary("Erf", lambda a, x: torch.erf(x))
_unary("Floor", lambda a, x: torch.floor(x))
_unary("Ceil", lambda a, x: torch.ceil(x))
_unary("Round", lambda a, x: torch.round(x))
_unary("Sign", lambda a, x: torch.sign(x))
_unary("Sin", lambda a, x: torch.sin(x))
_unary("Cos", lambda a, x: torch.cos(x))
_unary("Not", lambda a, x: torch.logical_not(x))
_unary("Identity", lambda a, x: x)


@register("Clip", E, host_inputs=(1, 2))
def clip(attrs, xs):
    x = xs[0]
    lo = xs[1] if len(xs) > 1 and xs[1] is not None else attrs.get("min")
    hi = xs[2] if len(xs) > 2 and xs[2] is not None else attrs.get("max")
    if lo is None and hi is None:
        return [x]
    return [torch.clamp(x, lo, hi)]


@register("Dropout", E, host_inputs=(1, 2))
def dropout(attrs, xs):
    """Inference Dropout: the identity and an all-true mask. Training mode drops at random: only ratio 0."""
    x = xs[0]
    ratio, training = (_host_scalar(xs[i]) if len(xs) > i else None for i in (1, 2))
    if training and ratio != 0:   # ratio defaults to 0.5
        raise NotImplementedError("Dropout with training_mode=true drops at random; kiln runs inference only")
    return [x, torch.ones(x.shape, dtype=torch.bool, device=x.device)]


def _host_scalar(v):
    """A scalar build-time input (a Python value, or a one-element list), or None where absent."""
    return v[0] if isinstance(v, list) and len(v) == 1 else v


def _binary(op_type: str, fn):
    register(op_type, E)(lambda attrs, xs: [fn(xs[0], xs[1])])


def _div(a, b):
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")


def _pow(a, b):
    """A one-element exponent (x ** 2 in a decomposed norm) as a Python number: torch's scalar path squares a
    [128, 256] tensor in 5 us, its tensor-exponent path takes 85 us."""
    if isinstance(b, torch.Tensor) and b.numel() == 1 and b.dim() <= a.dim() and not b.is_meta and \
            a.is_floating_point():   # integer bases: torch refuses negative integer exponents as scalars
        b = b.item()
    out = torch.pow(a, b)
    return out.to(a.dtype) if out.dtype != a.dtype else out


def _mod(a, b):
    return torch.remainder(a, b)


_binary("Add", torch.add)
_binary("Sub", torch.sub)
_binary("Mul", torch.mul)
_binary("Div", _div)
_binary("Pow", _pow)
_binary("Equal", torch.eq)
_binary("Less", torch.lt)
_binary("LessOrEqual", torch.le)
_binary("Greater", torch.gt)
_binary("GreaterOrEqual", torch.ge)
_binary("And", torch.logical_and)
_binary("Or", torch.logical_or)
_binary("Xor", torch.logical_xor)


@register("Mod", E)
def mod(attrs, xs):
    a, b = xs
    if attrs.get("fmod", 0):
        return [torch.fmod(a, b)]
    return [_mod(a, b)]


def _variadic(op_type: str, fn):
    def impl(attrs, xs):
        out = xs[0]
        for x in xs[1:]:
            out = fn(out, x)
        return [out]
    register(op_type, E)(impl)


_variadic("Max", torch.maximum)
_variadic("Min", torch.minimum)
_variadic("Sum", torch.add)


@register("Mean", E)
def mean(attrs, xs):
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return [out / len(xs)]


@register("Where", E)
def where(attrs, xs):
    return [torch.where(xs[0], xs[1], xs[2])]


@register("Cast", E)
def cast(attrs, xs):
    from kiln.ops.dtypes import onnx_to_numpy, to_torch_dtype

    return [xs[0].to(to_torch_dtype(onnx_to_numpy(attrs["to"], "Cast")))]


@register("BatchNormalization", E)
def batch_norm(attrs, xs):
    if attrs.get("training_mode", 0):
        raise NotImplementedError("BatchNormalization with training_mode=1 (batch statistics); kiln runs inference")
    x, scale, bias, mean_, var = xs[:5]
    eps = attrs.get("epsilon", 1e-5)
    shape = [1, -1] + [1] * (x.dim() - 2)
    inv = scale / torch.sqrt(var + eps)
    return [x * inv.reshape(shape) + (bias - mean_ * inv).reshape(shape)]


