"""Graph passes and the default pipeline (one ordered list, with the reason for the order beside it)."""
from __future__ import annotations

from kiln.passes.attention import fuse_attention, fuse_skip_layer_norm, merge_matmuls
from kiln.passes.cleanup import fold_constants, merge_common_subexpressions, remove_dead_layers, remove_identities
from kiln.passes.conv import (fold_batchnorm_into_conv, fold_pad_into_conv, fuse_activation, fuse_gemm_activation,
                              fuse_norm_activation, fuse_residual_add)
from kiln.passes.conv_split import split_sliced_convs
from kiln.passes.dynamic_quant import fuse_dynamic_quantized_conv, fuse_dynamic_quantized_matmul
from kiln.passes.einsum import lower_einsum
from kiln.passes.gelu import fuse_gelu
from kiln.passes.gemm import fuse_matmul_bias, fuse_matmul_residual, gemm_between_reshapes
from kiln.passes.manager import Pass, PassStat, run_passes
from kiln.passes.matmul_scale import fold_batchnorm_into_matmul
from kiln.passes.normalization import fuse_group_norm, fuse_layer_norm, fuse_rms_norm
from kiln.passes.pointwise import fuse_pointwise, fuse_swish
from kiln.passes.qdq_constants import fold_constant_dequantize, fold_weight_only_dequantize, swap_gather_dequantize
from kiln.passes.qmatmul_steps import fuse_product_shuffles
from kiln.passes.qconcat_table import fuse_concat_tables
from kiln.passes.qproduct_table import fuse_product_tables
from kiln.passes.qoperator import unfold_qoperators
from kiln.passes.qpool import fuse_quantized_pools, fuse_quantized_resizes, fuse_quantized_softmax
from kiln.passes.rotary import fuse_rotary
from kiln.passes.quantization import (fuse_quantized_add, fuse_quantized_layer_norm, fuse_quantized_layers,
                                     fuse_quantized_residual, fuse_requantized_bias,
                                     merge_duplicate_qdq, split_q_across_concat, swap_dq_q_around_movement)
from kiln.passes.shuffle import erase_noop_shuffles, fuse_shuffles
from kiln.passes.shuffle_swap import move_shuffles_across_products
from kiln.passes.weight_sign import recenter_unsigned_weights

DEFAULT_PIPELINE: list[Pass] = [
    Pass("DeadLayerRemoval", remove_dead_layers, "dead-layer removal"),
    # Identity/Dropout first so that every later pattern sees producers directly.
    Pass("IdentityRemoval", remove_identities, "identity removal"),
    # QOperator INT8 (QLinearConv ...) becomes Q/DQ before folding, which leaves DQ(INT8 weights) for the Q/DQ fusions.
    Pass("QOperatorUnfolding", unfold_qoperators, "QOperator unfolding"),
    # u8 weights that fit a signed byte (zero point 128) become s8 before any INT8 fusion reads their type.
    Pass("UnsignedWeightRecentering", recenter_unsigned_weights),
    # Einsum products become MatMuls before folding, which then transposes constant weights once.
    Pass("EinsumToMatMul", lower_einsum),
    # Weight-only quantized products run in FP32: their weights become constants that folding and fusions see.
    Pass("WeightOnlyDequantizeFolding", fold_weight_only_dequantize),
    # Folding turns shape arithmetic (Shape->Gather->Concat->Reshape) into constant reshape targets.
    Pass("ConstantFolding", fold_constants, "constant folding"),
    Pass("DeadLayerRemoval", remove_dead_layers),
    # Then equal constants compare equal: per-layer copies of one computation (a mask, a Shape) are merged.
    Pass("CommonSubexpressionElimination", merge_common_subexpressions),
    # onnxruntime-optimized models: Reshape -> Gemm -> Reshape back to a MatMul, while the Reshapes (their targets
    # folded to constants) are not yet Shuffles, and before the fusions that extend the product.
    Pass("GemmToMatMul", gemm_between_reshapes),
    # Linear -> BatchNorm1d folds through the Flatten/Reshape between them, which the shuffle passes then erase.
    Pass("MatMulScaleFusion", fold_batchnorm_into_matmul),
    Pass("ShuffleShuffleFusion", fuse_shuffles),
    Pass("ShuffleMatMulSwap", move_shuffles_across_products),
    Pass("ShuffleErasure", erase_noop_shuffles, "shuffle fusions"),
    # LayerNorm before pointwise fusion, which would otherwise swallow its Sub/Pow/Add/Sqrt/Div into PWN layers.
    Pass("LayerNormFusion", fuse_layer_norm),
    Pass("RMSNormFusion", fuse_rms_norm),
    Pass("GroupNormFusion", fuse_group_norm),
    # GELU's erf and tanh forms become one Gelu op before pointwise fusion could split them, so a MatMul absorbs it.
    Pass("GeluFusion", fuse_gelu),
    # A zero Pad before a convolution becomes the convolution's own padding (no copy of the padded map).
    Pass("PaddingConvFusion", fold_pad_into_conv),
    # quantize_dynamic's ConvInteger chain becomes one INT8 convolution, which BN and the activation then fold into.
    Pass("DynamicQuantizeConvFusion", fuse_dynamic_quantized_conv),
    # BN folds before activations and sums so the fused conv stays one kernel with post-ops.
    Pass("ConvScaleFusion", fold_batchnorm_into_conv),
    # The residual sum must be absorbed before the activation (post-op order: sum, then activation).
    Pass("ConvEltwiseSumFusion", fuse_residual_add),
    # SiLU (x * Sigmoid(x)) becomes one Swish op first, so the convolution or matrix product can absorb it.
    Pass("SwishFusion", fuse_swish),
    Pass("ConvReluFusion", fuse_activation),
    Pass("NormActFusion", fuse_norm_activation),
    # YOLO's C2f/C3 chunks: a convolution read only through channel slices computes each slice as its own output.
    Pass("ConvSliceSplit", split_sliced_convs),
    # Dynamic quantization's chain becomes one INT8 product first, which then takes its bias and merges as MatMuls do.
    Pass("DynamicQuantizeMatMulFusion", fuse_dynamic_quantized_matmul),
    Pass("MatMulAddFusion", fuse_matmul_bias),
    Pass("ShuffleMatMulSwap", move_shuffles_across_products),   # again, now that biases joined their products
    # Q/K/V projections merge once their biases are inside; attention then absorbs the Split and the shuffles.
    Pass("MatMulHorizontalMerge", merge_matmuls),
    Pass("AttentionFusion", fuse_attention),
    Pass("SkipLayerNormFusion", fuse_skip_layer_norm),
    # The residual sums no LayerNorm took (pre-LN blocks) join their linear layer, before its activation as for convs.
    Pass("MatMulEltwiseSumFusion", fuse_matmul_residual),
    Pass("GemmActFusion", fuse_gemm_activation),
    # Q/DQ last among the vertical fusions: the conv/gemm has its bias, residual and activation by now.
    Pass("HorizontalMergeQNodes", merge_duplicate_qdq),
    Pass("VanillaSwapWithFollowingQ", swap_dq_q_around_movement),
    Pass("SplitQAcrossPrecedingFanIn", split_q_across_concat),
    Pass("ShuffleShuffleFusion", fuse_shuffles),   # again: shuffles a Q/DQ pair separated now move INT8 together
    Pass("QuantizeDoubleInputNodes", fuse_quantized_layers),
    Pass("QuantizedAddFusion", fuse_quantized_add),
    Pass("QuantizedSoftmaxFusion", fuse_quantized_softmax),
    Pass("QuantizedPoolFusion", fuse_quantized_pools),
    Pass("QuantizedResizeFusion", fuse_quantized_resizes),
    Pass("QConvEltwiseSumFusion", fuse_quantized_residual, "vertical fusions"),
    # DequantizeLinear of constants no INT8 layer took: an embedding table gathered as INT8, the rest FP32 constants.
    Pass("GatherDequantizeSwap", swap_gather_dequantize),
    Pass("ConstantDequantizeFolding", fold_constant_dequantize),
    # quantize_static's bias Add after an INT8 product (its DQ(bias) now an FP32 constant) joins the product.
    Pass("RequantizedBiasFusion", fuse_requantized_bias),
    # Once nothing more joins an INT8 product: its head split and merge become its steps (a bias added before them).
    Pass("QMatMulShuffleFusion", fuse_product_shuffles),
    # An INT8 LayerNorm (with the residual QAdd before it) once its scale and bias are FP32 constants.
    Pass("QuantizedLayerNormFusion", fuse_quantized_layer_norm),
    # rotate_half's Slices/Neg/Concat and the Mul/Mul/Add around it, before pointwise fusion takes the arithmetic.
    Pass("RotaryFusion", fuse_rotary),
    # Pointwise last: activations that a conv/gemm could absorb are gone; what remains chains up.
    Pass("PointWiseFusion", fuse_pointwise, "pointwise fusions"),
    # A chain on one INT8 product's output (quantize_static's scores scaling, its GELU) as a table in its epilogue.
    Pass("QProductTableFusion", fuse_product_tables),
    # Requantizations no product took (a Concat's inputs at other scales) as tables the Concat's copy applies.
    Pass("QConcatTableFusion", fuse_concat_tables),
    Pass("DeadLayerRemoval", remove_dead_layers, "final dead-layer removal"),
]

__all__ = ["DEFAULT_PIPELINE", "Pass", "PassStat", "run_passes"]
