/* GELU's coefficients for the C kernels' epilogues (activation.h's ACT_GELU_ERF and ACT_GELU_TANH): erf and tanh as
   odd rational polynomials in x*x, p(x*x) * x / q(x*x) (the approximations Eigen and MLAS use; pointwise.h's k_erf
   and k_tanh unrolled), a few float ulps from the exact value. From the bound on the result is +-1 exactly (the
   rational gives 0.99999976 there for tanh: GELU of x = -1000 would be -1.2e-4, not 0). qgemm.c evaluates them with AVX-512 intrinsics, gemm.h with vector extensions (AVX2 builds too). */
#ifndef KILN_GELU_H
#define KILN_GELU_H

#define GELU_ERF_BOUND 4.0f
#define GELU_TANH_BOUND 7.90531110763549805f
static const float GELU_ERF_P[] = {-2.72614225801306e-10f, 2.77068142495902e-08f, -2.10102402082508e-06f,
                                   -5.69250639462346e-05f, -7.34990630326855e-04f, -2.95459980854025e-03f,
                                   -1.60960333262415e-02f};
static const float GELU_ERF_Q[] = {-1.45660718464996e-05f, -2.13374055278905e-04f, -1.68282697438203e-03f,
                                   -7.37332916720468e-03f, -1.42647390514189e-02f};
static const float GELU_TANH_P[] = {-2.76076847742355e-16f, 2.00018790482477e-13f, -8.60467152213735e-11f,
                                    5.12229709037114e-08f, 1.48572235717979e-05f, 6.37261928875436e-04f,
                                    4.89352455891786e-03f};
static const float GELU_TANH_Q[] = {1.19825839466702e-06f, 1.18534705686654e-04f, 2.26843463243900e-03f,
                                    4.89352518554385e-03f};
#define GELU_COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

#endif /* KILN_GELU_H */
