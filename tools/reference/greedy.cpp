// The reference meshnet's numerics classes are held to: stock llama.cpp (the pinned tree,
// whole model, none of meshnet's stage patches) generating greedily as llama-cpp-python
// does by default: the prompt in batches of n_batch (512, physical batches of 512), logits
// for the last prompt token only, then one token per call, no flash attention.
//
//   meshnet-reference MODEL N_PREDICT [--row-invariant] [--gpu] [--threads N] PROMPT...
//
// For each PROMPT (raw text, tokenized with the model's BOS as llama.cpp adds it) one
// line: the prompt's token ids, " |", and the N_PREDICT greedy token ids (no stop at an
// end-of-generation token). --row-invariant turns on the CPU backend's row-invariant mode,
// the invariant class's kernels: only in the build over the tree with meshnet's kernel
// patches (MESHNET_ROW_INVARIANT, make reference). --gpu puts every layer on the GPU, in a build
// with a GPU backend (tools/gpu-check.sh builds one): stock llama.cpp's own GPU against its CPU.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL N_PREDICT [--row-invariant] [--gpu] [--threads N] PROMPT...\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[1];
    const int n_predict = std::atoi(argv[2]);
    bool row_invariant = false;
    bool gpu = false;
    int n_threads = 0;
    int first_prompt = 3;
    while (first_prompt < argc && std::strncmp(argv[first_prompt], "--", 2) == 0) {
        if (std::strcmp(argv[first_prompt], "--row-invariant") == 0) {
#ifndef MESHNET_ROW_INVARIANT
            std::fprintf(stderr, "--row-invariant: this build is over the pristine tree, which has no such mode\n");
            return 2;
#endif
            row_invariant = true;
            first_prompt += 1;
        } else if (std::strcmp(argv[first_prompt], "--gpu") == 0) {
            gpu = true;
            first_prompt += 1;
        } else if (std::strcmp(argv[first_prompt], "--threads") == 0 && first_prompt + 1 < argc) {
            n_threads = std::atoi(argv[first_prompt + 1]);
            first_prompt += 2;
        } else {
            std::fprintf(stderr, "unknown option %s\n", argv[first_prompt]);
            return 2;
        }
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers    = gpu ? -1 : 0;
    // without --gpu nothing reaches a GPU, not even a large batch's work (op_offload below)
    ggml_backend_dev_t no_devices[1] = {nullptr};
    if (!gpu) {
        mparams.devices = no_devices;
    }
    llama_model * model = llama_model_load_from_file(model_path, mparams);
    if (!model) {
        std::fprintf(stderr, "could not load %s\n", model_path);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    for (int p = first_prompt; p < argc; ++p) {
        const std::string prompt = argv[p];
        std::vector<llama_token> tokens(prompt.size() + 8);
        const int n = llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), tokens.data(),
                                     (int32_t) tokens.size(), /*add_special=*/true, /*parse_special=*/false);
        if (n < 0) {
            std::fprintf(stderr, "could not tokenize prompt %d\n", p);
            return 1;
        }
        tokens.resize(n);

        // llama-cpp-python's defaults (Llama.__init__): n_batch = n_ubatch = 512, no flash attention
        llama_context_params cparams = llama_context_default_params();
        cparams.n_ctx           = 1024;
        cparams.n_batch         = 512;
        cparams.n_ubatch        = 512;
        cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        cparams.op_offload      = gpu;
#ifdef MESHNET_ROW_INVARIANT
        cparams.row_invariant   = row_invariant;
#endif
        if (n_threads > 0) {
            cparams.n_threads = cparams.n_threads_batch = n_threads;
        }
        llama_context * ctx = llama_init_from_model(model, cparams);
        if (!ctx) {
            std::fprintf(stderr, "could not create a context\n");
            return 1;
        }
        for (int i = 0; i < n; ++i) {
            std::printf("%s%d", i ? " " : "", tokens[i]);
        }
        std::printf(" |");
        for (int start = 0; start < n; start += (int) cparams.n_batch) {
            const int len = std::min(n - start, (int) cparams.n_batch);
            if (llama_decode(ctx, llama_batch_get_one(tokens.data() + start, len)) != 0) {
                std::fprintf(stderr, "decode failed\n");
                return 1;
            }
        }
        for (int k = 0; k < n_predict; ++k) {
            const float * logits = llama_get_logits_ith(ctx, -1);
            llama_token best = 0;
            for (llama_token v = 1; v < n_vocab; ++v) {
                if (logits[v] > logits[best]) {
                    best = v;
                }
            }
            std::printf(" %d", best);
            if (llama_decode(ctx, llama_batch_get_one(&best, 1)) != 0) {
                std::fprintf(stderr, "decode failed\n");
                return 1;
            }
        }
        std::printf("\n");
        std::fflush(stdout);
        llama_free(ctx);
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
