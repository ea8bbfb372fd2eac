/* The activations kiln's C kernels apply as they store a result (GEMMs, Winograd, group normalization, INT8), numbered
   as kiln.tactics.gemm_c and qgemm_c read them from here. */
#ifndef KILN_ACTIVATION_H
#define KILN_ACTIVATION_H

#define ACT_RELU 1
#define ACT_SWISH 2   /* x * sigmoid(x): SiLU, ONNX's Swish with alpha 1 */
#define ACT_GELU_ERF 3    /* 0.5 x (1 + erf(x / sqrt 2)): the INT8 kernels (qgemm.c), linear layers (gemm.h) */
#define ACT_GELU_TANH 4   /* GELU's tanh form (gelu.h) */
#define ACT_HARDSWISH 5   /* x * clamp(x / 6 + 1/2, 0, 1): the depthwise kernel (depthwise.c), gemm.h */
#define ACT_HARDSIGMOID 6 /* clamp(alpha x + beta, 0, 1): gemm.h (its Act carries alpha and beta) */
#define ACT_SIGMOID 7     /* 1 / (1 + exp(-x)), Cephes' expf as in Swish: gemm.h */
#define ACT_TANH 8        /* gelu.h's rational tanh: gemm.h */

#endif /* KILN_ACTIVATION_H */
