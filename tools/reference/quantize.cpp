// llama.cpp's own quantizer (llama_model_quantize) for the tests: a generated model's
// weights written in one type, every matrix in it (`pure`), so that the engine's kernels for
// that type run on a model the tests make in seconds, without a download. A quantized model
// is quantized again (the benchmarks' Q4_0 and Q8_0 models of a real one).
//
//   meshnet-quantize IN.gguf OUT.gguf TYPE     TYPE: f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1
//                                              q2_k q3_k q4_k q5_k q6_k iq4_nl iq4_xs
#include "llama.h"

#include <cstdio>
#include <cstring>

static const struct {
    const char * name;
    llama_ftype ftype;
} TYPES[] = {
    { "f16", LLAMA_FTYPE_MOSTLY_F16 },       { "bf16", LLAMA_FTYPE_MOSTLY_BF16 },
    { "q8_0", LLAMA_FTYPE_MOSTLY_Q8_0 },     { "q4_0", LLAMA_FTYPE_MOSTLY_Q4_0 },
    { "q4_1", LLAMA_FTYPE_MOSTLY_Q4_1 },     { "q5_0", LLAMA_FTYPE_MOSTLY_Q5_0 },
    { "q5_1", LLAMA_FTYPE_MOSTLY_Q5_1 },     { "q2_k", LLAMA_FTYPE_MOSTLY_Q2_K },
    { "q3_k", LLAMA_FTYPE_MOSTLY_Q3_K_S },   { "q4_k", LLAMA_FTYPE_MOSTLY_Q4_K_S },
    { "q5_k", LLAMA_FTYPE_MOSTLY_Q5_K_S },   { "q6_k", LLAMA_FTYPE_MOSTLY_Q6_K },
    { "iq4_nl", LLAMA_FTYPE_MOSTLY_IQ4_NL }, { "iq4_xs", LLAMA_FTYPE_MOSTLY_IQ4_XS },
};

int main(int argc, char ** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s IN.gguf OUT.gguf TYPE\n", argv[0]);
        return 2;
    }
    llama_model_quantize_params params = llama_model_quantize_default_params();
    bool found = false;
    for (const auto & t : TYPES) {
        if (std::strcmp(argv[3], t.name) == 0) {
            params.ftype = t.ftype;
            found = true;
        }
    }
    if (!found) {
        std::fprintf(stderr, "unknown type '%s'\n", argv[3]);
        return 2;
    }
    params.pure = true;
    params.allow_requantize = true;
    params.nthread = 1;
    llama_backend_init();
    const uint32_t status = llama_model_quantize(argv[1], argv[2], &params);
    llama_backend_free();
    if (status != 0) {
        std::fprintf(stderr, "llama_model_quantize failed (%u)\n", status);
        return 1;
    }
    return 0;
}
