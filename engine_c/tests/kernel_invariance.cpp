// Row invariance of the CPU matmul kernels, type by type, through ggml's own API.
//
// meshnet's invariant numerics class promises a row the same floats however many rows share
// its forward call (engine_c/patches/0005 and 0015). That is a property of each matmul kernel
// the CPU backend picks, by weight type, weight layout (plain or repacked) and row count, so
// it is checked here kernel by kernel, where a failure names the kernel: for each weight type,
// in each layout the machine has for it, the product of the same input rows is computed in
// calls of 1, 2, 3 ... rows and every row must equal, bit for bit, its product alone.
//
// With --stock the same comparison runs with the flag off and prints which kernels change a
// row's result with the row count (the reason the flag exists); it fails nothing.
// With --bench it times a call of each row count per kernel, invariant against stock.
//
// usage: kernel_invariance [--stock] [--bench] [--threads N] [TYPE...]

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

// a model's shapes: K a multiple of 256 (the K-quants' block), N rows of weights that cover
// both the 16-column and the 8-column tiles of the repacked kernels (2 x 16 + 8); --bench
// times a matrix of a small model's size
constexpr int64_t K = 1536;
int64_t N = 40;
constexpr int64_t N_BENCH = 4096;
constexpr int ROW_COUNTS[] = {1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 31, 32, 33, 64};
constexpr int MAX_ROWS = 64;

const ggml_type TYPES[] = {
    GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16, GGML_TYPE_Q8_0,   GGML_TYPE_Q4_0,   GGML_TYPE_Q4_1,
    GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q2_K, GGML_TYPE_Q3_K,   GGML_TYPE_Q4_K,   GGML_TYPE_Q5_K,
    GGML_TYPE_Q6_K, GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_XS, GGML_TYPE_MXFP4,
};

struct options {
    bool stock = false;
    bool bench = false;
    int threads = 2;
    std::vector<ggml_type> types;
};

ggml_backend_buffer_type_t repack_buft(ggml_backend_t backend) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get_extra) {
        return nullptr;
    }
    for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b; b++) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            return *b;
        }
    }
    return nullptr;
}

// one weight matrix in one layout, and the product of its first n input rows
struct kernel {
    ggml_type type;
    const char * layout;
    ggml_backend_t backend;
    ggml_context * wctx = nullptr;
    ggml_backend_buffer_t wbuf = nullptr;
    ggml_tensor * w = nullptr;

    bool load(ggml_backend_buffer_type_t buft, const std::vector<float> & weights) {
        ggml_init_params ip = { ggml_tensor_overhead() * 2, nullptr, true };
        wctx = ggml_init(ip);
        w = ggml_new_tensor_2d(wctx, type, K, N);
        wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft);
        if (!wbuf) {
            return false;
        }
        if (strcmp(layout, "repacked") == 0 && w->extra == nullptr) {
            return false;   // no repacked kernel for this type on this machine
        }
        std::vector<uint8_t> data(ggml_nbytes(w));
        if (type == GGML_TYPE_F32) {
            memcpy(data.data(), weights.data(), data.size());
        } else {
            ggml_quantize_init(type);
            ggml_quantize_chunk(type, weights.data(), data.data(), 0, N, K, nullptr);
        }
        ggml_backend_tensor_set(w, data.data(), 0, data.size());
        return true;
    }

    // the product of the first n rows of x (each K floats), n x N floats
    std::vector<float> product(const std::vector<float> & x, int n, double * seconds = nullptr, int repeats = 1) {
        ggml_init_params ip = { ggml_tensor_overhead() * 4 + ggml_graph_overhead(), nullptr, true };
        ggml_context * ctx = ggml_init(ip);
        ggml_tensor * in = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, n);
        ggml_tensor * out = ggml_mul_mat(ctx, w, in);
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
        ggml_backend_tensor_set(in, x.data(), 0, sizeof(float) * K * n);
        auto t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < repeats; r++) {
            if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
                fprintf(stderr, "compute failed\n");
                exit(2);
            }
        }
        if (seconds) {
            *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / repeats;
        }
        std::vector<float> result((size_t) n * N);
        ggml_backend_tensor_get(out, result.data(), 0, sizeof(float) * result.size());
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
        return result;
    }

    ~kernel() {
        if (wbuf) ggml_backend_buffer_free(wbuf);
        if (wctx) ggml_free(wctx);
    }
};

// the row counts at which some row's product differs from the same row's product alone
std::string varying_counts(kernel & k, const std::vector<float> & x, double * max_diff) {
    std::vector<std::vector<float>> alone(MAX_ROWS);
    for (int r = 0; r < MAX_ROWS; r++) {
        std::vector<float> row(x.begin() + (size_t) r * K, x.begin() + (size_t) (r + 1) * K);
        alone[r] = k.product(row, 1);
    }
    std::string counts;
    *max_diff = 0;
    for (int n : ROW_COUNTS) {
        std::vector<float> together = k.product(x, n);
        bool same = true;
        for (int r = 0; r < n; r++) {
            for (int j = 0; j < N; j++) {
                float a = alone[r][j], b = together[(size_t) r * N + j];
                if (memcmp(&a, &b, sizeof a) != 0) {
                    same = false;
                    *max_diff = std::max(*max_diff, (double) std::fabs(a - b));
                }
            }
        }
        if (!same) {
            counts += (counts.empty() ? "" : ",") + std::to_string(n);
        }
    }
    return counts;
}

options parse(int argc, char ** argv) {
    options o;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--stock") {
            o.stock = true;
        } else if (a == "--bench") {
            o.bench = true;
        } else if (a == "--threads" && i + 1 < argc) {
            o.threads = atoi(argv[++i]);
        } else {
            bool found = false;
            for (ggml_type t : TYPES) {
                if (a == ggml_type_name(t)) {
                    o.types.push_back(t);
                    found = true;
                }
            }
            if (!found) {
                fprintf(stderr, "unknown argument or type '%s'\n", a.c_str());
                exit(2);
            }
        }
    }
    if (o.types.empty()) {
        o.types.assign(std::begin(TYPES), std::end(TYPES));
    }
    return o;
}

}  // namespace

int main(int argc, char ** argv) {
    options o = parse(argc, argv);
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, o.threads);
    ggml_backend_cpu_set_row_invariant(backend, !o.stock);
    ggml_backend_buffer_type_t repacked = repack_buft(backend);

    std::mt19937 rng(1234);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    if (o.bench) {
        N = N_BENCH;
    }
    std::vector<float> weights((size_t) K * N), x((size_t) K * MAX_ROWS);
    for (float & v : weights) v = normal(rng) * 0.05f;
    for (float & v : x) v = normal(rng);

    int failed = 0;
    printf("%-8s %-9s %s\n", "type", "layout", o.stock ? "row counts that change a row (stock kernels)" : "row counts that change a row");
    for (ggml_type type : o.types) {
        for (int l = 0; l < 2; l++) {
            kernel k{type, l == 0 ? "plain" : "repacked", backend};
            ggml_backend_buffer_type_t buft = l == 0 ? ggml_backend_cpu_buffer_type() : repacked;
            if (!buft || !k.load(buft, weights)) {
                continue;
            }
            double max_diff = 0;
            std::string counts = o.bench ? "" : varying_counts(k, x, &max_diff);
            if (o.bench) {
                printf("%-8s %-9s (timed only)\n", ggml_type_name(type), k.layout);
            } else if (counts.empty()) {
                printf("%-8s %-9s none\n", ggml_type_name(type), k.layout);
            } else {
                printf("%-8s %-9s %s (max |diff| %.3g)\n", ggml_type_name(type), k.layout, counts.c_str(), max_diff);
                failed += !o.stock;
            }
            if (o.bench) {
                // the two modes in turns, medians of 7 rounds: this VM's speed drifts
                for (int n : {1, 4, 16, 64}) {
                    std::vector<double> times[2];
                    for (int round = 0; round < 7; round++) {
                        for (int mode = 0; mode < 2; mode++) {
                            ggml_backend_cpu_set_row_invariant(backend, mode == 0);
                            double s = 0;
                            k.product(x, n, &s, 10);
                            times[mode].push_back(s);
                        }
                    }
                    ggml_backend_cpu_set_row_invariant(backend, !o.stock);
                    for (auto & t : times) {
                        std::sort(t.begin(), t.end());
                    }
                    double inv = times[0][3], stock = times[1][3];
                    printf("    %2d rows: invariant %8.1f us, stock %8.1f us, stock/invariant %.2f\n", n, inv * 1e6,
                           stock * 1e6, stock / inv);
                }
            }
        }
    }
    ggml_backend_free(backend);
    if (failed) {
        printf("%d kernel(s) give a row other floats with other row counts\n", failed);
        return 1;
    }
    return 0;
}
