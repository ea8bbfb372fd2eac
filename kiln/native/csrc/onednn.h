/* What kiln's oneDNN primitives share (onednn.c): the handle a primitive runs from (its engine, stream, the
   memory objects of every argument it passes, src, dst and a separate residual first), the reason a step failed,
   post-ops from kiln's fused activations, and the call and teardown every primitive kind runs through. */
#ifndef KILN_ONEDNN_H
#define KILN_ONEDNN_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#include "lookup.h"

enum { T_F32 = 0, T_U8 = 1, T_S8 = 2, T_BF16 = 3 };   /* tensor types, as kiln.tactics.onednn_prim.TYPES */
/* fused activations (kiln.tactics.onednn_prim.ELTWISE), applied after the residual; alpha and beta are
   oneDNN's for each algorithm */
enum { A_NONE = 0, A_RELU, A_CLIP, A_HARDSWISH, A_SWISH, A_SIGMOID, A_TANH, A_HARDSIGMOID, A_ELU, A_SOFTPLUS,
       A_MISH, A_GELU_ERF, A_GELU_TANH, A_COUNT };
/* how a residual joins: accumulated where the output is written (oneDNN's sum post-op), or read from its own
   buffer (a binary add: a residual of another type than the output) */
enum { R_NONE = 0, R_SUM = 1, R_ADD = 2 };

static const dnnl_data_type_t TYPES[] = {dnnl_f32, dnnl_u8, dnnl_s8, dnnl_bf16};

#define MAX_ARGS 12

void kiln_dnnl_destroy(void* handle);

typedef struct {
  dnnl_engine_t engine;
  dnnl_stream_t stream;
  dnnl_primitive_t primitive;
  dnnl_memory_t mem[MAX_ARGS];   /* src, dst, [the residual when read from its own buffer], then constants */
  dnnl_exec_arg_t args[MAX_ARGS];
  int nargs;
  int residual_arg;   /* the index of the separate residual in mem, or 0: none */
  int weights_arg;    /* the index of the packed weights in mem (never 0: src comes first) */
  int shares_weights; /* its weights are another handle's packed ones, not its own copy */
  int64_t rows;       /* a product made for any number of rows: those src and dst are bound to now; else 0 */
} Handle;

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

static const dnnl_alg_kind_t ELTWISE[A_COUNT] = {
    dnnl_alg_kind_undef, dnnl_eltwise_relu, dnnl_eltwise_clip_v2, dnnl_eltwise_hardswish, dnnl_eltwise_swish,
    dnnl_eltwise_logistic, dnnl_eltwise_tanh, dnnl_eltwise_hardsigmoid, dnnl_eltwise_elu, dnnl_eltwise_soft_relu,
    dnnl_eltwise_mish, dnnl_eltwise_gelu_erf, dnnl_eltwise_gelu_tanh};

/* The post-ops of a fused epilogue: the residual (`residual`: R_*, of type `r_type`, scaled by r_scale less r_zp
   as oneDNN's sum reads it; `r_md` its layout for a binary add), then the activation `act`. A sum of the output's
   own type (`y_type`) leaves its type unset, "the destination's": oneDNN's bf16 matmul for any number of rows
   takes only that form (an explicit bf16 fell to ref:any, Zen 4). */
static dnnl_status_t epilogue(dnnl_post_ops_t ops, int residual, int32_t r_type, int32_t y_type, float r_scale,
                              int32_t r_zp, const_dnnl_memory_desc_t r_md, int32_t act, float alpha, float beta) {
  dnnl_status_t s = dnnl_success;
  if (act < 0 || act >= A_COUNT || (residual != R_NONE && (r_type < T_F32 || r_type > T_BF16)))
    return dnnl_invalid_arguments;
  if (residual == R_SUM)
    s = dnnl_post_ops_append_sum(ops, r_scale, r_zp, r_type == y_type ? dnnl_data_type_undef : TYPES[r_type]);
  if (residual == R_ADD) s = dnnl_post_ops_append_binary(ops, dnnl_binary_add, r_md);
  if (s == dnnl_success && act != A_NONE) s = dnnl_post_ops_append_eltwise(ops, ELTWISE[act], alpha, beta);
  return s;
}

/* What a primitive's attributes say: its quantization (INT8: scales and zero points, the weights' per output
   channel on the axes `w_scale_mask` names) and its epilogue. A zero point of 0 is left out, not set to 0: with a
   source zero point oneDNN 3.2's brgemm convolutions take their compensating path whatever its value (ResNet-50's
   3x3 512-channel layer at 7x7, Zen 4, 2 threads: 0.30 against 0.21 ms; at 14x14 x 256, 0.28 against 0.25). */
typedef struct {
  int32_t quantized, w_scale_mask, y_type, residual, r_type, act;
  float act_alpha, act_beta, r_scale;
  int32_t r_zp, x_zp, y_zp;
} AttrSpec;

static dnnl_status_t attributes(const AttrSpec* a, const_dnnl_memory_desc_t r_md, dnnl_primitive_attr_t* attr) {
  dnnl_status_t s = dnnl_primitive_attr_create(attr);
  if (s == dnnl_success) s = dnnl_primitive_attr_set_scratchpad_mode(*attr, dnnl_scratchpad_mode_user);
  if (s == dnnl_success && a->quantized) s = dnnl_primitive_attr_set_scales_mask(*attr, DNNL_ARG_SRC, 0);
  if (s == dnnl_success && a->quantized)
    s = dnnl_primitive_attr_set_scales_mask(*attr, DNNL_ARG_WEIGHTS, a->w_scale_mask);
  if (s == dnnl_success && a->quantized && a->x_zp)
    s = dnnl_primitive_attr_set_zero_points_mask(*attr, DNNL_ARG_SRC, 0);
  if (s == dnnl_success && a->quantized && a->y_type != T_F32) {
    s = dnnl_primitive_attr_set_scales_mask(*attr, DNNL_ARG_DST, 0);
    if (s == dnnl_success && a->y_zp) s = dnnl_primitive_attr_set_zero_points_mask(*attr, DNNL_ARG_DST, 0);
  }
  dnnl_post_ops_t ops;
  if (s == dnnl_success) s = dnnl_post_ops_create(&ops);
  if (s != dnnl_success) return s;
  s = epilogue(ops, a->residual, a->r_type, a->y_type, a->r_scale, a->r_zp, r_md, a->act, a->act_alpha,
               a->act_beta);
  if (s == dnnl_success) s = dnnl_primitive_attr_set_post_ops(*attr, ops);
  dnnl_post_ops_destroy(ops);
  return s;
}

/* The quantization parameters of an INT8 call: the source's scale and zero point, `w_scales` weight scales, and
   the output's scale and zero point unless it is FP32. */
typedef struct {
  float x_scale;
  int32_t x_zp;
  int64_t w_scales;
  const float* w_scale;
  int32_t y_type;
  float y_scale;
  int32_t y_zp;
} Quantization;

/* `q` as arguments of the handle. */
static dnnl_status_t quantization_args(Handle* h, const Quantization* q) {
  dnnl_memory_t m;
  dnnl_status_t s = vector(h->engine, dnnl_f32, 1, &q->x_scale, &m);
  if (s != dnnl_success) return s;
  add_arg(h, DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, m);
  if ((s = vector(h->engine, dnnl_f32, q->w_scales, q->w_scale, &m)) != dnnl_success) return s;
  add_arg(h, DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, m);
  if (q->x_zp) {   /* a zero point of 0 is not an attribute (AttrSpec) */
    if ((s = vector(h->engine, dnnl_s32, 1, &q->x_zp, &m)) != dnnl_success) return s;
    add_arg(h, DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC, m);
  }
  if (q->y_type == T_F32) return s;
  if ((s = vector(h->engine, dnnl_f32, 1, &q->y_scale, &m)) != dnnl_success) return s;
  add_arg(h, DNNL_ARG_ATTR_SCALES | DNNL_ARG_DST, m);
  if (!q->y_zp) return s;
  if ((s = vector(h->engine, dnnl_s32, 1, &q->y_zp, &m)) != dnnl_success) return s;
  add_arg(h, DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_DST, m);
  return s;
}

/* Adds the weights `share` (another handle of the same layer, or NULL) packed where `pd`'s kernel reads that same
   layout (oneDNN's layouts seldom depend on the input's shape: one copy serves every shape of a dynamic engine). */
static int shared_weights(Handle* h, const_dnnl_memory_desc_t packed_md, const Handle* share, dnnl_status_t* s) {
  const_dnnl_memory_desc_t share_md = NULL;
  void* data = NULL;
  dnnl_memory_t m = NULL;
  if (!share || !share->weights_arg) return 0;
  if (dnnl_memory_get_memory_desc(share->mem[share->weights_arg], &share_md) != dnnl_success ||
      !dnnl_memory_desc_equal(share_md, packed_md) ||
      dnnl_memory_get_data_handle(share->mem[share->weights_arg], &data) != dnnl_success)
    return 0;
  if ((*s = dnnl_memory_create(&m, packed_md, h->engine, data)) != dnnl_success) return 1;
  h->weights_arg = h->nargs;
  h->shares_weights = 1;
  add_arg(h, DNNL_ARG_WEIGHTS, m);
  return 1;
}

/* Adds `weights` (laid out as `user_md`) as `pd`'s kernel reads them: `share`'s packed copy where it has that
   layout, else reordered once into a copy of its own. */
static dnnl_status_t packed_weights(Handle* h, const_dnnl_primitive_desc_t pd, const_dnnl_memory_desc_t user_md,
                                    const void* weights, const Handle* share) {
  dnnl_primitive_desc_t reorder_pd = NULL;
  dnnl_primitive_t reorder = NULL;
  dnnl_memory_t user = NULL, m = NULL;
  const_dnnl_memory_desc_t packed_md = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
  dnnl_status_t s = dnnl_success;
  if (shared_weights(h, packed_md, share, &s)) return s;
  if ((s = dnnl_memory_create(&m, packed_md, h->engine, DNNL_MEMORY_ALLOCATE)) != dnnl_success) return s;
  h->weights_arg = h->nargs;
  add_arg(h, DNNL_ARG_WEIGHTS, m);
  s = dnnl_memory_create(&user, user_md, h->engine, (void*)weights);
  if (s == dnnl_success) s = dnnl_reorder_primitive_desc_create(&reorder_pd, user_md, h->engine, packed_md,
                                                                h->engine, NULL);
  if (s == dnnl_success) s = dnnl_primitive_create(&reorder, reorder_pd);
  dnnl_exec_arg_t reorder_args[2] = {{DNNL_ARG_FROM, user}, {DNNL_ARG_TO, m}};
  if (s == dnnl_success) s = dnnl_primitive_execute(reorder, h->stream, 2, reorder_args);
  if (s == dnnl_success) s = dnnl_stream_wait(h->stream);
  dnnl_primitive_destroy(reorder);
  dnnl_primitive_desc_destroy(reorder_pd);
  dnnl_memory_destroy(user);
  return s;
}

/* The handle's primitive from `pd`, and its src, dst and (for a binary add) residual arguments, their data set
   per call. */
static dnnl_status_t open_handle(Handle* h, const_dnnl_primitive_desc_t pd, const_dnnl_memory_desc_t src_md,
                                 const_dnnl_memory_desc_t dst_md, const_dnnl_memory_desc_t r_md) {
  dnnl_memory_t m;
  dnnl_status_t s = dnnl_primitive_create(&h->primitive, pd);
  if (s == dnnl_success && (s = dnnl_memory_create(&m, src_md, h->engine, DNNL_MEMORY_NONE)) == dnnl_success)
    add_arg(h, DNNL_ARG_SRC, m);
  if (s == dnnl_success && (s = dnnl_memory_create(&m, dst_md, h->engine, DNNL_MEMORY_NONE)) == dnnl_success)
    add_arg(h, DNNL_ARG_DST, m);
  if (s == dnnl_success && r_md && (s = dnnl_memory_create(&m, r_md, h->engine, DNNL_MEMORY_NONE)) == dnnl_success) {
    h->residual_arg = h->nargs;
    add_arg(h, DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, m);
  }
  return s;
}

/* The bias (`n` FP32 values in the shape `pd` gives it, or NULL: none) and the scratchpad `pd` asks for, the
   handle's last arguments. */
static dnnl_status_t close_handle(Handle* h, const_dnnl_primitive_desc_t pd, const float* bias, int64_t n) {
  dnnl_memory_t m;
  dnnl_status_t s = dnnl_success;
  void* data = NULL;
  if (bias) {
    s = dnnl_memory_create(&m, dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 1), h->engine,
                           DNNL_MEMORY_ALLOCATE);
    if (s == dnnl_success) add_arg(h, DNNL_ARG_BIAS, m);
    if (s == dnnl_success) s = dnnl_memory_get_data_handle(m, &data);
    if (s == dnnl_success) memcpy(data, bias, (size_t)n * sizeof(float));
  }
  if (s == dnnl_success)
    s = dnnl_memory_create(&m, dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0), h->engine,
                           DNNL_MEMORY_ALLOCATE);
  if (s == dnnl_success) add_arg(h, DNNL_ARG_SCRATCHPAD, m);
  return s;
}

/* The descriptors a primitive is made from, released once it is made (or has failed); `bound_*`: src, dst and
   residual with the rows a product made for any number of rows is first bound to (else NULL: src, dst, residual). */
typedef struct {
  dnnl_memory_desc_t src, dst, residual, weights, user_weights, bias, bound_src, bound_dst, bound_residual;
  dnnl_primitive_attr_t attr;
  dnnl_primitive_desc_t pd;
} Making;

static void made(Making* m) {
  dnnl_primitive_desc_destroy(m->pd);
  dnnl_primitive_attr_destroy(m->attr);
  dnnl_memory_desc_t* mds[] = {&m->src, &m->dst, &m->residual, &m->weights, &m->user_weights, &m->bias,
                               &m->bound_src, &m->bound_dst, &m->bound_residual};
  for (size_t i = 0; i < sizeof(mds) / sizeof(mds[0]); ++i) dnnl_memory_desc_destroy(*mds[i]);
}

/* The handle's arguments once its primitive descriptor `d->pd` is made: src, dst and a separate residual (their
   data set per call), `weights` packed (or `share`'s: packed_weights), the quantization `q` (NULL: a
   floating-point call), the `n` bias values (NULL: none), the scratchpad. */
static dnnl_status_t fill_handle(Handle* h, const Making* d, const void* weights, const Handle* share,
                                 const Quantization* q, const float* bias, int64_t n) {
  dnnl_status_t s = d->bound_src ? open_handle(h, d->pd, d->bound_src, d->bound_dst, d->bound_residual)
                                   : open_handle(h, d->pd, d->src, d->dst, d->residual);
  if (s == dnnl_success) s = packed_weights(h, d->pd, d->user_weights, weights, share);
  if (s == dnnl_success && q) s = quantization_args(h, q);
  if (s == dnnl_success) s = close_handle(h, d->pd, bias, n);
  return s;
}

/* Whether `pd` runs one of oneDNN's optimized kernels; not where only its reference loops take the configuration
   (slower than every other tactic: refused, with the reason in `error`). */
static int optimized(const_dnnl_primitive_desc_t pd, char* error, int64_t error_bytes) {
  const char* impl = NULL;
  if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) != dnnl_success || !impl) return 1;
  if (strncmp(impl, "ref", 3) != 0) return 1;
  snprintf(error, (size_t)error_bytes, "oneDNN has only its reference kernel (%s) for this configuration", impl);
  return 0;
}

/* The descriptors released; the handle, or NULL (freed) where making it failed. */
static void* finished(Handle* h, Making* d, int ok) {
  made(d);
  if (ok) return h;
  kiln_dnnl_destroy(h);
  return NULL;
}

/* The handle once `d->pd` is made (finished: NULL, freed, with the reason in `error`, where oneDNN offers only its
   reference kernel or an argument cannot be made); fill_handle's arguments. */
static void* completed(Handle* h, Making* d, const void* weights, const void* share, const Quantization* q,
                       const float* bias, int64_t n, char* error, int64_t error_bytes) {
  if (!optimized(d->pd, error, error_bytes)) return finished(h, d, 0);
  const dnnl_status_t s = fill_handle(h, d, weights, (const Handle*)share, q, bias, n);
  if (s != dnnl_success) failed(error, error_bytes, "fill_handle()", s);
  return finished(h, d, s == dnnl_success);
}

/* A new handle with its engine and stream for a call of these tensor types, or NULL with the reason in `error`. */
static Handle* new_handle(int32_t x_type, int32_t w_type, int32_t y_type, char* error, int64_t error_bytes) {
  Handle* h = NULL;
  if (x_type < T_F32 || x_type > T_BF16 || y_type < T_F32 || y_type > T_BF16 || w_type < T_F32 || w_type > T_BF16) {
    snprintf(error, (size_t)error_bytes, "a tensor type outside T_F32..T_BF16");
    return NULL;
  }
  if (!(h = (Handle*)calloc(1, sizeof(Handle)))) return NULL;
  TRY(dnnl_engine_create(&h->engine, dnnl_cpu, 0));
  TRY(dnnl_stream_create(&h->stream, h->engine, dnnl_stream_default_flags));
  return h;
fail:
  kiln_dnnl_destroy(h);
  return NULL;
}

/* Sets the data pointers and executes (kiln_dnnl_run). */
static dnnl_status_t execute(Handle* h, const void* x, void* y, const void* r) {
  dnnl_status_t s = dnnl_memory_set_data_handle(h->mem[0], (void*)x);
  if (s == dnnl_success) s = dnnl_memory_set_data_handle(h->mem[1], y);
  if (s == dnnl_success && h->residual_arg) s = dnnl_memory_set_data_handle(h->mem[h->residual_arg], (void*)r);
  if (s == dnnl_success) s = dnnl_primitive_execute(h->primitive, h->stream, h->nargs, h->args);
  if (s == dnnl_success) s = dnnl_stream_wait(h->stream);
  return s;
}

/* Memory `i` of the handle (src, dst or the separate residual: 2-D, row-major) bound to `rows` rows. */
static dnnl_status_t rebind(Handle* h, int i, int64_t rows) {
  const_dnnl_memory_desc_t md = NULL;
  const dnnl_dims_t* dims = NULL;
  dnnl_data_type_t type = dnnl_data_type_undef;
  dnnl_memory_desc_t bound = NULL;
  dnnl_memory_t m = NULL;
  dnnl_status_t s = dnnl_memory_get_memory_desc(h->mem[i], &md);
  if (s == dnnl_success) s = dnnl_memory_desc_query(md, dnnl_query_dims, &dims);
  if (s == dnnl_success) s = dnnl_memory_desc_query(md, dnnl_query_data_type, &type);
  const dnnl_dims_t shape = {rows, dims ? (*dims)[1] : 0};
  if (s == dnnl_success) s = dnnl_memory_desc_create_with_tag(&bound, 2, shape, type, dnnl_ab);
  if (s == dnnl_success) s = dnnl_memory_create(&m, bound, h->engine, DNNL_MEMORY_NONE);
  dnnl_memory_desc_destroy(bound);
  if (s != dnnl_success) return s;
  dnnl_memory_destroy(h->mem[i]);
  h->mem[i] = h->args[i].memory = m;
  return s;
}

/* One call: x into y (holding the residual where it is summed in place); r, a residual read from its own buffer;
   `rows`: the rows of a product made for any number of rows (else unread). Returns 0, or oneDNN's status. */
int64_t kiln_dnnl_run(void* handle, int64_t rows, const void* x, void* y, const void* r) {
  Handle* h = (Handle*)handle;
  dnnl_status_t s = dnnl_success;
  if (h->rows && rows < 1) return (int64_t)dnnl_invalid_arguments;
  if (h->rows && rows != h->rows) {
    s = rebind(h, 0, rows);
    if (s == dnnl_success) s = rebind(h, 1, rows);
    if (s == dnnl_success && h->residual_arg) s = rebind(h, h->residual_arg, rows);
    h->rows = s == dnnl_success ? rows : -1;   /* -1: rebind again next call */
    if (s != dnnl_success) return (int64_t)s;
  }
  return (int64_t)execute(h, x, y, r);
}

enum { CHAIN_FIELDS = 7 };   /* per call in kiln_dnnl_run_chain, as kiln.runtime.chains.FIELDS */

/* A kernel of kiln's own in a chain (kiln.tactics.base.CallLink): its parameters for the input shapes, its input,
   its second input (NULL: none) and its output. */
typedef void (*ChainFn)(const int64_t* params, const void* x, const void* x2, void* y);

/* Calls run in order as one (kiln.runtime.chains). Call i with a handle runs that primitive with the values
   calls[7i..7i+6]: its rows (kiln_dnnl_run's), the slots of x, y and the residual (-1: none) in `slots`, the
   buffers' addresses, the bytes of the residual copied into y before the call (0: y holds it already, or it is
   read from its own buffer by a binary add), and the address of a 256-byte table y's bytes are then mapped
   through in place (0: none) with y's size in bytes. Call i without one (NULL) runs the ChainFn at calls[7i] on
   the slots of x, y and x2 (-1: none) with the parameters at calls[7i+5]. Returns 0, or oneDNN's status with the
   failing call's index in *failed. */
int64_t kiln_dnnl_run_chain(int64_t n, void* const* handles, const int64_t* calls, void* const* slots,
                            int64_t* failed) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* c = calls + CHAIN_FIELDS * i;
    const Handle* h = (const Handle*)handles[i];
    void* y = slots[c[2]];
    const void* r = c[3] < 0 ? NULL : slots[c[3]];
    if (!h) {
      ((ChainFn)(intptr_t)c[0])((const int64_t*)(intptr_t)c[5], slots[c[1]], r, y);
      continue;
    }
    if (c[4] > 0) memcpy(y, r, (size_t)c[4]);
    const int64_t s = kiln_dnnl_run(handles[i], c[0], slots[c[1]], y, h->residual_arg ? r : NULL);
    if (s) {
      *failed = i;
      return s;
    }
    if (c[5]) lookup_bytes_shared((const uint8_t*)y, (uint8_t*)y, c[6], (const uint8_t*)(intptr_t)c[5]);
  }
  return 0;
}

/* 1 where the handle reads another handle's packed weights (that one must outlive it), 0 where it owns its own. */
int64_t kiln_dnnl_shares_weights(const void* handle) { return ((const Handle*)handle)->shares_weights; }

void kiln_dnnl_destroy(void* handle) {
  Handle* h = (Handle*)handle;
  if (!h) return;
  for (int i = 0; i < h->nargs; ++i) dnnl_memory_destroy(h->mem[i]);
  dnnl_primitive_destroy(h->primitive);
  dnnl_stream_destroy(h->stream);
  dnnl_engine_destroy(h->engine);
  free(h);
}

#endif
