/* hstu_tile.c built for AVX-512 (setup.py): its own source file, so the two builds of the
 * same kernels have their own object files. */
#include "hstu_tile.c"
