/* The AVX2 variant (ISA_AVX2): the plain C loops of base.c (DEFINE_DOTS, DEFINE_SUM in common.h) compiled for
 * AVX2+FMA+F16C; expert_generic and linear_rows (base.c) run them. */
#include "common.h"

DEFINE_DOTS(avx2, __attribute__((target("avx2,fma,f16c"))))
DEFINE_SUM(sum_avx2, __attribute__((target("avx2,fma"))))
