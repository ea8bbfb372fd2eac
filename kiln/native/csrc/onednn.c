/* oneDNN primitives made once and run with no descriptor work per call (kiln.tactics.onednn_prim): an INT8
   convolution, u8/s8 activations times s8 weights with a scale per output channel, the FP32 bias, an INT8 residual
   as the `sum` post-op, an activation as an eltwise post-op, and the output requantized to u8/s8 or left FP32.
   kiln_dnnl_conv_create makes the primitive for one input shape and reorders the weights into the layout its
   kernel reads (done once, at load); kiln_dnnl_conv_run sets the two data pointers and executes. torch's oneDNN
   ops build their descriptors inside every call (~30 us each on Zen 4); this costs ~3 us.

   Links oneDNN's C API (libdnnl.so.3 from the `onednn-cpu-gomp` wheel, its headers from `onednn-devel-cpu-gomp`):
   the library is built only where both are installed (kiln.native.external). oneDNN's own int8 semantics apply:
   dst = requantize(post_ops(src_scale * w_scale[n] * sum((src - src_zp) * w) + bias)), the sum post-op adding
   r_scale * (residual - r_zp), padding a quantized zero (the source zero point). One handle runs one call at a
   time (its scratchpad is its own): the caller serializes. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

enum { T_F32 = 0, T_U8 = 1, T_S8 = 2 };   /* as qgemm.c's OUT_* */
enum { A_NONE = 0, A_RELU = 1, A_CLIP = 2, A_HARDSWISH = 3, A_SWISH = 4 };

/* One convolution as kiln.tactics.onednn_prim.ConvCall lays it out, field by field. */
typedef struct {
  int64_t n, c, h, w, cout, kh, kw, sh, sw, pt, pl, pb, pr, dh, dw, groups;
  int32_t x_type, y_type, r_type;   /* r_type: the residual's (T_U8/T_S8), or -1: no residual */
  int32_t act;                      /* A_*, applied after the residual sum */
  float act_lo, act_hi;             /* A_CLIP's bounds */
  float x_scale, y_scale, r_scale;  /* y_scale unused for an FP32 output */
  int32_t x_zp, y_zp, r_zp, pad_;
  const float* w_scale;             /* cout scales */
  const int8_t* weights;            /* [cout][c / groups][kh][kw] */
  const float* bias;                /* cout, or NULL */
} ConvCall;

typedef struct {
  dnnl_engine_t engine;
  dnnl_stream_t stream;
  dnnl_primitive_t conv;
  dnnl_memory_t mem[12];   /* every memory object the call passes (src and dst first) */
  dnnl_exec_arg_t args[12];
  int nargs;
  float x_scale, y_scale;
  int32_t x_zp, y_zp;
} Handle;

static const dnnl_data_type_t TYPES[] = {dnnl_f32, dnnl_u8, dnnl_s8};

/* The reason a step failed: the oneDNN function's name (the call's text up to its parenthesis) and status. */
static void failed(char* error, int64_t error_bytes, const char* call, dnnl_status_t status) {
  const char* open = strchr(call, '(');
  const char* why = status == dnnl_unimplemented ? "no kernel for this configuration"
                    : status == dnnl_out_of_memory ? "out of memory" : "an error";
  snprintf(error, (size_t)error_bytes, "%.*s: %s (status %d)", open ? (int)(open - call) : 64, call, why,
           (int)status);
}

#define TRY(call)                                             \
  do {                                                        \
    const dnnl_status_t status_ = (call);                     \
    if (status_ != dnnl_success) {                            \
      failed(error, error_bytes, #call, status_);             \
      goto fail;                                              \
    }                                                         \
  } while (0)

/* Adds memory `m` as argument `arg` of the handle's call. */
static void add_arg(Handle* h, int arg, dnnl_memory_t m) {
  h->mem[h->nargs] = m;
  h->args[h->nargs].arg = arg;
  h->args[h->nargs].memory = m;
  h->nargs++;
}

static dnnl_status_t attributes(const ConvCall* p, dnnl_primitive_attr_t* attr) {
  dnnl_status_t s = dnnl_primitive_attr_create(attr);
  if (s == dnnl_success) s = dnnl_primitive_attr_set_scratchpad_mode(*attr, dnnl_scratchpad_mode_user);
  if (s == dnnl_success) s = dnnl_primitive_attr_set_scales_mask(*attr, DNNL_ARG_SRC, 0);
  if (s == dnnl_success)   /* a scale per output channel: axis 0 (oihw), or axes 0 and 1 (goihw) */
    s = dnnl_primitive_attr_set_scales_mask(*attr, DNNL_ARG_WEIGHTS, p->groups > 1 ? 3 : 1);
  if (s == dnnl_success) s = dnnl_primitive_attr_set_zero_points_mask(*attr, DNNL_ARG_SRC, 0);
  if (s == dnnl_success && p->y_type != T_F32) {
    s = dnnl_primitive_attr_set_scales_mask(*attr, DNNL_ARG_DST, 0);
    if (s == dnnl_success) s = dnnl_primitive_attr_set_zero_points_mask(*attr, DNNL_ARG_DST, 0);
  }
  dnnl_post_ops_t ops;
  if (s == dnnl_success) s = dnnl_post_ops_create(&ops);
  if (s != dnnl_success) return s;
  if (p->r_type >= 0) s = dnnl_post_ops_append_sum(ops, p->r_scale, p->r_zp, TYPES[p->r_type]);
  if (s == dnnl_success && p->act == A_RELU) s = dnnl_post_ops_append_eltwise(ops, dnnl_eltwise_relu, 0.f, 0.f);
  if (s == dnnl_success && p->act == A_CLIP)
    s = dnnl_post_ops_append_eltwise(ops, dnnl_eltwise_clip_v2, p->act_lo, p->act_hi);
  if (s == dnnl_success && p->act == A_HARDSWISH)
    s = dnnl_post_ops_append_eltwise(ops, dnnl_eltwise_hardswish, 1.f / 6.f, 0.5f);
  if (s == dnnl_success && p->act == A_SWISH) s = dnnl_post_ops_append_eltwise(ops, dnnl_eltwise_swish, 1.f, 0.f);
  if (s == dnnl_success) s = dnnl_primitive_attr_set_post_ops(*attr, ops);
  dnnl_post_ops_destroy(ops);
  return s;
}

/* A 1-D f32 or s32 memory of `n` values, allocated by oneDNN and filled from `values`. */
static dnnl_status_t vector(dnnl_engine_t engine, dnnl_data_type_t type, int64_t n, const void* values,
                            dnnl_memory_t* m) {
  dnnl_memory_desc_t md;
  const dnnl_dims_t dims = {n};
  dnnl_status_t s = dnnl_memory_desc_create_with_tag(&md, 1, dims, type, dnnl_a);
  if (s != dnnl_success) return s;
  s = dnnl_memory_create(m, md, engine, DNNL_MEMORY_ALLOCATE);
  dnnl_memory_desc_destroy(md);
  void* data = NULL;
  if (s == dnnl_success) s = dnnl_memory_get_data_handle(*m, &data);
  if (s == dnnl_success) memcpy(data, values, (size_t)n * 4);
  return s;
}

void kiln_dnnl_conv_destroy(void* handle);

/* The handle for one convolution, or NULL with the reason in `error`. */
void* kiln_dnnl_conv_create(const ConvCall* p, char* error, int64_t error_bytes) {
  Handle* h = (Handle*)calloc(1, sizeof(Handle));
  dnnl_memory_desc_t src_md = NULL, dst_md = NULL, w_md = NULL, w_user_md = NULL, b_md = NULL;
  dnnl_primitive_attr_t attr = NULL;
  dnnl_primitive_desc_t pd = NULL, reorder_pd = NULL;
  dnnl_primitive_t reorder = NULL;
  dnnl_memory_t w_user = NULL;
  if (!h) return NULL;
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
  TRY(dnnl_engine_create(&h->engine, dnnl_cpu, 0));
  TRY(dnnl_stream_create(&h->stream, h->engine, dnnl_stream_default_flags));
  TRY(dnnl_memory_desc_create_with_tag(&src_md, 4, src_dims, TYPES[p->x_type], dnnl_nhwc));
  TRY(dnnl_memory_desc_create_with_tag(&dst_md, 4, dst_dims, TYPES[p->y_type], dnnl_nhwc));
  TRY(dnnl_memory_desc_create_with_tag(&w_md, w_rank, g > 1 ? w_dims : w_dims4, dnnl_s8, dnnl_format_tag_any));
  TRY(dnnl_memory_desc_create_with_tag(&w_user_md, w_rank, g > 1 ? w_dims : w_dims4, dnnl_s8,
                                       g > 1 ? dnnl_goihw : dnnl_oihw));
  TRY(dnnl_memory_desc_create_with_tag(&b_md, 1, b_dims, dnnl_f32, dnnl_a));
  TRY(attributes(p, &attr));
  TRY(dnnl_convolution_forward_primitive_desc_create(&pd, h->engine, dnnl_forward_inference,
                                                     dnnl_convolution_direct, src_md, w_md, p->bias ? b_md : NULL,
                                                     dst_md, strides, dilates, pad_l, pad_r, attr));
  TRY(dnnl_primitive_create(&h->conv, pd));
  dnnl_memory_t m;
  TRY(dnnl_memory_create(&m, src_md, h->engine, DNNL_MEMORY_NONE));
  add_arg(h, DNNL_ARG_SRC, m);
  TRY(dnnl_memory_create(&m, dst_md, h->engine, DNNL_MEMORY_NONE));
  add_arg(h, DNNL_ARG_DST, m);
  /* the weights, reordered once into the layout the chosen kernel reads */
  const_dnnl_memory_desc_t packed_md = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
  TRY(dnnl_memory_create(&m, packed_md, h->engine, DNNL_MEMORY_ALLOCATE));
  add_arg(h, DNNL_ARG_WEIGHTS, m);
  TRY(dnnl_memory_create(&w_user, w_user_md, h->engine, (void*)p->weights));
  TRY(dnnl_reorder_primitive_desc_create(&reorder_pd, w_user_md, h->engine, packed_md, h->engine, NULL));
  TRY(dnnl_primitive_create(&reorder, reorder_pd));
  dnnl_exec_arg_t reorder_args[2] = {{DNNL_ARG_FROM, w_user}, {DNNL_ARG_TO, m}};
  TRY(dnnl_primitive_execute(reorder, h->stream, 2, reorder_args));
  TRY(dnnl_stream_wait(h->stream));
  if (p->bias) {
    TRY(vector(h->engine, dnnl_f32, p->cout, p->bias, &m));
    add_arg(h, DNNL_ARG_BIAS, m);
  }
  TRY(vector(h->engine, dnnl_f32, 1, &p->x_scale, &m));
  add_arg(h, DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, m);
  TRY(vector(h->engine, dnnl_f32, p->cout, p->w_scale, &m));
  add_arg(h, DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, m);
  TRY(vector(h->engine, dnnl_s32, 1, &p->x_zp, &m));
  add_arg(h, DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC, m);
  if (p->y_type != T_F32) {
    TRY(vector(h->engine, dnnl_f32, 1, &p->y_scale, &m));
    add_arg(h, DNNL_ARG_ATTR_SCALES | DNNL_ARG_DST, m);
    TRY(vector(h->engine, dnnl_s32, 1, &p->y_zp, &m));
    add_arg(h, DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_DST, m);
  }
  TRY(dnnl_memory_create(&m, dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0), h->engine,
                         DNNL_MEMORY_ALLOCATE));
  add_arg(h, DNNL_ARG_SCRATCHPAD, m);
  goto done;
fail:
  kiln_dnnl_conv_destroy(h);
  h = NULL;
done:
  dnnl_primitive_destroy(reorder);
  dnnl_primitive_desc_destroy(reorder_pd);
  dnnl_memory_destroy(w_user);
  dnnl_primitive_desc_destroy(pd);
  dnnl_primitive_attr_destroy(attr);
  dnnl_memory_desc_destroy(src_md);
  dnnl_memory_desc_destroy(dst_md);
  dnnl_memory_desc_destroy(w_md);
  dnnl_memory_desc_destroy(w_user_md);
  dnnl_memory_desc_destroy(b_md);
  return h;
}

/* One call: x (NHWC, the handle's shape and type) into y (NHWC; holding the residual where there is one).
   Returns 0, or oneDNN's status. */
int64_t kiln_dnnl_conv_run(void* handle, const void* x, void* y) {
  Handle* h = (Handle*)handle;
  dnnl_status_t s = dnnl_memory_set_data_handle(h->mem[0], (void*)x);
  if (s == dnnl_success) s = dnnl_memory_set_data_handle(h->mem[1], y);
  if (s == dnnl_success) s = dnnl_primitive_execute(h->conv, h->stream, h->nargs, h->args);
  if (s == dnnl_success) s = dnnl_stream_wait(h->stream);
  return (int64_t)s;
}

void kiln_dnnl_conv_destroy(void* handle) {
  Handle* h = (Handle*)handle;
  if (!h) return;
  for (int i = 0; i < h->nargs; ++i) dnnl_memory_destroy(h->mem[i]);
  dnnl_primitive_destroy(h->conv);
  dnnl_stream_destroy(h->stream);
  dnnl_engine_destroy(h->engine);
  free(h);
}
