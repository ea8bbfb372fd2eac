/* The activations kiln's C kernels apply as they store a result (GEMMs, Winograd, group normalization), numbered as
   kiln.tactics.gemm_c.activation_code reads them from here. */
#ifndef KILN_ACTIVATION_H
#define KILN_ACTIVATION_H

#define ACT_RELU 1
#define ACT_SWISH 2   /* x * sigmoid(x): SiLU, ONNX's Swish with alpha 1 */

#endif /* KILN_ACTIVATION_H */
