/* The C ABI alone, as a C program sees it through meshnet_engine.h: no Python, no cffi.
 *
 *   meshnet_abi_test MODEL.gguf      (a generated model of 4 layers: build/test-models)
 *
 * A head-to-tail forward over two stages gives the whole model's logits bit for bit; each
 * refusal comes back as its error code with a message in the last-error string. */

#include "meshnet_engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (!(cond)) {                                                    \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);          \
            fprintf(stderr, __VA_ARGS__);                                 \
            fprintf(stderr, "\n");                                        \
            failures++;                                                   \
        }                                                                 \
    } while (0)

static meshnet_stage_params params_for(const char * path, int32_t start, int32_t end) {
    meshnet_stage_params p;
    memset(&p, 0, sizeof p);
    p.model_path   = path;
    p.layer_start  = start;
    p.layer_end    = end;
    p.n_ctx        = 64;
    p.max_sessions = 2;
    p.n_batch      = 64;
    p.n_threads    = 1;
    p.numerics     = MESHNET_NUMERICS_INVARIANT;
    return p;
}

static meshnet_stage * open_stage(const char * path, int32_t start, int32_t end) {
    meshnet_stage_params p = params_for(path, start, end);
    meshnet_stage * stage = NULL;
    char err[1024] = "";
    meshnet_status status = meshnet_stage_open(&p, &stage, err, sizeof err);
    CHECK(status == MESHNET_OK && stage != NULL, "opening [%d, %d) of %s: status %d: %s", start, end, path,
          (int) status, err);
    return stage;
}

static void test_refusals_are_codes_with_a_message(const char * path) {
    char err[1024] = "";
    meshnet_stage * stage = (meshnet_stage *) 1;
    meshnet_stage_params p = params_for("/nonexistent/model.gguf", 0, 0);
    meshnet_status status = meshnet_stage_open(&p, &stage, err, sizeof err);
    CHECK(status == MESHNET_ERR_NOT_GGUF, "a missing file: status %d, not MESHNET_ERR_NOT_GGUF", (int) status);
    CHECK(stage == NULL && err[0] != '\0', "a refused open leaves no stage and says why");

    err[0] = '\0';
    p = params_for(path, 3, 2);
    status = meshnet_stage_open(&p, &stage, err, sizeof err);
    CHECK(status == MESHNET_ERR_BAD_RANGE, "layers [3, 2): status %d, not MESHNET_ERR_BAD_RANGE", (int) status);
    CHECK(strstr(err, "3") != NULL, "the range refusal names the range: '%s'", err);

    CHECK(meshnet_stage_open(&p, NULL, NULL, 0) == MESHNET_ERR_INVALID_ARGUMENT, "no output pointer");

    const char * reason = NULL;
    CHECK(meshnet_arch_support_of("llama", &reason) == MESHNET_ARCH_SPLITS, "llama splits");
    CHECK(meshnet_arch_support_of("no-such-arch", &reason) == MESHNET_ARCH_UNKNOWN, "an unknown architecture");
    CHECK(meshnet_engine_abi_version() > 0 && strlen(meshnet_engine_pin()) > 0, "the ABI version and the pin");
}

static void test_a_two_stage_forward_is_the_whole_model_s(const char * path) {
    meshnet_stage * whole = open_stage(path, 0, 0);
    meshnet_stage * head  = open_stage(path, 0, 2);
    meshnet_stage * tail  = open_stage(path, 2, 4);
    if (!whole || !head || !tail) {
        return;
    }
    meshnet_stage_info info;
    CHECK(meshnet_stage_info_get(head, &info) == MESHNET_OK, "the head's info");
    CHECK(info.is_head && !info.is_tail && info.layer_start == 0 && info.layer_end == 2, "the head is [0, 2)");
    const int32_t width = info.seam_width, n_vocab = info.n_vocab;

    const int32_t tokens[] = { 1, 7, 3, 11, 5, 2 };
    const int32_t n = (int32_t) (sizeof tokens / sizeof tokens[0]);
    const uint64_t sid = 42;
    CHECK(meshnet_session_open(whole, sid) == MESHNET_OK && meshnet_session_open(head, sid) == MESHNET_OK
          && meshnet_session_open(tail, sid) == MESHNET_OK, "sessions open");

    float * residual = calloc((size_t) n * width, sizeof(float));
    float * split_logits = calloc((size_t) n_vocab, sizeof(float));
    float * whole_logits = calloc((size_t) n_vocab, sizeof(float));
    int32_t split_token = -1, whole_token = -1;

    meshnet_entry entry = { sid, 0, n, tokens, NULL, 0 };
    meshnet_output out = { residual, NULL, NULL };
    CHECK(meshnet_stage_forward(head, &entry, 1, &out) == MESHNET_OK, "head forward: %s",
          meshnet_stage_last_error(head));

    meshnet_entry seam = { sid, 0, n, NULL, residual, width };
    meshnet_output tail_out = { NULL, split_logits, &split_token };
    CHECK(meshnet_stage_forward(tail, &seam, 1, &tail_out) == MESHNET_OK, "tail forward: %s",
          meshnet_stage_last_error(tail));

    meshnet_output whole_out = { NULL, whole_logits, &whole_token };
    CHECK(meshnet_stage_forward(whole, &entry, 1, &whole_out) == MESHNET_OK, "whole forward: %s",
          meshnet_stage_last_error(whole));

    CHECK(memcmp(split_logits, whole_logits, (size_t) n_vocab * sizeof(float)) == 0,
          "the split's logits equal the whole model's, bit for bit");
    CHECK(split_token == whole_token && split_token >= 0, "the same greedy token (%d, %d)", split_token,
          whole_token);
    int finite = 1;
    for (int32_t i = 0; i < n_vocab; ++i) {
        finite &= isfinite(whole_logits[i]) != 0;
    }
    CHECK(finite, "finite logits");

    int32_t length = -1;
    CHECK(meshnet_session_length(tail, sid, &length) == MESHNET_OK && length == n, "the tail holds %d tokens, not %d",
          length, n);

    /* refusals of a forward pass: each its code, each with a last-error string */
    const int32_t bad_token[] = { n_vocab + 5 };
    meshnet_entry bad = { sid, n, 1, bad_token, NULL, 0 };
    CHECK(meshnet_stage_forward(head, &bad, 1, &out) == MESHNET_ERR_BAD_TOKEN, "a token past the vocabulary");
    CHECK(strlen(meshnet_stage_last_error(head)) > 0, "the bad token's message");

    meshnet_entry stranger = { 7, 0, 1, tokens, NULL, 0 };
    CHECK(meshnet_stage_forward(head, &stranger, 1, &out) == MESHNET_ERR_UNKNOWN_SESSION, "an unknown session");

    meshnet_entry narrow = { sid, n, 1, NULL, residual, width - 1 };
    CHECK(meshnet_stage_forward(tail, &narrow, 1, &tail_out) == MESHNET_ERR_BAD_WIDTH, "rows of the wrong width");
    CHECK(strlen(meshnet_stage_last_error(tail)) > 0, "the width's message");

    CHECK(meshnet_session_release(head, sid) == MESHNET_OK, "release");
    CHECK(meshnet_session_release(head, sid) == MESHNET_ERR_UNKNOWN_SESSION, "a released session is unknown");

    free(residual);
    free(split_logits);
    free(whole_logits);
    meshnet_stage_close(whole);
    meshnet_stage_close(head);
    meshnet_stage_close(tail);
}

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf (a generated model of 4 layers)\n", argv[0]);
        return 2;
    }
    test_refusals_are_codes_with_a_message(argv[1]);
    test_a_two_stage_forward_is_the_whole_model_s(argv[1]);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("meshnet ABI: every check passed\n");
    return 0;
}
