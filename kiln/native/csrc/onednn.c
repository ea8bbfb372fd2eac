/* oneDNN primitives made once and run with no descriptor work per call (kiln.tactics.onednn_prim): a
   convolution, INT8 (u8/s8 activations times s8 weights with a scale per output channel, the output requantized to
   u8/s8 or left FP32) or floating point (FP32, or BF16 from FP32 weights reordered to bf16 once, reading and
   writing f32 or bf16 tensors), with the FP32 bias, a residual (oneDNN's sum post-op, accumulated where the output
   is written, or a binary add reading its own buffer) and an activation as post-ops; and a matrix product by a
   constant matrix (a linear layer) with the same types and epilogue. kiln_dnnl_conv_create and
   kiln_dnnl_matmul_create make the primitive for one input shape and reorder the weights into the layout its
   kernel reads (done once, at load; another shape's may read them); kiln_dnnl_run (onednn.h) sets the data
   pointers and executes. torch's oneDNN
   ops build their descriptors inside every call (~15-50 us each on Zen 4); this costs ~3 us.

   Links oneDNN's C API (libdnnl.so.3 from the `onednn-cpu-gomp` wheel, its headers from `onednn-devel-cpu-gomp`):
   the library is built only where both are installed (kiln.native.external). oneDNN's own int8 semantics apply:
   dst = requantize(post_ops(src_scale * w_scale[n] * sum((src - src_zp) * w) + bias)), the sum post-op adding
   r_scale * (residual - r_zp), padding a quantized zero (the source zero point). One handle runs one call at a
   time (its scratchpad is its own): the caller serializes. */
#include "onednn.h"

/* One convolution as kiln.tactics.onednn_prim.ConvCall lays it out, field by field. */
typedef struct {
  int64_t n, c, h, w, cout, kh, kw, sh, sw, pt, pl, pb, pr, dh, dw, groups;
  int32_t x_type, w_type, y_type, r_type;   /* T_*: w_type T_S8 is an INT8 convolution; r_type the residual's */
  int32_t residual, act;                    /* R_*, A_* */
  float act_alpha, act_beta;                /* oneDNN's parameters of the activation's algorithm */
  float x_scale, y_scale, r_scale;          /* INT8 only; y_scale unused for an FP32 output */
  int32_t x_zp, y_zp, r_zp;
  const float* w_scale;                     /* INT8: cout scales */
  const void* weights;                      /* [cout][c / groups][kh][kw]: s8 for INT8, else f32 */
  const float* bias;                        /* cout, or NULL */
} ConvCall;

static AttrSpec conv_attr(const ConvCall* p) {
  /* INT8 weights: a scale per output channel, axis 0 (oihw) or axes 0 and 1 (goihw) */
  const AttrSpec a = {p->w_type == T_S8, p->groups > 1 ? 3 : 1, p->y_type, p->residual, p->r_type, p->act,
                      p->act_alpha, p->act_beta, p->r_scale, p->r_zp, p->x_zp, p->y_zp};
  return a;
}

/* The handle for one convolution, or NULL with the reason in `error`; `share`: a handle of the same layer whose
   packed weights it reads where its kernel wants their layout (NULL: none). */
void* kiln_dnnl_conv_create(const ConvCall* p, const void* share, char* error, int64_t error_bytes) {
  Handle* h = new_handle(p->x_type, p->w_type, p->y_type, error, error_bytes);
  Making d = {0};
  if (!h) return NULL;
  const int quantized = p->w_type == T_S8;
  const int64_t oh = (p->h + p->pt + p->pb - ((p->kh - 1) * p->dh + 1)) / p->sh + 1;
  const int64_t ow = (p->w + p->pl + p->pr - ((p->kw - 1) * p->dw + 1)) / p->sw + 1;
  const int64_t g = p->groups;
  const dnnl_dims_t src_dims = {p->n, p->c, p->h, p->w}, dst_dims = {p->n, p->cout, oh, ow};
  /* grouped weights are 5-D [g][cout / g][c / g][kh][kw]; ungrouped ones 4-D (oneDNN's INT8 kernels take no g=1) */
  const dnnl_dims_t w_dims = {g, p->cout / g, p->c / g, p->kh, p->kw}, w_dims4 = {p->cout, p->c, p->kh, p->kw};
  const dnnl_dims_t b_dims = {p->cout};
  const int w_rank = g > 1 ? 5 : 4;
  const dnnl_dims_t strides = {p->sh, p->sw}, dilates = {p->dh - 1, p->dw - 1};
  const dnnl_dims_t pad_l = {p->pt, p->pl}, pad_r = {p->pb, p->pr};
  const AttrSpec spec = conv_attr(p);
  TRY(dnnl_memory_desc_create_with_tag(&d.src, 4, src_dims, TYPES[p->x_type], dnnl_nhwc));
  TRY(dnnl_memory_desc_create_with_tag(&d.dst, 4, dst_dims, TYPES[p->y_type], dnnl_nhwc));
  if (p->residual == R_ADD)
    TRY(dnnl_memory_desc_create_with_tag(&d.residual, 4, dst_dims, TYPES[p->r_type], dnnl_nhwc));
  TRY(dnnl_memory_desc_create_with_tag(&d.weights, w_rank, g > 1 ? w_dims : w_dims4, TYPES[p->w_type],
                                       dnnl_format_tag_any));
  TRY(dnnl_memory_desc_create_with_tag(&d.user_weights, w_rank, g > 1 ? w_dims : w_dims4,
                                       quantized ? dnnl_s8 : dnnl_f32, g > 1 ? dnnl_goihw : dnnl_oihw));
  TRY(dnnl_memory_desc_create_with_tag(&d.bias, 1, b_dims, dnnl_f32, dnnl_a));
  TRY(attributes(&spec, d.residual, &d.attr));
  TRY(dnnl_convolution_forward_primitive_desc_create(&d.pd, h->engine, dnnl_forward_inference,
                                                     dnnl_convolution_direct, d.src, d.weights, p->bias ? d.bias : NULL,
                                                     d.dst, strides, dilates, pad_l, pad_r, d.attr));
  const Quantization q = {p->x_scale, p->x_zp, p->cout, p->w_scale, p->y_type, p->y_scale, p->y_zp};
  return completed(h, &d, p->weights, share, quantized ? &q : NULL, p->bias, p->cout, error, error_bytes);
fail:
  return finished(h, &d, 0);
}

/* One matrix product as kiln.tactics.onednn_prim_linear.MatmulCall lays it out: x [m][k] times the constant
   weights [k][n], row-major in and out. */
typedef struct {
  int64_t m, k, n;
  int32_t x_type, w_type, y_type, r_type;   /* T_*: w_type T_S8 is an INT8 product; r_type the residual's */
  int32_t residual, act;                    /* R_*, A_* */
  float act_alpha, act_beta;
  float x_scale, y_scale, r_scale;          /* INT8 only */
  int32_t x_zp, y_zp, r_zp;
  int32_t w_scales;                         /* INT8: n (a scale per column) or 1 */
  int32_t any_rows;                         /* 1: made for any number of rows (m only the first bound) */
  const float* w_scale;
  const void* weights;                      /* [k][n]: s8 for INT8, else f32 */
  const float* bias;                        /* n, or NULL */
} MatmulCall;

/* The handle for one matrix product, or NULL with the reason in `error`; `share` as for a convolution. */
void* kiln_dnnl_matmul_create(const MatmulCall* p, const void* share, char* error, int64_t error_bytes) {
  Handle* h = new_handle(p->x_type, p->w_type, p->y_type, error, error_bytes);
  Making d = {0};
  if (!h) return NULL;
  const int quantized = p->w_type == T_S8;
  const int64_t rows = p->any_rows ? DNNL_RUNTIME_DIM_VAL : p->m;
  const dnnl_dims_t src_dims = {rows, p->k}, w_dims = {p->k, p->n}, dst_dims = {rows, p->n}, b_dims = {1, p->n};
  const dnnl_dims_t bound_src = {p->m, p->k}, bound_dst = {p->m, p->n};
  const AttrSpec spec = {quantized, p->w_scales > 1 ? 2 : 0, p->y_type, p->residual, p->r_type, p->act,
                         p->act_alpha, p->act_beta, p->r_scale, p->r_zp, p->x_zp, p->y_zp};
  TRY(dnnl_memory_desc_create_with_tag(&d.src, 2, src_dims, TYPES[p->x_type], dnnl_ab));
  TRY(dnnl_memory_desc_create_with_tag(&d.dst, 2, dst_dims, TYPES[p->y_type], dnnl_ab));
  if (p->residual == R_ADD) TRY(dnnl_memory_desc_create_with_tag(&d.residual, 2, dst_dims, TYPES[p->r_type], dnnl_ab));
  if (p->any_rows) {
    h->rows = p->m;
    TRY(dnnl_memory_desc_create_with_tag(&d.bound_src, 2, bound_src, TYPES[p->x_type], dnnl_ab));
    TRY(dnnl_memory_desc_create_with_tag(&d.bound_dst, 2, bound_dst, TYPES[p->y_type], dnnl_ab));
    if (p->residual == R_ADD)
      TRY(dnnl_memory_desc_create_with_tag(&d.bound_residual, 2, bound_dst, TYPES[p->r_type], dnnl_ab));
  }
  TRY(dnnl_memory_desc_create_with_tag(&d.weights, 2, w_dims, TYPES[p->w_type], dnnl_format_tag_any));
  TRY(dnnl_memory_desc_create_with_tag(&d.user_weights, 2, w_dims, quantized ? dnnl_s8 : dnnl_f32, dnnl_ab));
  TRY(dnnl_memory_desc_create_with_tag(&d.bias, 2, b_dims, dnnl_f32, dnnl_ab));
  TRY(attributes(&spec, d.residual, &d.attr));
  TRY(dnnl_matmul_primitive_desc_create(&d.pd, h->engine, d.src, d.weights, p->bias ? d.bias : NULL, d.dst, d.attr));
  const Quantization q = {p->x_scale, p->x_zp, p->w_scales, p->w_scale, p->y_type, p->y_scale, p->y_zp};
  return completed(h, &d, p->weights, share, quantized ? &q : NULL, p->bias, p->n, error, error_bytes);
fail:
  return finished(h, &d, 0);
}
