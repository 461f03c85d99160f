/* topk_scan.c built for AVX-512 (setup.py), like hstu_tile_avx512.c. */
#include "topk_scan.c"
