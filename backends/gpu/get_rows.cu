// get_rows: out[k, :] = table[ids[k], :] as f32 (embedding lookup), any table format.
//
// One block per id, threads over the row. The id is read on the device; an id outside
// 0..rows-1 is reported through the error flag and its output row is left untouched.
#include "quant.cuh"

// Quantized tables: each thread decodes whole units (quant.cuh) and stores runs of 4 values.
template <class F>
DEVICE void get_rows_impl(const u8* __restrict__ table, long long row_bytes, const int* __restrict__ ids,
                          float* __restrict__ out, int rows, int dim, int* errflag, int code) {
    __shared__ float tab_smem[16];
    const float* tab = init_table<F>(tab_smem);
    const int id = ids[blockIdx.x];
    if (id < 0 || id >= rows) {
        if (threadIdx.x == 0) report_error(errflag, code, id);
        return;
    }
    const u8* row = table + (long long)id * row_bytes;
    float* o = out + (long long)blockIdx.x * dim;
    const int units = (dim / F::QK) * F::UPB;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        const int b = u / F::UPB, j = u - b * F::UPB;
        typename F::U q = F::load(row + (long long)b * F::BB, j);
        F::prep(q, j);
        float* ob = o + b * F::QK;
#pragma unroll
        for (int w = 0; w < F::WPU; ++w) {
            int o0, o1;
            F::offs(j, w, o0, o1);
            float v[8];
            decode_exact<F>(q, j, w, v, tab);
#pragma unroll
            for (int k = 0; k < 4; ++k) { ob[o0 + k] = v[k]; ob[o1 + k] = v[k + 4]; }
        }
    }
}

// Float tables (rows of any length, any alignment): one value per thread.
template <class F>
DEVICE void get_rows_float_impl(const u8* __restrict__ table, long long row_bytes, const int* __restrict__ ids,
                                float* __restrict__ out, int rows, int dim, int* errflag, int code) {
    const int id = ids[blockIdx.x];
    if (id < 0 || id >= rows) {
        if (threadIdx.x == 0) report_error(errflag, code, id);
        return;
    }
    const u8* row = table + (long long)id * row_bytes;
    float* o = out + (long long)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = F::elem(row, i);
}

// table: raw rows (row_bytes apart); ids: [n] i32; out: [n, dim] f32. Grid: n blocks.
#define DEFINE_GET_ROWS(name, F, impl)                                                                  \
    extern "C" __global__ void get_rows_##name(const u8* __restrict__ table, long long row_bytes,         \
                                               const int* __restrict__ ids, float* __restrict__ out,     \
                                               int rows, int dim, int* errflag, int code) {              \
        PDL_ENTRY();                                                                                     \
        impl<F>(table, row_bytes, ids, out, rows, dim, errflag, code);                                   \
    }
#define DEFINE_GET_ROWS_Q(name, F) DEFINE_GET_ROWS(name, F, get_rows_impl)
#define DEFINE_GET_ROWS_F(name, F) DEFINE_GET_ROWS(name, F, get_rows_float_impl)
FOR_EACH_QUANT(DEFINE_GET_ROWS_Q)
FOR_EACH_FLOAT(DEFINE_GET_ROWS_F)
