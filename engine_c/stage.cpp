// One pipeline stage over the patched llama.cpp: open, forward, sessions, tokens.
// Each entry point is a straight path; every llama.cpp failure is checked where it
// happens and becomes a status plus a sentence in the stage's last error.

#include "meshnet_engine.h"

#include "ggml-cpu.h"
#include "gguf.h"
#include "llama.h"
#include "llama-ext.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-model.h"

#include "chat.h"
#include "common.h"
#include "json-schema-to-grammar.h"
#include "json.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <typeinfo>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#ifndef MESHNET_LLAMA_COMMIT
#define MESHNET_LLAMA_COMMIT "unknown"
#endif
#ifndef MESHNET_SDIST_SHA256
#define MESHNET_SDIST_SHA256 "unknown"
#endif
#ifndef MESHNET_PATCHES_SHA256
#define MESHNET_PATCHES_SHA256 "unknown"
#endif

namespace {

// llama.cpp reports load failures only through its log; keep the errors of the call
// running on this thread so they can become the stage's error message.
thread_local std::string tl_llama_errors;

void log_to_thread(enum ggml_log_level level, const char * text, void *) {
    static const bool echo = std::getenv("MESHNET_LLAMA_LOG") != nullptr;
    if (echo) {
        std::fputs(text, stderr);
    }
    if (level == GGML_LOG_LEVEL_ERROR && tl_llama_errors.size() < 4096) {
        tl_llama_errors += text;
    }
}

void init_llama_once() {
    static std::once_flag once;
    std::call_once(once, [] {
        llama_log_set(log_to_thread, nullptr);
        llama_backend_init();
    });
}

// the first GPU ggml's backends found (an integrated one will do), or nullptr
ggml_backend_dev_t first_gpu() {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(dev);
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            return dev;
        }
    }
    return nullptr;
}

std::string format(const char * fmt, ...) {
    char buf[1024];
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    return buf;
}

std::string trimmed(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
        s.pop_back();
    }
    return s;
}

struct arch_line {
    const char *         name;
    meshnet_arch_support status;
    const char *         reason;
};

// engine_c/architectures.tsv, written out by CMake
const arch_line ARCH_TABLE[] = {
#include "architectures.inc"
};

const arch_line * arch_line_of(const std::string & arch) {
    for (const arch_line & line : ARCH_TABLE) {
        if (arch == line.name) {
            return &line;
        }
    }
    return nullptr;
}

struct sampler_free {
    void operator()(llama_sampler * sampler) const { llama_sampler_free(sampler); }
};

struct session_slot {
    bool     open     = false;
    uint64_t id       = 0;
    int32_t  n_tokens = 0;
    bool                 sampled = false;   // the tail samples this session's tokens
    meshnet_sampling     sampling = {};     // (its grammar pointer cleared: the text is kept below)
    std::vector<int32_t> history;           // with sampling: the session's tokens so far
    bool                 lost = false;      // a failed pass moved a recurrent state that cannot roll back
    // a grammar: the text, where in the history its tokens start, and llama.cpp's grammar
    // sampler fed history[grammar_from, grammar_fed): a cache of what that text and those
    // tokens give, built again from them whenever the history went back before grammar_fed
    std::string                                 grammar;
    bool                                        grammar_lazy = false;   // it starts at a trigger
    std::vector<std::string>                    trigger_patterns;
    std::vector<llama_token>                    trigger_tokens;
    int32_t                                     grammar_from = 0;
    size_t                                      grammar_fed  = 0;
    std::unique_ptr<llama_sampler, sampler_free> grammar_state;
    // in a KV pool: the session's cells are blocks [first_block, first_block + n_blocks)
    int32_t                                     first_block = -1;
    int32_t                                     n_blocks    = 0;
};

// A KV pool's unit: a session's cells start on a multiple of it, as they start at cell 0 in
// a cache of their own (llama.cpp pads a cache's attention to 256 cells), so that every
// sum over its cells runs in the same SIMD lanes and order as alone (patch 0012)
constexpr int32_t POOL_BLOCK = 256;
constexpr uint32_t POOL_UBATCH = 64;   // a pooled invariant stage's physical batch (open_stage says why)

// the draw for the token at position pos: splitmix64 of (seed, pos), so that each
// position has its own stream whatever came before or was replayed
uint32_t draw_seed(uint64_t seed, int64_t pos) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (uint64_t) (pos + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const uint32_t out = (uint32_t) z;
    return out == LLAMA_DEFAULT_SEED ? out - 1 : out;   // the default asks llama.cpp for a random seed
}

// what the GGUF header says, read before llama.cpp loads anything
struct gguf_summary {
    std::string arch;
    int32_t     n_layer = 0;
    uint32_t    hash_layer_count = 0;   // DeepSeek V4: the first layers route experts by token id
    uint32_t    shared_kv_layers = 0;   // Gemma 4: the last layers read the KV of earlier ones
};

meshnet_status probe_gguf(const char * path, gguf_summary & out, std::string & err) {
    FILE * f = std::fopen(path, "rb");
    if (!f) {
        err = format("cannot open model file '%s': %s", path, std::strerror(errno));
        return MESHNET_ERR_NOT_GGUF;
    }
    char magic[4] = {0};
    const size_t n_read = std::fread(magic, 1, 4, f);
    std::fclose(f);
    if (n_read != 4 || std::memcmp(magic, "GGUF", 4) != 0) {
        err = format("'%s' is not a GGUF model file (no GGUF magic)", path);
        return MESHNET_ERR_NOT_GGUF;
    }

    gguf_init_params gparams = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context * gctx = gguf_init_from_file(path, gparams);
    if (!gctx) {
        err = format("'%s' is not a readable GGUF model file: %s", path, trimmed(tl_llama_errors).c_str());
        return MESHNET_ERR_NOT_GGUF;
    }
    const int64_t arch_id = gguf_find_key(gctx, "general.architecture");
    if (arch_id < 0 || gguf_get_kv_type(gctx, arch_id) != GGUF_TYPE_STRING) {
        gguf_free(gctx);
        err = format("'%s' has no general.architecture: not a language model GGUF", path);
        return MESHNET_ERR_NOT_GGUF;
    }
    out.arch = gguf_get_val_str(gctx, arch_id);
    const int64_t layers_id = gguf_find_key(gctx, (out.arch + ".block_count").c_str());
    if (layers_id >= 0 && gguf_get_kv_type(gctx, layers_id) == GGUF_TYPE_UINT32) {
        out.n_layer = (int32_t) gguf_get_val_u32(gctx, layers_id);
    }
    for (auto [key, value] : { std::pair{".hash_layer_count", &out.hash_layer_count},
                               std::pair{".attention.shared_kv_layers", &out.shared_kv_layers} }) {
        const int64_t id = gguf_find_key(gctx, (out.arch + key).c_str());
        if (id >= 0 && gguf_get_kv_type(gctx, id) == GGUF_TYPE_UINT32) {
            *value = gguf_get_val_u32(gctx, id);
        }
    }
    gguf_free(gctx);
    return MESHNET_OK;
}

} // namespace

struct meshnet_stage {
    llama_model         * model = nullptr;
    llama_context       * ctx   = nullptr;
    ggml_threadpool_t     pool  = nullptr;
    const llama_vocab   * vocab = nullptr;
    llama_batch_ext     * batch = nullptr;

    meshnet_stage_info        info = {};
    std::vector<session_slot> slots;          // index = llama sequence id
    std::vector<llama_token_data> candidates; // the sampler's working array, n_vocab long
    std::atomic<bool>         abort_requested{false};
    // a tensor-parallel member: its exchange (the params'), and the failure that stopped a pass
    int32_t (*tp_gather)(void *, int32_t, int32_t, const float *, int64_t, int64_t, float *, int64_t, int64_t) = nullptr;
    void *                    tp_gather_user = nullptr;
    std::atomic<bool>         tp_failed{false};
    std::string               last_error;
    common_chat_templates_ptr chat_templates;   // the GGUF's Jinja template, parsed on first use
    // one KV pool that the sessions share (pool_cells > 0): who holds each block of
    // POOL_BLOCK cells (a slot's index, -1: free), and the caches whose cells are placed
    std::vector<int32_t>          block_owner;
    std::vector<llama_kv_cache *> placed_caches;

    bool pooled() const { return !block_owner.empty(); }

    meshnet_status fail(meshnet_status status, std::string message) {
        last_error = std::move(message);
        return status;
    }

    session_slot * find(uint64_t session_id) {
        for (auto & slot : slots) {
            if (slot.open && slot.id == session_id) {
                return &slot;
            }
        }
        return nullptr;
    }

    llama_seq_id seq_of(const session_slot * slot) const {
        return (llama_seq_id) (slot - slots.data());
    }
};

namespace {

// The KV pool (a stage opened with pool_cells): each open session holds a run of blocks,
// and its token at position p sits in cell first_block * POOL_BLOCK + p.

void place(meshnet_stage * stage, session_slot & slot, int32_t first_block) {
    for (llama_kv_cache * kv : stage->placed_caches) {
        kv->seq_place(stage->seq_of(&slot), first_block < 0 ? -1 : first_block * POOL_BLOCK);
    }
}

// the slot's blocks from KEEP on go back to the pool (all of them: it holds no place)
void free_blocks(meshnet_stage * stage, session_slot & slot, int32_t keep = 0) {
    if (!stage->pooled() || slot.first_block < 0) {
        return;
    }
    for (int32_t b = slot.first_block + keep; b < slot.first_block + slot.n_blocks; ++b) {
        stage->block_owner[b] = -1;
    }
    slot.n_blocks = std::min(slot.n_blocks, keep);
    if (slot.n_blocks == 0) {
        slot.first_block = -1;
        place(stage, slot, -1);
    }
}

// the first of NEED blocks in a row that are free or the slot ME's own, or -1
int32_t find_run(const meshnet_stage * stage, int32_t need, int32_t me) {
    int32_t run = 0;
    for (int32_t b = 0; b < (int32_t) stage->block_owner.size(); ++b) {
        const int32_t owner = stage->block_owner[b];
        run = owner < 0 || owner == me ? run + 1 : 0;
        if (run == need) {
            return b - need + 1;
        }
    }
    return -1;
}

// the slot's cells out of the pool (into SAVED) and its blocks free: what land() puts back
meshnet_status lift(meshnet_stage * stage, session_slot & slot, std::vector<uint8_t> & saved) {
    const int32_t me = stage->seq_of(&slot);
    llama_memory_t mem = llama_get_memory(stage->ctx);
    saved.clear();
    if (llama_memory_seq_pos_max(mem, me) >= 0) {
        saved.resize(llama_state_seq_get_size(stage->ctx, me));
        if (llama_state_seq_get_data(stage->ctx, saved.data(), saved.size(), me) != saved.size()) {
            return stage->fail(MESHNET_ERR_INTERNAL, format("saving session %llu's cells to move them in the KV pool "
                               "failed: %s", (unsigned long long) slot.id, trimmed(tl_llama_errors).c_str()));
        }
        llama_memory_seq_rm(mem, me, -1, -1);
    }
    for (int32_t & owner : stage->block_owner) {
        owner = owner == me ? -1 : owner;
    }
    slot.first_block = -1;
    slot.n_blocks    = 0;
    return MESHNET_OK;
}

// the slot (lifted) to blocks [first, first + need), its SAVED cells restored there: the
// same bytes at the same offsets from its first cell
meshnet_status land(meshnet_stage * stage, session_slot & slot, int32_t first, int32_t need,
                    const std::vector<uint8_t> & saved) {
    const int32_t me = stage->seq_of(&slot);
    std::fill(stage->block_owner.begin() + first, stage->block_owner.begin() + first + need, me);
    slot.first_block = first;
    slot.n_blocks    = need;
    place(stage, slot, first);
    if (!saved.empty() && llama_state_seq_set_data(stage->ctx, saved.data(), saved.size(), me) != saved.size()) {
        llama_memory_seq_rm(llama_get_memory(stage->ctx), me, -1, -1);
        slot.lost = true;
        return stage->fail(MESHNET_ERR_INTERNAL, format("moving session %llu's cells in the KV pool failed: %s",
                           (unsigned long long) slot.id, trimmed(tl_llama_errors).c_str()));
    }
    return MESHNET_OK;
}

meshnet_status move_to(meshnet_stage * stage, session_slot & slot, int32_t first, int32_t need) {
    std::vector<uint8_t> saved;
    const meshnet_status status = lift(stage, slot, saved);
    return status != MESHNET_OK ? status : land(stage, slot, first, need, saved);
}

// every session's blocks to the start of the pool, in order, leaving the free ones in one run
meshnet_status pack(meshnet_stage * stage) {
    std::vector<session_slot *> held;
    for (auto & slot : stage->slots) {
        if (slot.open && slot.first_block >= 0) {
            held.push_back(&slot);
        }
    }
    std::sort(held.begin(), held.end(), [](const session_slot * a, const session_slot * b) {
        return a->first_block < b->first_block;
    });
    int32_t next = 0;
    for (session_slot * slot : held) {
        if (slot->first_block != next) {
            const meshnet_status status = move_to(stage, *slot, next, slot->n_blocks);
            if (status != MESHNET_OK) {
                return status;
            }
        }
        next += slot->n_blocks;
    }
    return MESHNET_OK;
}

// room in the pool for the slot's first N_CELLS positions: in place where the blocks after
// its own are free, else in a run of free blocks elsewhere (its cells moved there), after
// packing the others where only that makes such a run; KV_FULL when the pool has not the
// blocks, which fails the entry that asked and no other session
meshnet_status reserve(meshnet_stage * stage, session_slot & slot, int64_t n_cells) {
    if (!stage->pooled()) {
        return MESHNET_OK;
    }
    const int32_t need = (int32_t) ((n_cells + POOL_BLOCK - 1) / POOL_BLOCK);
    if (need <= slot.n_blocks) {
        return MESHNET_OK;
    }
    const int32_t me = stage->seq_of(&slot);
    auto & owner = stage->block_owner;
    if (slot.first_block >= 0 && slot.first_block + need <= (int32_t) owner.size() &&
        std::all_of(owner.begin() + slot.first_block + slot.n_blocks, owner.begin() + slot.first_block + need,
                    [](int32_t o) { return o < 0; })) {
        std::fill(owner.begin() + slot.first_block + slot.n_blocks, owner.begin() + slot.first_block + need, me);
        slot.n_blocks = need;
        return MESHNET_OK;
    }
    // a session that has to move takes room for twice what it holds where there is such a
    // run, so that one growing beside others moves a few times, not at every block
    const int32_t most = (stage->info.n_ctx + POOL_BLOCK - 1) / POOL_BLOCK;
    const int32_t roomy = std::min(std::max(need, 2 * slot.n_blocks), std::max(need, most));
    int32_t at = roomy > need ? find_run(stage, roomy, me) : -1;
    if (at >= 0) {
        return move_to(stage, slot, at, roomy);
    }
    at = find_run(stage, need, me);
    if (at < 0) {
        const int32_t n_free = (int32_t) std::count(owner.begin(), owner.end(), -1) + slot.n_blocks;
        if (n_free < need) {
            return stage->fail(MESHNET_ERR_KV_FULL,
                    format("the stage's KV pool of %d cells holds %d free: session %llu needs %d more for %lld positions",
                           (int) owner.size() * POOL_BLOCK, (n_free - slot.n_blocks) * POOL_BLOCK,
                           (unsigned long long) slot.id, (need - slot.n_blocks) * POOL_BLOCK, (long long) n_cells));
        }
        // the others packed to the start, and this one after them: the free blocks then
        // follow its own
        std::vector<uint8_t> saved;
        meshnet_status status = lift(stage, slot, saved);
        if (status == MESHNET_OK) {
            status = pack(stage);
        }
        if (status != MESHNET_OK) {
            return status;
        }
        at = find_run(stage, need, me);
        if (at < 0) {   // (n_free said there were: a bug, not the pool's size)
            slot.lost = !saved.empty();
            return stage->fail(MESHNET_ERR_INTERNAL, "the KV pool's free blocks made no run after packing");
        }
        return land(stage, slot, at, need, saved);
    }
    return move_to(stage, slot, at, need);
}

// llama.cpp's gather of a tensor-parallel member (llama-ext.h) through the stage's own; a
// failed exchange stops the pass at the next node, with what it was given filled with zeros
void tp_gather(void * user, int32_t il, int32_t point, const float * local, int64_t n_local, int64_t offset,
               float * whole, int64_t n_whole, int64_t n_rows) {
    meshnet_stage * stage = static_cast<meshnet_stage *>(user);
    if (!stage->tp_failed.load(std::memory_order_relaxed) &&
        stage->tp_gather(stage->tp_gather_user, il, point, local, n_local, offset, whole, n_whole, n_rows) == 0) {
        return;
    }
    stage->tp_failed.store(true);
    stage->abort_requested.store(true);
    std::memset(whole, 0, sizeof(float) * (size_t) n_whole * (size_t) n_rows);
}

bool abort_callback(void * data) {
    return static_cast<meshnet_stage *>(data)->abort_requested.load(std::memory_order_relaxed);
}

void write_error(char * err, size_t err_cap, const std::string & message) {
    if (err && err_cap > 0) {
        std::snprintf(err, err_cap, "%s", message.c_str());
    }
}

// The caches a pool places its sessions in (patch 0012): a unified cache, or the two of a
// sliding-window model; false for any other memory, which a pool cannot hold
bool find_placed_caches(meshnet_stage * stage) {
    llama_memory_i * mem = llama_get_memory(stage->ctx);
    stage->placed_caches.clear();
    // these two classes exactly: a cache derived from them (an indexer's, a compressed
    // one) keeps cells of its own that no base places
    if (mem && typeid(*mem) == typeid(llama_kv_cache)) {
        stage->placed_caches = { static_cast<llama_kv_cache *>(mem) };
    } else if (mem && typeid(*mem) == typeid(llama_kv_cache_iswa)) {
        auto * iswa = static_cast<llama_kv_cache_iswa *>(mem);
        stage->placed_caches = { iswa->get_base(), iswa->get_swa() };
    }
    bool placeable = !stage->placed_caches.empty();
    for (llama_kv_cache * kv : stage->placed_caches) {
        placeable = placeable && kv->seq_place(0, -1);   // (one stream per sequence: nothing to place)
    }
    if (!placeable) {
        stage->placed_caches.clear();
    }
    return placeable;
}

// llama.cpp turns flash attention off for Grok, asked or not (llama_init_from_model)
bool flash_attn_runs(const llama_model & model) {
    return model.arch != LLM_ARCH_GROK;
}

// a meshnet_kv_type's ggml type; GGML_TYPE_COUNT for a value that is none
ggml_type kv_ggml_type(int32_t type) {
    static const ggml_type types[] = {GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                                      GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_IQ4_NL};
    return type >= 0 && type < (int32_t) (sizeof(types) / sizeof(types[0])) ? types[type] : GGML_TYPE_COUNT;
}

// why the model's KV cannot be kept in these types ("" where it can): llama.cpp checks the
// head sizes against a quantized type's block only with flash attention, and without it
// ggml asserts (the process dies) on a K row the block does not divide
std::string kv_types_unfit(const llama_model & model, ggml_type type_k, ggml_type type_v) {
    const llama_hparams & hp = model.hparams;
    if ((hp.is_mla() || model.arch == LLM_ARCH_DEEPSEEK4) && type_k != type_v) {
        return format("this '%s' model keeps K and V in one cache: give both one type", llm_arch_name(model.arch));
    }
    if (ggml_is_quantized(type_v) && !flash_attn_runs(model)) {
        return format("a %s V cache needs flash attention, which llama.cpp does not run for a '%s' model: keep V in "
                      "f16", ggml_type_name(type_v), llm_arch_name(model.arch));
    }
    const int64_t blck_k = ggml_blck_size(type_k);
    const int64_t blck_v = ggml_blck_size(type_v);
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (hp.n_embd_k_gqa(il) == 0) {
            continue;   // a recurrent layer: no KV
        }
        const int64_t widths_k[] = {(int64_t) hp.n_embd_head_k(il), (int64_t) hp.n_embd_k_gqa(il), (int64_t) hp.indexer_head_size};
        const int64_t widths_v[] = {(int64_t) hp.n_embd_head_v(il), (int64_t) hp.n_embd_v_gqa(il)};
        for (int64_t w : widths_k) {
            if (w % blck_k != 0) {
                return format("a %s K cache keeps blocks of %lld values, which do not divide this model's key rows "
                              "of %lld (layer %u): choose f16, bf16 or f32 for it", ggml_type_name(type_k),
                              (long long) blck_k, (long long) w, il);
            }
        }
        for (int64_t w : widths_v) {
            if (w % blck_v != 0) {
                return format("a %s V cache keeps blocks of %lld values, which do not divide this model's value rows "
                              "of %lld (layer %u): choose f16, bf16 or f32 for it", ggml_type_name(type_v),
                              (long long) blck_v, (long long) w, il);
            }
        }
    }
    return "";
}

meshnet_status open_stage(const meshnet_stage_params * p, meshnet_stage * stage, std::string & err) {
    if (!p || !p->model_path) {
        err = "stage parameters and a model path are required";
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    if (p->numerics < MESHNET_NUMERICS_INVARIANT || p->numerics > MESHNET_NUMERICS_BASELINE) {
        err = format("numerics %d is not a class: 0 (invariant), 1 (stock) or 2 (baseline)", p->numerics);
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    const bool invariant = p->numerics == MESHNET_NUMERICS_INVARIANT;
    if (p->n_ctx < 1 || p->max_sessions < 1 || p->max_sessions > 256 || p->n_batch < 1 ||
        p->n_ubatch < 0 || p->n_threads < 0 || p->pool_cells < 0 || (p->pool_cells > 0 && p->pool_cells < p->n_ctx)) {
        err = format("invalid stage parameters: n_ctx=%d (>= 1), max_sessions=%d (1..256), n_batch=%d (>= 1), "
                     "n_ubatch=%d (>= 0), n_threads=%d (>= 0), pool_cells=%d (0, or at least n_ctx)",
                     p->n_ctx, p->max_sessions, p->n_batch, p->n_ubatch, p->n_threads, p->pool_cells);
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    if (p->tp_size != 0 && (p->tp_size < 2 || p->tp_rank < 0 || p->tp_rank >= p->tp_size || !p->tp_gather)) {
        err = format("tensor-parallel member %d of %d: a group of 2 or more, a rank below its size, and an exchange "
                     "(tp_gather)", p->tp_rank, p->tp_size);
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    if (p->tp_size != 0 && p->gpu) {
        err = "tensor parallelism runs on CPU stages (its exchange is a CPU operation in the graph): leave out --gpu";
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    if (p->thread_poll < 0 || p->thread_poll > 100) {
        err = format("thread_poll %d: 0 (sleep at once) to 100", p->thread_poll);
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    const ggml_type type_k = kv_ggml_type(p->type_k);
    const ggml_type type_v = kv_ggml_type(p->type_v);
    if (type_k == GGML_TYPE_COUNT || type_v == GGML_TYPE_COUNT) {
        err = format("KV types %d and %d: each a meshnet_kv_type (0..8)", p->type_k, p->type_v);
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    // (without flash attention llama.cpp keeps V transposed, a cell's values strided apart)
    if (ggml_is_quantized(type_v) && !p->flash_attn) {
        err = format("a %s V cache needs flash attention (--flash-attn); or keep V in f16", ggml_type_name(type_v));
        return MESHNET_ERR_INVALID_ARGUMENT;
    }

    gguf_summary summary;
    meshnet_status status = probe_gguf(p->model_path, summary, err);
    if (status != MESHNET_OK) {
        return status;
    }

    const bool whole_requested = p->layer_start == 0 && p->layer_end == 0;
    const int32_t il_start = p->layer_start;
    const int32_t il_end   = whole_requested ? summary.n_layer : p->layer_end;
    if (il_start < 0 || il_end <= il_start || il_end > summary.n_layer) {
        err = format("layer range [%d, %d) is not a non-empty range inside the model's %d layers",
                     il_start, il_end, summary.n_layer);
        return MESHNET_ERR_BAD_RANGE;
    }
    // the whole range runs the stock graph, so any architecture llama.cpp knows works
    const bool ranged = !(il_start == 0 && il_end == summary.n_layer);
    // MESHNET_TRIAGE_ANY_ARCH=1 lifts the refusal, for tools/arch_parity.py alone: it is how a
    // new pin's architectures are tried before the table lists them
    const arch_line * support = arch_line_of(summary.arch);
    const char * triage = std::getenv("MESHNET_TRIAGE_ANY_ARCH");
    if (ranged && !(triage && std::strcmp(triage, "1") == 0) && (!support || support->status != MESHNET_ARCH_SPLITS)) {
        err = support
            ? format("architecture '%s' cannot be split: %s; run it whole with the range [0, %d)",
                     summary.arch.c_str(), support->reason, summary.n_layer)
            : format("architecture '%s' is not one the pinned llama.cpp knows, so it cannot be split; "
                     "run it whole with the range [0, %d)", summary.arch.c_str(), summary.n_layer);
        return MESHNET_ERR_UNSUPPORTED_ARCH;
    }
    // DeepSeek V4's first layers pick their experts by token id, which only the head has
    if (ranged && il_start > 0 && il_start < (int32_t) summary.hash_layer_count) {
        err = format("this '%s' model's layers 0..%u route experts by token id, which only the head stage has: a "
                     "stage past the head starts at layer %u or later", summary.arch.c_str(),
                     summary.hash_layer_count - 1, summary.hash_layer_count);
        return MESHNET_ERR_BAD_RANGE;
    }
    // Gemma 4's smaller models let their last layers read the KV of earlier ones: a stage
    // would need another stage's cache
    if (ranged && summary.shared_kv_layers > 0 && summary.shared_kv_layers < (uint32_t) summary.n_layer) {
        err = format("this '%s' model's layers %d..%d reuse the KV cache of earlier layers (shared KV), which no "
                     "other stage holds, so it cannot be split; run it whole with the range [0, %d)",
                     summary.arch.c_str(), summary.n_layer - (int32_t) summary.shared_kv_layers, summary.n_layer - 1,
                     summary.n_layer);
        return MESHNET_ERR_UNSUPPORTED_ARCH;
    }

    // The device list is explicit either way: empty for a CPU stage, so that an engine
    // built with a GPU backend still runs it on the CPU alone (llama.cpp would otherwise
    // put every layer on any GPU it finds), and the first GPU for a GPU stage.
    ggml_backend_dev_t devices[2] = {nullptr, nullptr};
    if (p->gpu) {
        devices[0] = first_gpu();
        if (!devices[0]) {
            err = ggml_backend_reg_count() > 1
                ? "this engine has a GPU backend but it finds no GPU: is the driver loaded, or does CUDA_VISIBLE_DEVICES "
                  "hide them? (a Vulkan device on the CPU, such as Mesa's lavapipe, is taken only where "
                  "GGML_VK_VISIBLE_DEVICES names it)"
                : "this engine was built for the CPU alone: `make GPU=cuda` or `make GPU=vulkan` builds a GPU engine "
                  "(build/cuda, build/vulkan)";
            return MESHNET_ERR_NO_GPU;
        }
        // a GPU's matrix kernels change with the number of rows; Vulkan's backend has a mode
        // that takes every matrix product through one tiled shader (patch 0018), CUDA's has none
        const std::string backend = ggml_backend_reg_name(ggml_backend_dev_backend_reg(devices[0]));
        if (invariant && backend != "Vulkan") {
            err = format("the invariant numerics class runs on the CPU, or on a GPU through the Vulkan engine "
                         "(make GPU=vulkan), not on %s: choose the stock class for this GPU stage", backend.c_str());
            return MESHNET_ERR_INVALID_ARGUMENT;
        }
        if (invariant && p->flash_attn) {
            err = "the invariant class on a GPU runs without flash attention (its GPU kernels change with the "
                  "number of rows): leave out --flash-attn";
            return MESHNET_ERR_INVALID_ARGUMENT;
        }
    }

    llama_model_params mparams = llama_model_default_params();
    mparams.devices      = devices;
    mparams.n_gpu_layers = p->gpu ? -1 : 0;   // a GPU stage holds all its layers there, the output layer too
    mparams.split_mode   = LLAMA_SPLIT_MODE_NONE;
    // read only this stage's tensors into its own buffers: memory is the stage's share
    mparams.load_mode   = LLAMA_LOAD_MODE_NONE;
    mparams.layer_start = ranged ? il_start : 0;
    mparams.layer_end   = ranged ? il_end   : 0;
    mparams.tp_rank     = p->tp_rank;
    mparams.tp_size     = p->tp_size;
    // the repacked weight layouts (Q4_0, Q4_K, IQ4_NL, MXFP4 on AVX2) in both classes: they
    // stream the weights faster, and in the invariant class a row's sums do not depend on the
    // rows beside it in them either (patch 0015: the gemv sums as the gemm, or takes every row)
    // (the baseline class measures meshnet before the classes: no repacked layouts)
    mparams.use_extra_bufts = p->numerics != MESHNET_NUMERICS_BASELINE;
    if (p->progress) {
        mparams.progress_callback = [](float fraction, void * user) {
            const meshnet_stage_params * params = (const meshnet_stage_params *) user;
            return params->progress(fraction, params->progress_user) != 0;
        };
        mparams.progress_callback_user_data = (void *) p;
    }
    stage->model = llama_model_load_from_file(p->model_path, mparams);
    if (!stage->model) {
        err = format("llama.cpp could not load '%s': %s", p->model_path, trimmed(tl_llama_errors).c_str());
        return MESHNET_ERR_MODEL_LOAD;
    }
    stage->vocab = llama_model_get_vocab(stage->model);
    const std::string kv_unfit = kv_types_unfit(*stage->model, type_k, type_v);
    if (!kv_unfit.empty()) {
        err = kv_unfit;
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    // (the class would say flash attention where llama.cpp computes without it)
    if (p->flash_attn && !flash_attn_runs(*stage->model)) {
        err = format("llama.cpp does not run flash attention for a '%s' model: leave out --flash-attn",
                     llm_arch_name(stage->model->arch));
        return MESHNET_ERR_INVALID_ARGUMENT;
    }

    const bool is_tail = il_end == summary.n_layer;
    const int32_t n_threads = p->n_threads > 0 ? p->n_threads : meshnet_default_threads();

    // a pool: one unified cache of pool_cells that the sessions share, each placed in
    // blocks of its own; else (or one session) a stream of n_ctx cells per session
    // (a recurrent or hybrid model's graph is not built for a unified cache: llama.cpp aborts)
    const bool pooled = p->pool_cells > 0 && p->max_sessions > 1 && !llama_model_is_recurrent(stage->model) &&
                        !llama_model_is_hybrid(stage->model);
    // a pool asked of a memory that cannot share it holds as many whole contexts as it has
    // room for, a stream of n_ctx each: fewer sessions, each as long as asked (the others
    // wait their turn where the sessions are admitted)
    int32_t whole_sessions = p->pool_cells > 0 ? std::max(1, std::min(p->max_sessions, p->pool_cells / p->n_ctx))
                                               : p->max_sessions;
    // llama.cpp reserves a recurrent or hybrid model's graph with the physical batch split
    // evenly over its sequences: a count that does not divide it breaks some graphs
    // (kimi-linear's asserts at 3): such a model holds the largest count that does
    const int32_t n_ubatch_asked = p->n_ubatch > 0 ? std::min(p->n_ubatch, p->n_batch) : p->n_batch;
    if (llama_model_is_recurrent(stage->model) || llama_model_is_hybrid(stage->model)) {
        while (whole_sessions > 1 && n_ubatch_asked % whole_sessions != 0) {
            whole_sessions--;
        }
    }
    const uint32_t pool_cells = (uint32_t) GGML_PAD(p->pool_cells, POOL_BLOCK);
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = pooled ? pool_cells : (uint32_t) p->n_ctx * (uint32_t) whole_sessions;
    cparams.n_seq_max       = (uint32_t) (pooled ? p->max_sessions : whole_sessions);
    cparams.kv_unified      = pooled;   // without a pool each session attends over its own stream
    // a sliding-window layer keeps the whole context's cells (llama.cpp's default): a session
    // can then be cut back to any position, and its cells lie as they would without a window;
    // the planner counts it so
    cparams.swa_full        = true;
    cparams.n_batch         = (uint32_t) p->n_batch;
    cparams.n_ubatch        = (uint32_t) n_ubatch_asked;
    // llama.cpp's attention scratch is rows x attended cells x heads: with a pool's cells
    // and n_batch rows it would outgrow the pool. The invariant class's rows do not depend
    // on how they are batched, so its pooled stage computes in physical batches of 64
    const uint32_t n_ubatch_streams = cparams.n_ubatch;
    if (pooled && invariant && p->n_ubatch == 0) {
        cparams.n_ubatch = std::min<uint32_t>(POOL_UBATCH, cparams.n_ubatch);
    }
    cparams.n_threads       = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.embeddings      = !is_tail;  // before the tail the residual of every token is the output
    cparams.pooling_type    = LLAMA_POOLING_TYPE_NONE;
    cparams.no_perf         = true;
    // off unless asked (llama-server's default on a CPU is on); the CPU flash-attention kernels
    // change with the batch size, so the invariant class runs each query row on its own (0016)
    cparams.flash_attn_type = p->flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cparams.type_k          = type_k;
    cparams.type_v          = type_v;
    // the invariant class's kernels sum each row alike in a call of any size (0005, 0015)
    cparams.row_invariant   = invariant;
    cparams.abort_callback      = abort_callback;
    cparams.abort_callback_data = stage;
    cparams.offload_kqv = p->gpu != 0;   // the KV cache beside the layers that use it
    cparams.op_offload  = p->gpu != 0;   // a CPU stage never sends a large batch's work to a GPU
    stage->ctx = llama_init_from_model(stage->model, cparams);
    if (stage->ctx && pooled && !find_placed_caches(stage)) {
        // a memory llama.cpp keeps otherwise (a recurrent state, a hybrid, a compressed
        // cache): each session a stream of its own, as without a pool
        llama_free(stage->ctx);
        cparams.n_ctx      = (uint32_t) p->n_ctx * (uint32_t) whole_sessions;
        cparams.n_seq_max  = (uint32_t) whole_sessions;
        cparams.kv_unified = false;
        cparams.n_ubatch   = n_ubatch_streams;
        stage->ctx = llama_init_from_model(stage->model, cparams);
    }
    if (!stage->ctx) {
        err = format("llama.cpp could not create a context for '%s': %s", p->model_path, trimmed(tl_llama_errors).c_str());
        return MESHNET_ERR_MODEL_LOAD;
    }
    if (!stage->placed_caches.empty()) {
        stage->block_owner.assign(llama_n_ctx(stage->ctx) / POOL_BLOCK, -1);
    }
    if (p->tp_size != 0) {
        stage->tp_gather      = p->tp_gather;
        stage->tp_gather_user = p->tp_gather_user;
        llama_set_tp_gather(stage->ctx, tp_gather, stage);
    }
    // a thread pool of our own that, unless asked to poll, sleeps between forward passes:
    // with ggml's default (a pool per pass whose threads spin-poll) a stage's idle threads
    // steal the cores that the next stage, in another process on the same machine, computes on
    ggml_threadpool_params tpp = ggml_threadpool_params_default(n_threads);
    tpp.poll = (uint32_t) p->thread_poll;
    stage->pool = ggml_threadpool_new(&tpp);
    if (!stage->pool) {
        err = format("could not start %d compute threads", n_threads);
        return MESHNET_ERR_INTERNAL;
    }
    llama_attach_threadpool(stage->ctx, stage->pool, stage->pool);

    stage->batch = llama_batch_ext_init(stage->ctx);
    if (!stage->batch) {
        err = "llama.cpp could not allocate a batch";
        return MESHNET_ERR_INTERNAL;
    }
    const int32_t n_sessions = stage->pooled() ? p->max_sessions : whole_sessions;
    stage->slots.resize(n_sessions);

    meshnet_stage_info & info = stage->info;
    std::snprintf(info.arch, sizeof(info.arch), "%s", summary.arch.c_str());
    info.n_layer      = summary.n_layer;
    info.n_embd       = llama_model_n_embd(stage->model);
    info.seam_width   = info.n_embd + (int32_t) stage->model->hparams.stage_seam_extra;
    info.n_vocab      = llama_vocab_n_tokens(stage->vocab);
    info.layer_start  = il_start;
    info.layer_end    = il_end;
    info.is_head      = il_start == 0;
    info.is_tail      = is_tail;
    info.n_ctx        = p->n_ctx;
    info.max_sessions = n_sessions;
    info.pool_cells   = stage->pooled() ? (int32_t) llama_n_ctx(stage->ctx) : 0;
    info.n_batch      = p->n_batch;
    ggml_backend_dev_t processor = p->gpu ? devices[0] : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    std::snprintf(info.backend, sizeof(info.backend), "%s",
                  p->gpu ? ggml_backend_reg_name(ggml_backend_dev_backend_reg(processor)) : "CPU");
    std::snprintf(info.device, sizeof(info.device), "%s", processor ? ggml_backend_dev_description(processor) : "CPU");
    if (p->gpu) {
        size_t free_bytes = 0, total_bytes = 0;
        ggml_backend_dev_memory(processor, &free_bytes, &total_bytes);
        info.device_total = total_bytes;
    }
    std::snprintf(info.engine_pin, sizeof(info.engine_pin), "%s", meshnet_engine_pin());
    info.numerics = p->numerics;
    info.n_threads = n_threads;
    info.tp_rank   = p->tp_rank;
    info.tp_size   = p->tp_size;
    return MESHNET_OK;
}

// Residual values beyond this are not a real model's activations, and RMS norm's sum of
// squares over a row (n_embd x value^2, n_embd < 2^17) would overflow f32 past it.
constexpr float MAX_RESIDUAL_ABS = 1e15f;

// index of the first value that is not finite or beyond `limit`, or -1
int64_t first_bad_value(const float * values, int64_t n, float limit) {
    for (int64_t i = 0; i < n; ++i) {
        if (!std::isfinite(values[i]) || std::fabs(values[i]) > limit) {
            return i;
        }
    }
    return -1;
}

meshnet_status check_entry(meshnet_stage * stage, const meshnet_entry & e, int32_t index) {
    const meshnet_stage_info & info = stage->info;
    session_slot * slot = stage->find(e.session_id);
    if (!slot) {
        return stage->fail(MESHNET_ERR_UNKNOWN_SESSION,
                format("entry %d: session %llu is not open on this stage", index, (unsigned long long) e.session_id));
    }
    if (e.n_tokens < 1) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, format("entry %d: n_tokens is %d, needs at least 1", index, e.n_tokens));
    }
    if (slot->lost) {
        return stage->fail(MESHNET_ERR_CANNOT_ROLL_BACK,
                format("entry %d: session %llu lost its state: a pass failed after this model's recurrent state had "
                       "moved, and it cannot roll back; release the session and feed it again from the start",
                       index, (unsigned long long) e.session_id));
    }
    if (e.pos != slot->n_tokens) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                format("entry %d: position %d does not follow session %llu, which holds %d tokens",
                       index, e.pos, (unsigned long long) e.session_id, slot->n_tokens));
    }
    if (e.verify && info.is_tail) {
        if (llama_model_is_recurrent(stage->model) || llama_model_is_hybrid(stage->model)) {
            return stage->fail(MESHNET_ERR_CANNOT_ROLL_BACK,
                    format("entry %d: this model's recurrent state cannot drop the drafted rows it would not keep, "
                           "so its sessions decode without drafts", index));
        }
        if (!e.tokens) {
            return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                    format("entry %d: verifying drafts needs their token ids beside the rows", index));
        }
        for (int32_t i = 0; i < e.n_tokens; ++i) {
            if (e.tokens[i] < 0 || e.tokens[i] >= info.n_vocab) {
                return stage->fail(MESHNET_ERR_BAD_TOKEN,
                        format("entry %d: drafted token id %d is outside the vocabulary [0, %d)", index, e.tokens[i], info.n_vocab));
            }
        }
        if (slot->sampled && (int64_t) slot->history.size() != (int64_t) e.pos + 1) {
            return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                    format("entry %d: drafts after position %d, but session %llu's sampler knows %zu tokens: the "
                           "rows start at its last drawn token", index, e.pos, (unsigned long long) e.session_id,
                           slot->history.size()));
        }
    } else if (slot->sampled && (int64_t) e.pos + e.n_tokens > (int64_t) slot->history.size()) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                format("entry %d: rows up to position %d, but session %llu's sampler knows its tokens only up to %zu: "
                       "give it the tokens so far (meshnet_session_sampling)", index, e.pos + e.n_tokens - 1,
                       (unsigned long long) e.session_id, slot->history.size()));
    }
    if ((int64_t) e.pos + e.n_tokens > info.n_ctx) {
        return stage->fail(MESHNET_ERR_CONTEXT_FULL,
                format("entry %d: positions %d..%d are past the context of %d tokens per session",
                       index, e.pos, e.pos + e.n_tokens - 1, info.n_ctx));
    }
    // a model with a learned table of positions (GPT-2's) has none past its trained context:
    // llama.cpp would read outside the table and abort the process
    const int64_t n_trained = (int64_t) stage->model->hparams.n_ctx_train;
    if (stage->model->pos_embd && (int64_t) e.pos + e.n_tokens > n_trained) {
        return stage->fail(MESHNET_ERR_CONTEXT_FULL,
                format("entry %d: positions %d..%d are past this model's table of %lld learned positions",
                       index, e.pos, e.pos + e.n_tokens - 1, (long long) n_trained));
    }
    if (info.is_head) {
        if (!e.tokens) {
            return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, format("entry %d: the head stage takes token ids", index));
        }
        for (int32_t i = 0; i < e.n_tokens; ++i) {
            if (e.tokens[i] < 0 || e.tokens[i] >= info.n_vocab) {
                return stage->fail(MESHNET_ERR_BAD_TOKEN,
                        format("entry %d: token id %d is outside the vocabulary [0, %d)", index, e.tokens[i], info.n_vocab));
            }
        }
    } else {
        if (!e.embd) {
            return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                    format("entry %d: stage [%d, %d) takes residual rows, not token ids", index, info.layer_start, info.layer_end));
        }
        if (e.embd_width != info.seam_width) {
            return stage->fail(MESHNET_ERR_BAD_WIDTH,
                    format("entry %d: residual rows are %d wide, this model's stages pass %d (n_embd %d)", index,
                           e.embd_width, info.seam_width, info.n_embd));
        }
        const int64_t bad = first_bad_value(e.embd, (int64_t) e.n_tokens * info.seam_width, MAX_RESIDUAL_ABS);
        if (bad >= 0) {
            return stage->fail(MESHNET_ERR_BAD_VALUE,
                    format("entry %d: residual row %lld, column %lld holds %g, which is not a finite value within +-%g",
                           index, (long long) (bad / info.seam_width), (long long) (bad % info.seam_width), (double) e.embd[bad],
                           (double) MAX_RESIDUAL_ABS));
        }
    }
    return MESHNET_OK;
}

llama_sampler * new_grammar(const llama_vocab * vocab, const std::string & grammar, bool lazy,
                            const std::vector<std::string> & patterns, const std::vector<llama_token> & tokens) {
    if (!lazy) {
        return llama_sampler_init_grammar(vocab, grammar.c_str(), "root");
    }
    std::vector<const char *> patterns_c;
    for (const std::string & pattern : patterns) {
        patterns_c.push_back(pattern.c_str());
    }
    return llama_sampler_init_grammar_lazy_patterns(vocab, grammar.c_str(), "root", patterns_c.data(), patterns_c.size(),
                                                    tokens.data(), tokens.size());
}

// A session's grammar sampler, fed every token of its history from grammar_from on; null
// when a token of the history is one the grammar does not take (err says which).
llama_sampler * grammar_for(meshnet_stage * stage, session_slot & slot, std::string & err) {
    if (!slot.grammar_state || slot.grammar_fed > slot.history.size()) {
        try {   // (past its work budget, building a grammar throws: patch 0011)
            slot.grammar_state.reset(new_grammar(stage->vocab, slot.grammar, slot.grammar_lazy, slot.trigger_patterns,
                                                 slot.trigger_tokens));
        } catch (const std::exception & e) {
            slot.grammar_state.reset();
            err = format("the grammar: %s", e.what());
            return nullptr;
        }
        slot.grammar_fed = (size_t) slot.grammar_from;
        if (!slot.grammar_state) {
            err = "llama.cpp could not parse the grammar";
            return nullptr;
        }
    }
    try {
        for (; slot.grammar_fed < slot.history.size(); ++slot.grammar_fed) {
            llama_sampler_accept(slot.grammar_state.get(), slot.history[slot.grammar_fed]);
        }
    } catch (const std::exception & e) {
        slot.grammar_state.reset();
        err = format("token %d at position %zu does not follow the grammar: %s", slot.history[slot.grammar_fed],
                     slot.grammar_fed, e.what());
        return nullptr;
    }
    return slot.grammar_state.get();
}

// The token at position pos, from its logits, by llama.cpp's samplers. The chain is built
// for this one draw, from the parameters and the history alone: nothing carries over (the
// grammar's sampler is a cache of the history, see session_slot). A grammar, applied first,
// leaves only the tokens it takes; then the chain draws among them. -1: the grammar
// refused the history or left no token (err says why).
int32_t sample(meshnet_stage * stage, session_slot & slot, const float * logits, int64_t pos, std::string & err) {
    const meshnet_sampling & p = slot.sampling;
    const int32_t n_vocab = stage->info.n_vocab;
    stage->candidates.resize(n_vocab);
    for (int32_t v = 0; v < n_vocab; ++v) {
        stage->candidates[v] = llama_token_data{ v, logits[v], 0.0f };
    }
    llama_token_data_array cur = { stage->candidates.data(), (size_t) n_vocab, -1, false };
    if (!slot.grammar.empty()) {
        llama_sampler * grammar = grammar_for(stage, slot, err);
        if (!grammar) {
            return -1;
        }
        try {
            llama_sampler_apply(grammar, &cur);
        } catch (const std::exception & e) {
            err = format("the grammar failed: %s", e.what());
            return -1;
        }
        if (std::none_of(cur.data, cur.data + cur.size, [](const llama_token_data & d) { return std::isfinite(d.logit); })) {
            err = "the grammar takes no token here";
            return -1;
        }
    }
    llama_sampler * chain = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (p.repeat_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
        const int32_t last_n = p.penalty_last_n < 0 ? stage->info.n_ctx : p.penalty_last_n;
        llama_sampler * penalties = llama_sampler_init_penalties(n_vocab, last_n, p.repeat_penalty,
                                                                 p.frequency_penalty, p.presence_penalty);
        const size_t from = slot.history.size() > (size_t) last_n ? slot.history.size() - (size_t) last_n : 0;
        for (size_t t = from; t < slot.history.size(); ++t) {
            llama_sampler_accept(penalties, slot.history[t]);
        }
        llama_sampler_chain_add(chain, penalties);
    }
    if (p.temperature <= 0.0f) {
        llama_sampler_chain_add(chain, llama_sampler_init_greedy());
    } else {
        if (p.top_k > 0) {
            llama_sampler_chain_add(chain, llama_sampler_init_top_k(p.top_k));
        }
        if (p.top_p < 1.0f) {
            llama_sampler_chain_add(chain, llama_sampler_init_top_p(p.top_p, 1));
        }
        if (p.min_p > 0.0f) {
            llama_sampler_chain_add(chain, llama_sampler_init_min_p(p.min_p, 1));
        }
        llama_sampler_chain_add(chain, llama_sampler_init_temp(p.temperature));
        llama_sampler_chain_add(chain, llama_sampler_init_dist(draw_seed(p.seed, pos)));
    }
    llama_sampler_apply(chain, &cur);
    const int32_t token = cur.selected >= 0 && (size_t) cur.selected < cur.size ? cur.data[cur.selected].id : 0;
    llama_sampler_free(chain);
    return token;
}

// The checks of a whole forward call before anything runs: each entry, no session twice,
// no more rows than n_batch.
meshnet_status check_call(meshnet_stage * stage, const meshnet_entry * entries, int32_t n_entries, meshnet_output * out) {
    const meshnet_stage_info & info = stage->info;
    if (!entries || n_entries < 1 || !out) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, "forward needs at least one entry and an output");
    }
    if (info.is_tail ? !out->token : !out->residual) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                info.is_tail ? "the tail stage needs a token output buffer" : "this stage needs a residual output buffer");
    }
    int64_t n_rows = 0;
    for (int32_t i = 0; i < n_entries; ++i) {
        meshnet_status status = check_entry(stage, entries[i], i);
        if (status != MESHNET_OK) {
            return status;
        }
        for (int32_t j = 0; j < i; ++j) {
            if (entries[j].session_id == entries[i].session_id) {
                return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                        format("entries %d and %d name the same session %llu", j, i, (unsigned long long) entries[i].session_id));
            }
        }
        if (entries[i].verify && info.is_tail && (!out->drawn || !out->n_accepted)) {
            return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, "verifying drafts needs the drawn and n_accepted outputs");
        }
        n_rows += entries[i].n_tokens;
    }
    if (n_rows > info.n_batch) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                format("a forward call of %lld rows is larger than the stage's n_batch of %d", (long long) n_rows, info.n_batch));
    }
    return MESHNET_OK;
}

// Each entry is computed exactly as it would be alone. With a KV stream per session,
// llama.cpp cuts a batch of several sessions into micro-batches holding as many rows
// of each (split_equal): a prompt chunk beside a decode step would run as a 1-row and
// an (n-1)-row micro-batch, whose floats differ from the whole chunk's (0.6 in a logit
// on SmolLM2, enough to change a sampled token). So the one-row entries (decode steps)
// share a call, each longer entry has a call of its own, and within a call rows go in
// sequence order (llama.cpp puts sessions in one micro-batch only when their sequence
// ids follow each other).
//
// A KV pool has one stream, which llama.cpp cuts into micro-batches by rows in order, and
// each session's rows attend over a window of their own (patch 0014: each group of
// neighbouring sessions over its own cells): every entry goes in one call, which passes
// over the stage's weights once for all of them. Its rows go in the order of their
// sessions' places in the pool, so that neighbours in the batch are neighbours in the
// pool and the groups' windows stay tight. The invariant class's rows do not depend on
// what shares their call; the stock class's may, as in stock llama.cpp (a session
// batched with others may differ from it alone: core/numerics.py).
std::vector<std::vector<int32_t>> plan_calls(meshnet_stage * stage, const meshnet_entry * entries, int32_t n_entries) {
    std::vector<int32_t> order(n_entries);
    for (int32_t i = 0; i < n_entries; ++i) {
        order[i] = i;
    }
    if (stage->pooled()) {
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
            return stage->find(entries[a].session_id)->first_block < stage->find(entries[b].session_id)->first_block;
        });
        return { order };
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return stage->seq_of(stage->find(entries[a].session_id)) < stage->seq_of(stage->find(entries[b].session_id));
    });
    std::vector<std::vector<int32_t>> calls(1);
    for (const int32_t i : order) {
        if (entries[i].n_tokens == 1) {
            calls[0].push_back(i);
        } else {
            calls.push_back({ i });
        }
    }
    return calls;
}

// One forward call's entries through the llama.cpp calls plan_calls chose: each call's
// batch filled, computed and its outputs read before the next replaces them.
struct forward_pass {
    meshnet_stage * stage;
    const meshnet_entry * entries;
    int32_t n_entries;
    meshnet_output * out;
    std::vector<int64_t> out_at;       // an entry's first residual row in the output: entry order
    std::vector<int32_t> sampled;      // joins its session's history once every call has succeeded
    std::vector<std::vector<int32_t>> kept;   // a verify entry's draws up to its first refused draft
    std::vector<int32_t> first_row, last_row;

    forward_pass(meshnet_stage * stage, const meshnet_entry * entries, int32_t n_entries, meshnet_output * out)
        : stage(stage), entries(entries), n_entries(n_entries), out(out), out_at(n_entries),
          sampled(n_entries, -1), kept(n_entries), first_row(n_entries), last_row(n_entries) {
        for (int32_t i = 0, at = 0; i < n_entries; at += entries[i].n_tokens, ++i) {
            out_at[i] = at;
        }
    }

    // a failed, aborted or refused call may have left rows in the KV cache, and the calls
    // before it theirs: drop them all, so that each session goes on from where it was
    meshnet_status fail(meshnet_status status, const std::string & message) {
        llama_memory_t mem = llama_get_memory(stage->ctx);
        for (int32_t i = 0; i < n_entries; ++i) {
            session_slot * slot = stage->find(entries[i].session_id);
            if (!llama_memory_seq_rm(mem, stage->seq_of(slot), entries[i].pos, -1)) {
                // a recurrent state already moved past pos: what it held before is gone
                llama_memory_seq_rm(mem, stage->seq_of(slot), -1, -1);
                slot->lost = true;
            }
        }
        return stage->fail(status, message);
    }

    meshnet_status fill(const std::vector<int32_t> & call) {
        const meshnet_stage_info & info = stage->info;
        llama_batch_ext_clear(stage->batch);
        for (const int32_t i : call) {
            const meshnet_entry & e = entries[i];
            const llama_seq_id seq = stage->seq_of(stage->find(e.session_id));
            for (int32_t t = 0; t < e.n_tokens; ++t) {
                const int32_t idx = info.is_head
                    ? llama_batch_ext_add_token(stage->batch, seq, e.tokens[t])
                    : llama_batch_ext_add_embd(stage->batch, seq, llama_embd{ e.embd + (size_t) t * info.seam_width, 1, (size_t) info.seam_width });
                if (idx < 0) {
                    return fail(MESHNET_ERR_INTERNAL, format("llama.cpp refused batch row %d (code %d)", t, idx));
                }
                // a residual row of an M-RoPE model carries one position per section, which
                // llama.cpp fills in itself for a token row: the text position three times,
                // then 0 (any other model reads the first alone)
                const llama_pos p = e.pos + t;
                const llama_pos pos[4] = { p, p, p, 0 };
                llama_batch_ext_set_pos(stage->batch, idx, pos);
                if (t == 0) {
                    first_row[i] = idx;
                }
                last_row[i] = idx;
            }
            if (info.is_tail) {
                for (int32_t row = e.verify ? first_row[i] : last_row[i]; row <= last_row[i]; ++row) {
                    llama_batch_ext_set_output_logits(stage->batch, row, true);
                }
            }
        }
        return MESHNET_OK;
    }

    meshnet_status compute() {
        stage->abort_requested.store(false);
        stage->tp_failed.store(false);
        const int32_t rc = llama_process(stage->ctx, LLAMA_PROCESS_TYPE_DECODE, stage->batch);
        // (a failed exchange aborts the pass, or fails its last gather with nothing left to abort)
        if (stage->tp_failed.load()) {
            return fail(MESHNET_ERR_TP_EXCHANGE, "the exchange with the tensor-parallel group failed; the forward pass was stopped");
        }
        if (rc == 0) {
            return MESHNET_OK;
        }
        if (rc == 2) {
            return fail(MESHNET_ERR_ABORTED, "the forward pass was aborted");
        }
        if (rc == 1) {
            return fail(MESHNET_ERR_CONTEXT_FULL, "no room in the KV cache for this batch");
        }
        return fail(MESHNET_ERR_DECODE, format("llama.cpp failed to compute the batch (code %d): %s",
                    rc, trimmed(tl_llama_errors).c_str()));
    }

    // a row's logits, all finite, and its most likely token
    meshnet_status row_logits(int32_t i, int32_t row, const float ** logits, int32_t * best) {
        const int32_t n_vocab = stage->info.n_vocab;
        *logits = llama_get_logits_ith(stage->ctx, row);
        if (!*logits) {
            return fail(MESHNET_ERR_INTERNAL, "llama.cpp returned no logits");
        }
        // one pass over the vocabulary: the most likely token, and no non-finite logit
        *best = 0;
        for (int32_t v = 0; v < n_vocab; ++v) {
            if (!std::isfinite((*logits)[v])) {
                return fail(MESHNET_ERR_BAD_VALUE,
                        format("entry %d: the stage computed a non-finite logit (%g for token %d); nothing was kept",
                               i, (double) (*logits)[v], v));
            }
            if ((*logits)[v] > (*logits)[*best]) {
                *best = v;
            }
        }
        return MESHNET_OK;
    }

    // the tail: the entry's greedy token (or its sampled one) and its logits
    meshnet_status take_logits(int32_t i) {
        if (entries[i].verify) {
            return take_verified(i);
        }
        const float * logits = nullptr;
        int32_t best = 0;
        meshnet_status status = row_logits(i, last_row[i], &logits, &best);
        if (status != MESHNET_OK) {
            return status;
        }
        out->token[i] = best;
        if (out->logits) {
            std::memcpy(out->logits + (size_t) i * stage->info.n_vocab, logits, sizeof(float) * stage->info.n_vocab);
        }
        session_slot * slot = stage->find(entries[i].session_id);
        const int64_t next = (int64_t) entries[i].pos + entries[i].n_tokens;
        if (slot->sampled && next == (int64_t) slot->history.size()) {
            std::string err;
            sampled[i] = out->token[i] = sample(stage, *slot, logits, next, err);
            if (sampled[i] < 0) {
                return fail(MESHNET_ERR_INVALID_ARGUMENT, format("entry %d: %s; nothing was kept", i, err.c_str()));
            }
        }
        return MESHNET_OK;
    }

    // the tail, drafts: the draw after each row as if the rows had come one by one (the
    // sampler's history then holds the drafts before the row, each equal to the draw it
    // stands for), up to the first draft that differs from the draw
    meshnet_status take_verified(int32_t i) {
        const meshnet_entry & e = entries[i];
        session_slot * slot = stage->find(e.session_id);
        const size_t history = slot->history.size();
        std::vector<int32_t> & draws = kept[i];
        draws.clear();
        const float * logits = nullptr;
        for (int32_t r = 0; r < e.n_tokens; ++r) {
            int32_t best = 0;
            meshnet_status status = row_logits(i, first_row[i] + r, &logits, &best);
            if (status != MESHNET_OK) {
                slot->history.resize(history);
                return status;
            }
            std::string err;
            const int32_t draw = slot->sampled ? sample(stage, *slot, logits, (int64_t) e.pos + r + 1, err) : best;
            if (draw < 0) {
                slot->history.resize(history);
                return fail(MESHNET_ERR_INVALID_ARGUMENT, format("entry %d: %s; nothing was kept", i, err.c_str()));
            }
            draws.push_back(draw);
            out->drawn[out_at[i] + r] = draw;
            if (r + 1 == e.n_tokens || e.tokens[r + 1] != draw) {
                break;
            }
            if (slot->sampled) {
                slot->history.push_back(draw);
            }
        }
        slot->history.resize(history);   // the draws join it once every call has succeeded
        out->token[i] = draws.back();
        out->n_accepted[i] = (int32_t) draws.size() - 1;
        if (out->logits) {
            std::memcpy(out->logits + (size_t) i * stage->info.n_vocab, logits, sizeof(float) * stage->info.n_vocab);
        }
        return MESHNET_OK;
    }

    // a head or middle stage: the entry's residual rows, each finite and within bounds
    meshnet_status take_residual(int32_t i) {
        const int32_t width = stage->info.seam_width;
        for (int32_t t = 0; t < entries[i].n_tokens; ++t) {
            const int64_t out_row = out_at[i] + t;
            const float * row = llama_get_embeddings_ith(stage->ctx, first_row[i] + t);
            if (!row) {
                return fail(MESHNET_ERR_INTERNAL, "llama.cpp returned no residual row");
            }
            const int64_t bad = first_bad_value(row, width, MAX_RESIDUAL_ABS);
            if (bad >= 0) {
                return fail(MESHNET_ERR_BAD_VALUE,
                        format("residual row %lld came out as %g in column %lld, not a finite value within +-%g; "
                               "nothing was kept", (long long) out_row, (double) row[bad], (long long) bad,
                               (double) MAX_RESIDUAL_ABS));
            }
            std::memcpy(out->residual + (size_t) out_row * width, row, sizeof(float) * width);
        }
        return MESHNET_OK;
    }

    meshnet_status run(const std::vector<int32_t> & call) {
        meshnet_status status = fill(call);
        if (status == MESHNET_OK) {
            status = compute();
        }
        for (size_t k = 0; status == MESHNET_OK && k < call.size(); ++k) {
            status = stage->info.is_tail ? take_logits(call[k]) : take_residual(call[k]);
        }
        return status;
    }

    // every call succeeded: the sessions move on
    void commit() {
        for (int32_t i = 0; i < n_entries; ++i) {
            session_slot * slot = stage->find(entries[i].session_id);
            if (sampled[i] >= 0) {
                slot->history.push_back(sampled[i]);
            }
            int32_t n_kept = entries[i].n_tokens;
            if (entries[i].verify && stage->info.is_tail) {
                n_kept = (int32_t) kept[i].size();   // the last drawn token's row and the drafts kept
                if (slot->sampled) {
                    slot->history.insert(slot->history.end(), kept[i].begin(), kept[i].end());
                }
                // the refused drafts' rows leave (a transformer's KV: checked at entry)
                llama_memory_seq_rm(llama_get_memory(stage->ctx), stage->seq_of(slot), entries[i].pos + n_kept, -1);
            }
            slot->n_tokens += n_kept;
        }
    }
};

meshnet_status forward(meshnet_stage * stage, const meshnet_entry * entries, int32_t n_entries, meshnet_output * out) {
    meshnet_status status = check_call(stage, entries, n_entries, out);
    if (status != MESHNET_OK) {
        return status;
    }
    for (int32_t i = 0; i < n_entries; ++i) {
        status = reserve(stage, *stage->find(entries[i].session_id), (int64_t) entries[i].pos + entries[i].n_tokens);
        if (status != MESHNET_OK) {
            return status;
        }
    }
    forward_pass pass(stage, entries, n_entries, out);
    for (const std::vector<int32_t> & call : plan_calls(stage, entries, n_entries)) {
        if (!call.empty() && (status = pass.run(call)) != MESHNET_OK) {
            return status;
        }
    }
    pass.commit();
    return MESHNET_OK;
}

} // namespace

extern "C" {

int32_t meshnet_engine_abi_version(void) {
    return MESHNET_ENGINE_ABI_VERSION;
}

int32_t meshnet_default_threads(void) {
    int32_t threads = std::max(1, (int32_t) common_cpu_get_num_math());
#if defined(__linux__)
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0 && CPU_COUNT(&allowed) > 0) {
        threads = std::min(threads, (int32_t) CPU_COUNT(&allowed));
    }
#endif
    return threads;
}

const char * meshnet_engine_pin(void) {
    return "llama.cpp@" MESHNET_LLAMA_COMMIT " sdist=" MESHNET_SDIST_SHA256 " patches=" MESHNET_PATCHES_SHA256;
}

meshnet_arch_support meshnet_arch_support_of(const char * arch, const char ** reason) {
    const arch_line * line = arch ? arch_line_of(arch) : nullptr;
    if (reason) {
        *reason = line ? line->reason : "not an architecture of the pinned llama.cpp";
    }
    return line ? line->status : MESHNET_ARCH_UNKNOWN;
}

// what llama.cpp's memory (llama_kv_cache, its sliding-window pair, llama_memory_recurrent
// and the hybrids built from them) allocates for one layer, with this engine's settings
meshnet_layer_memory layer_memory(const llama_model & model, uint32_t il, ggml_type type_k, ggml_type type_v) {
    const llama_hparams & hp = model.hparams;
    const bool hybrid_every_layer = model.arch == LLM_ARCH_FALCON_H1;   // attention and SSM in each layer
    const bool nemotron = model.arch == LLM_ARCH_NEMOTRON_H || model.arch == LLM_ARCH_NEMOTRON_H_MOE;
    meshnet_layer_memory out = {};
    const bool recurrent = hp.is_recr(il) && (!nemotron || hp.n_ff(il) == 0);
    const bool attention = !llm_arch_is_recurrent(model.arch) && hp.has_kv(il) && hp.n_embd_k_gqa(il) > 0
                        && (hybrid_every_layer || !hp.is_recr(il)) && (!nemotron || hp.n_ff(il) == 0);
    // the sparse-attention indexer's keys (one head, of K's type) beside K and V: DeepSeek-V3.2 on
    // every layer, GLM-DSA and dots3 on their full-indexer layers, MiniMax-M3 past its dense lead
    // (what the DSA and MSA caches, llama-kv-cache-dsa.cpp and -msa.cpp, add)
    bool indexer = false;
    switch (model.arch) {
        case LLM_ARCH_DEEPSEEK32: indexer = true; break;
        case LLM_ARCH_GLM_DSA:
        case LLM_ARCH_DOTS3NOTE:  indexer = hp.is_indexer_full(il); break;
        case LLM_ARCH_MINIMAX_M3: indexer = il >= hp.n_layer_dense_lead; break;
        default: break;
    }
    if (attention) {
        const int64_t v_row = hp.is_mla() ? 0 : hp.n_embd_v_gqa_max();   // V transposed: rows as wide as the widest
        // (MiniMax-M3's indexer cache is a whole KV cache of one head: its V too)
        const int64_t indexer_k = indexer ? (int64_t) hp.indexer_head_size : 0;
        const int64_t indexer_v = indexer && model.arch == LLM_ARCH_MINIMAX_M3 ? (int64_t) hp.n_embd_head_v() : 0;
        out.kv_bytes_per_cell = (int64_t) (ggml_row_size(type_k, hp.n_embd_k_gqa(il)) + ggml_row_size(type_v, v_row) +
                                           ggml_row_size(type_k, indexer_k) + ggml_row_size(type_v, indexer_v));
        if (hp.swa_type != LLAMA_SWA_TYPE_NONE && hp.is_swa(il)) {
            out.window  = (int32_t) hp.n_swa;
        }
    }
    if (recurrent) {
        out.state_bytes = (int64_t) sizeof(float) * ((int64_t) hp.n_embd_r() + hp.n_embd_s());
    }
    return out;
}

meshnet_status meshnet_layer_memory_of(const char * model_path, int32_t type_k, int32_t type_v,
                                       meshnet_layer_memory * layers, int32_t capacity, int32_t * n_layer,
                                       char * err, size_t err_cap) {
    if (!model_path || !n_layer || capacity < 0 || (capacity > 0 && !layers)) {
        write_error(err, err_cap, "meshnet_layer_memory_of needs a model path, an output array and a count");
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    const ggml_type k = kv_ggml_type(type_k);
    const ggml_type v = kv_ggml_type(type_v);
    if (k == GGML_TYPE_COUNT || v == GGML_TYPE_COUNT) {
        write_error(err, err_cap, format("KV types %d and %d: each a meshnet_kv_type (0..8)", type_k, type_v));
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    init_llama_once();
    tl_llama_errors.clear();
    try {
        llama_model_params mparams = llama_model_default_params();
        ggml_backend_dev_t no_devices[1] = {nullptr};
        mparams.devices    = no_devices;
        mparams.n_gpu_layers = 0;
        mparams.no_alloc     = true;   // the hyperparameters and tensor shapes; no weight is read
        mparams.load_mode    = LLAMA_LOAD_MODE_NONE;   // (the memory-fit pass maps nothing)
        llama_model * model = llama_model_load_from_file(model_path, mparams);
        if (!model) {
            write_error(err, err_cap, format("llama.cpp could not read '%s': %s", model_path, trimmed(tl_llama_errors).c_str()));
            return MESHNET_ERR_MODEL_LOAD;
        }
        const std::string unfit = kv_types_unfit(*model, k, v);
        *n_layer = (int32_t) model->hparams.n_layer();
        for (int32_t il = 0; unfit.empty() && il < std::min(capacity, *n_layer); ++il) {
            layers[il] = layer_memory(*model, (uint32_t) il, k, v);
        }
        llama_model_free(model);
        if (!unfit.empty()) {
            write_error(err, err_cap, unfit);
            return MESHNET_ERR_INVALID_ARGUMENT;
        }
        return MESHNET_OK;
    } catch (const std::exception & e) {
        write_error(err, err_cap, format("reading the layers of '%s' failed: %s", model_path, e.what()));
        return MESHNET_ERR_INTERNAL;
    }
}

meshnet_status meshnet_stage_open(const meshnet_stage_params * params, meshnet_stage ** out, char * err, size_t err_cap) {
    if (!out) {
        write_error(err, err_cap, "meshnet_stage_open needs an output pointer");
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    *out = nullptr;
    init_llama_once();
    tl_llama_errors.clear();

    meshnet_stage * stage = nullptr;
    std::string message;
    meshnet_status status;
    try {
        stage = new meshnet_stage();
        status = open_stage(params, stage, message);
    } catch (const std::exception & e) {
        status = MESHNET_ERR_INTERNAL;
        message = format("unexpected error opening the stage: %s", e.what());
    } catch (...) {
        status = MESHNET_ERR_INTERNAL;
        message = "unexpected error opening the stage";
    }
    if (status != MESHNET_OK) {
        meshnet_stage_close(stage);
        write_error(err, err_cap, message);
        return status;
    }
    *out = stage;
    return MESHNET_OK;
}

void meshnet_stage_close(meshnet_stage * stage) {
    if (!stage) {
        return;
    }
    if (stage->batch) {
        llama_batch_ext_free(stage->batch);
    }
    if (stage->ctx) {
        llama_free(stage->ctx);
    }
    if (stage->pool) {
        ggml_threadpool_free(stage->pool);
    }
    if (stage->model) {
        llama_model_free(stage->model);
    }
    delete stage;
}

const char * meshnet_stage_last_error(const meshnet_stage * stage) {
    return stage ? stage->last_error.c_str() : "no stage";
}

meshnet_status meshnet_stage_info_get(meshnet_stage * stage, meshnet_stage_info * info) {
    if (!stage || !info) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    try {
        uint64_t model_bytes = 0, kv_bytes = 0, compute_bytes = 0, device_bytes = 0;
        for (const auto & [buft, mb] : llama_get_memory_breakdown(stage->ctx)) {
            model_bytes   += mb.model;
            kv_bytes      += mb.context;
            compute_bytes += mb.compute;
            if (!ggml_backend_buft_is_host(buft)) {
                device_bytes += mb.model + mb.context + mb.compute;
            }
        }
        int64_t tokens_held = 0;
        int32_t n_sessions  = 0;
        for (const auto & slot : stage->slots) {
            if (slot.open) {
                n_sessions  += 1;
                tokens_held += slot.n_tokens;
            }
        }
        stage->info.model_bytes   = model_bytes;
        stage->info.kv_bytes      = kv_bytes;
        stage->info.compute_bytes = compute_bytes;
        stage->info.device_bytes  = device_bytes;
        stage->info.n_sessions    = n_sessions;
        // every KV cell has the same size: a session holding n tokens uses n cells
        const uint64_t n_cells = llama_n_ctx(stage->ctx);
        stage->info.kv_bytes_used = n_cells ? kv_bytes / n_cells * (uint64_t) tokens_held : 0;
        *info = stage->info;
        return MESHNET_OK;
    } catch (const std::exception & e) {
        return stage->fail(MESHNET_ERR_INTERNAL, format("reading the stage's memory use failed: %s", e.what()));
    }
}

meshnet_status meshnet_session_open(meshnet_stage * stage, uint64_t session_id) {
    if (!stage) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    if (stage->find(session_id)) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, format("session %llu is already open", (unsigned long long) session_id));
    }
    for (auto & slot : stage->slots) {
        if (!slot.open) {
            llama_memory_seq_rm(llama_get_memory(stage->ctx), stage->seq_of(&slot), -1, -1);
            free_blocks(stage, slot);
            slot = session_slot();
            slot.open = true;
            slot.id   = session_id;
            return MESHNET_OK;
        }
    }
    return stage->fail(MESHNET_ERR_TOO_MANY_SESSIONS,
            format("all %d session slots of this stage are in use", stage->info.max_sessions));
}

meshnet_status meshnet_session_release(meshnet_stage * stage, uint64_t session_id) {
    if (!stage) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    session_slot * slot = stage->find(session_id);
    if (!slot) {
        return stage->fail(MESHNET_ERR_UNKNOWN_SESSION, format("session %llu is not open", (unsigned long long) session_id));
    }
    llama_memory_seq_rm(llama_get_memory(stage->ctx), stage->seq_of(slot), -1, -1);
    free_blocks(stage, *slot);
    *slot = session_slot();
    return MESHNET_OK;
}

meshnet_status meshnet_session_truncate(meshnet_stage * stage, uint64_t session_id, int32_t n_keep) {
    if (!stage) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    session_slot * slot = stage->find(session_id);
    if (!slot) {
        return stage->fail(MESHNET_ERR_UNKNOWN_SESSION, format("session %llu is not open", (unsigned long long) session_id));
    }
    if (n_keep < 0 || n_keep > slot->n_tokens) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                format("cannot keep %d tokens of session %llu, which holds %d", n_keep, (unsigned long long) session_id, slot->n_tokens));
    }
    if (n_keep < slot->n_tokens && !llama_memory_seq_rm(llama_get_memory(stage->ctx), stage->seq_of(slot), n_keep, -1)) {
        return stage->fail(MESHNET_ERR_CANNOT_ROLL_BACK,
                format("session %llu cannot keep %d of its %d tokens: this model's recurrent state holds no earlier "
                       "position; release the session and feed the %d tokens again", (unsigned long long) session_id,
                       n_keep, slot->n_tokens, n_keep));
    }
    slot->n_tokens = n_keep;
    free_blocks(stage, *slot, (n_keep + POOL_BLOCK - 1) / POOL_BLOCK);
    if (slot->history.size() > (size_t) n_keep) {
        slot->history.resize(n_keep);   // the tokens after n_keep may be chosen again
    }
    return MESHNET_OK;
}

meshnet_status meshnet_session_length(meshnet_stage * stage, uint64_t session_id, int32_t * n_tokens) {
    if (!stage || !n_tokens) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    session_slot * slot = stage->find(session_id);
    if (!slot) {
        return stage->fail(MESHNET_ERR_UNKNOWN_SESSION, format("session %llu is not open", (unsigned long long) session_id));
    }
    *n_tokens = slot->n_tokens;
    return MESHNET_OK;
}

meshnet_status meshnet_session_save(meshnet_stage * stage, uint64_t session_id, void * buf, size_t capacity, size_t * n_out) {
    if (!stage || !n_out) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    session_slot * slot = stage->find(session_id);
    if (!slot) {
        return stage->fail(MESHNET_ERR_UNKNOWN_SESSION, format("session %llu is not open", (unsigned long long) session_id));
    }
    if (slot->lost) {
        return stage->fail(MESHNET_ERR_CANNOT_ROLL_BACK,
                format("session %llu lost its state in a failed pass: there is nothing to save", (unsigned long long) session_id));
    }
    tl_llama_errors.clear();
    try {
        const llama_seq_id seq = stage->seq_of(slot);
        const size_t size = llama_state_seq_get_size(stage->ctx, seq);
        *n_out = size;
        if (!buf || capacity < size) {
            return stage->fail(MESHNET_ERR_BUFFER_TOO_SMALL,
                    format("session %llu's memory is %zu bytes, the buffer %zu", (unsigned long long) session_id, size, capacity));
        }
        const size_t written = llama_state_seq_get_data(stage->ctx, static_cast<uint8_t *>(buf), capacity, seq);
        if (written != size) {
            return stage->fail(MESHNET_ERR_INTERNAL,
                    format("llama.cpp wrote %zu of session %llu's %zu bytes: %s", written, (unsigned long long) session_id,
                           size, trimmed(tl_llama_errors).c_str()));
        }
        *n_out = written;
        return MESHNET_OK;
    } catch (const std::exception & e) {
        return stage->fail(MESHNET_ERR_INTERNAL, format("saving session %llu failed: %s", (unsigned long long) session_id, e.what()));
    }
}

meshnet_status meshnet_session_restore(meshnet_stage * stage, uint64_t session_id, const void * buf, size_t size, int32_t n_tokens) {
    if (!stage || !buf || size == 0) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    session_slot * slot = stage->find(session_id);
    if (!slot) {
        return stage->fail(MESHNET_ERR_UNKNOWN_SESSION, format("session %llu is not open", (unsigned long long) session_id));
    }
    if (slot->n_tokens != 0 || slot->lost) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                format("session %llu holds %d tokens: only an empty session takes saved memory",
                       (unsigned long long) session_id, slot->n_tokens));
    }
    if (n_tokens < 1 || n_tokens > stage->info.n_ctx) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                format("saved memory of %d tokens for a context of %d", n_tokens, stage->info.n_ctx));
    }
    llama_memory_t mem = llama_get_memory(stage->ctx);
    const llama_seq_id seq = stage->seq_of(slot);
    tl_llama_errors.clear();
    const meshnet_status room = reserve(stage, *slot, n_tokens);
    if (room != MESHNET_OK) {
        return room;
    }
    try {
        const size_t read = llama_state_seq_set_data(stage->ctx, static_cast<const uint8_t *>(buf), size, seq);
        const llama_pos held = llama_memory_seq_pos_max(mem, seq) + 1;
        if (read != size || held != n_tokens) {
            llama_memory_seq_rm(mem, seq, -1, -1);
            return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                    format("the saved memory does not fit session %llu: llama.cpp read %zu of %zu bytes, holding %d "
                           "positions where %d were named (another model, layer range or context?) %s",
                           (unsigned long long) session_id, read, size, (int) held, n_tokens,
                           trimmed(tl_llama_errors).c_str()));
        }
        slot->n_tokens = n_tokens;
        return MESHNET_OK;
    } catch (const std::exception & e) {
        llama_memory_seq_rm(mem, seq, -1, -1);
        return stage->fail(MESHNET_ERR_INTERNAL, format("restoring session %llu failed: %s", (unsigned long long) session_id, e.what()));
    }
}

meshnet_status meshnet_stage_forward(meshnet_stage * stage, const meshnet_entry * entries, int32_t n_entries, meshnet_output * out) {
    if (!stage) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    tl_llama_errors.clear();
    try {
        return forward(stage, entries, n_entries, out);
    } catch (const std::exception & e) {
        return stage->fail(MESHNET_ERR_INTERNAL, format("unexpected error in the forward pass: %s", e.what()));
    } catch (...) {
        return stage->fail(MESHNET_ERR_INTERNAL, "unexpected error in the forward pass");
    }
}

void meshnet_stage_abort(meshnet_stage * stage) {
    if (stage) {
        stage->abort_requested.store(true);
    }
}

meshnet_status meshnet_tokenize(meshnet_stage * stage, const char * text, int32_t text_len,
                                int32_t add_special, int32_t parse_special,
                                int32_t * tokens, int32_t capacity, int32_t * n_out) {
    if (!stage || !text || text_len < 0 || capacity < 0 || !n_out || (capacity > 0 && !tokens)) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    const int32_t n = llama_tokenize(stage->vocab, text, text_len, tokens, capacity, add_special != 0, parse_special != 0);
    if (n == INT32_MIN) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, "the text is too long to tokenize");
    }
    if (n < 0) {
        *n_out = -n;
        return stage->fail(MESHNET_ERR_BUFFER_TOO_SMALL, format("tokenizing needs room for %d tokens", -n));
    }
    *n_out = n;
    return MESHNET_OK;
}

meshnet_status meshnet_detokenize(meshnet_stage * stage, const int32_t * tokens, int32_t n_tokens,
                                  char * text, int32_t capacity, int32_t * n_out) {
    if (!stage || n_tokens < 0 || (n_tokens > 0 && !tokens) || capacity < 0 || !n_out || (capacity > 0 && !text)) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    for (int32_t i = 0; i < n_tokens; ++i) {
        if (tokens[i] < 0 || tokens[i] >= stage->info.n_vocab) {
            return stage->fail(MESHNET_ERR_BAD_TOKEN,
                    format("token id %d is outside the vocabulary [0, %d)", tokens[i], stage->info.n_vocab));
        }
    }
    const int32_t n = llama_detokenize(stage->vocab, tokens, n_tokens, text, capacity, false, false);
    if (n < 0) {
        *n_out = -n;
        return stage->fail(MESHNET_ERR_BUFFER_TOO_SMALL, format("the text needs %d bytes", -n));
    }
    *n_out = n;
    return MESHNET_OK;
}

int32_t meshnet_token_is_eog(meshnet_stage * stage, int32_t token) {
    return stage && token >= 0 && token < stage->info.n_vocab && llama_vocab_is_eog(stage->vocab, token);
}

meshnet_status meshnet_session_sampling(meshnet_stage * stage, uint64_t session_id, const meshnet_sampling * sampling,
                                        const int32_t * history, int32_t n_history) {
    if (!stage || n_history < 0 || (n_history > 0 && !history)) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    session_slot * slot = stage->find(session_id);
    if (!slot) {
        return stage->fail(MESHNET_ERR_UNKNOWN_SESSION, format("session %llu is not open", (unsigned long long) session_id));
    }
    if (!sampling) {
        slot->sampled = false;
        slot->history.clear();
        slot->grammar.clear();
        slot->grammar_state.reset();
        return MESHNET_OK;
    }
    if (!stage->info.is_tail) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, "only the tail stage samples tokens");
    }
    const meshnet_sampling & p = *sampling;
    if (!std::isfinite(p.temperature) || !std::isfinite(p.top_p) || !std::isfinite(p.min_p) ||
        !std::isfinite(p.repeat_penalty) || !std::isfinite(p.frequency_penalty) || !std::isfinite(p.presence_penalty) ||
        p.repeat_penalty <= 0.0f || p.penalty_last_n < -1) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                "sampling parameters must be finite, repeat_penalty above 0 and penalty_last_n at least -1");
    }
    if (n_history > stage->info.n_ctx || n_history < slot->n_tokens) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                format("a history of %d tokens for a session that holds %d, in a context of %d",
                       n_history, slot->n_tokens, stage->info.n_ctx));
    }
    for (int32_t i = 0; i < n_history; ++i) {
        if (history[i] < 0 || history[i] >= stage->info.n_vocab) {
            return stage->fail(MESHNET_ERR_BAD_TOKEN,
                    format("history token %d is %d, outside the vocabulary [0, %d)", i, history[i], stage->info.n_vocab));
        }
    }
    const bool has_grammar = p.grammar && p.grammar[0];
    if (has_grammar && (p.grammar_from < 0 || p.grammar_from > n_history)) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT,
                format("grammar_from %d is outside the history of %d tokens", p.grammar_from, n_history));
    }
    if (has_grammar && (p.n_trigger_patterns < 0 || p.n_trigger_tokens < 0 ||
                        (p.n_trigger_patterns > 0 && !p.trigger_patterns) || (p.n_trigger_tokens > 0 && !p.trigger_tokens))) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, "a lazy grammar's triggers are given as counts and arrays");
    }
    std::vector<std::string> patterns;
    std::vector<llama_token> trigger_tokens;
    for (int32_t i = 0; has_grammar && i < p.n_trigger_patterns; ++i) {
        if (!p.trigger_patterns[i]) {
            return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, format("trigger pattern %d is NULL", i));
        }
        patterns.emplace_back(p.trigger_patterns[i]);
    }
    for (int32_t i = 0; has_grammar && i < p.n_trigger_tokens; ++i) {
        if (p.trigger_tokens[i] < 0 || p.trigger_tokens[i] >= stage->info.n_vocab) {
            return stage->fail(MESHNET_ERR_BAD_TOKEN, format("trigger token %d is %d, outside the vocabulary", i,
                                                             p.trigger_tokens[i]));
        }
        trigger_tokens.push_back(p.trigger_tokens[i]);
    }
    std::unique_ptr<llama_sampler, sampler_free> grammar;
    if (has_grammar) {
        try {   // (a trigger that is not a regex throws, and so does a grammar past its bounds: patch 0011)
            grammar.reset(new_grammar(stage->vocab, p.grammar, p.grammar_lazy != 0, patterns, trigger_tokens));
        } catch (const std::exception & e) {
            return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, format("the grammar: %s", e.what()));
        }
        if (!grammar) {   // llama.cpp logs the parse error's place
            return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, "the grammar is not valid GBNF with a rule named root "
                               "(and groups nested at most 256 deep)");
        }
    }
    slot->sampled  = true;
    slot->sampling = p;
    slot->sampling.grammar = nullptr;
    slot->sampling.trigger_patterns = nullptr;
    slot->sampling.trigger_tokens = nullptr;
    slot->grammar_lazy     = has_grammar && p.grammar_lazy != 0;
    slot->trigger_patterns = std::move(patterns);
    slot->trigger_tokens   = std::move(trigger_tokens);
    slot->history.assign(history, history + n_history);
    slot->grammar      = has_grammar ? p.grammar : "";
    slot->grammar_from = has_grammar ? p.grammar_from : 0;
    slot->grammar_fed  = (size_t) slot->grammar_from;
    slot->grammar_state = std::move(grammar);
    return MESHNET_OK;
}

// what a text answer of ours is: a string into a caller's buffer, its size with the NUL in *n_out
meshnet_status give_text(meshnet_stage * stage, const std::string & text, char * out, size_t capacity, size_t * n_out) {
    *n_out = text.size() + 1;
    if (capacity < text.size() + 1) {
        return stage ? stage->fail(MESHNET_ERR_BUFFER_TOO_SMALL, format("the answer needs %zu bytes", text.size() + 1))
                     : MESHNET_ERR_BUFFER_TOO_SMALL;
    }
    std::memcpy(out, text.c_str(), text.size() + 1);
    return MESHNET_OK;
}

meshnet_status meshnet_chat_apply(meshnet_stage * stage, const char * request, char * out, size_t capacity,
                                  size_t * n_out) {
    if (!stage || !request || !n_out || (capacity > 0 && !out)) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    common_json answer;
    try {
        if (!stage->chat_templates) {
            stage->chat_templates = common_chat_templates_init(stage->model, "");
        }
        const common_json body = common_json::parse(request);
        common_chat_templates_inputs inputs;
        inputs.messages = common_chat_msgs_parse_oaicompat(body.at("messages"));
        if (body.contains("tools") && !body.at("tools").is_null()) {
            inputs.tools = common_chat_tools_parse_oaicompat(body.at("tools"));
        }
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(body.value("tool_choice", std::string("auto")));
        inputs.parallel_tool_calls = body.value("parallel_tool_calls", false);
        inputs.add_generation_prompt = body.value("add_generation_prompt", true);
        inputs.use_jinja = true;
        inputs.enable_thinking = false;
        const common_chat_params params = common_chat_templates_apply(stage->chat_templates.get(), inputs);
        // the lazy grammar's triggers as common/sampling.cpp makes them: patterns and tokens
        common_json patterns = common_json::array();
        common_json tokens = common_json::array();
        for (const common_grammar_trigger & trigger : params.grammar_triggers) {
            switch (trigger.type) {
                case COMMON_GRAMMAR_TRIGGER_TYPE_WORD:    patterns.push_back(regex_escape(trigger.value)); break;
                case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN: patterns.push_back(trigger.value); break;
                case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: {
                    const std::string & p = trigger.value;
                    patterns.push_back(p.empty() ? std::string("^$")
                                                 : (p.front() != '^' ? "^" : "") + p + (p.back() != '$' ? "$" : ""));
                    break;
                }
                case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:   tokens.push_back((int64_t) trigger.token); break;
            }
        }
        common_json stops = common_json::array();
        for (const std::string & stop : params.additional_stops) {
            stops.push_back(stop);
        }
        answer = common_json::object();
        answer["prompt"] = params.prompt;
        answer["grammar"] = params.grammar;
        answer["grammar_lazy"] = params.grammar_lazy;
        answer["trigger_patterns"] = patterns;
        answer["trigger_tokens"] = tokens;
        answer["additional_stops"] = stops;
        answer["generation_prompt"] = params.generation_prompt;
        answer["format"] = (int64_t) params.format;
        answer["format_name"] = std::string(common_chat_format_name(params.format));
        answer["parser"] = params.parser;
        common_json caps = common_json::object();   // what the template can say: tools, tool calls, a system role
        for (const auto & [name, value] : common_chat_templates_get_caps(stage->chat_templates.get())) {
            caps[name] = value;
        }
        answer["caps"] = caps;
    } catch (const std::exception & e) {
        return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, format("the chat template could not take the request: %s", e.what()));
    }
    return give_text(stage, answer.dump(), out, capacity, n_out);
}

meshnet_status meshnet_chat_parse(const char * chat, const char * text, int32_t is_partial, char * out,
                                  size_t capacity, size_t * n_out, char * err, size_t err_cap) {
    if (!chat || !text || !n_out || (capacity > 0 && !out)) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    std::string message;
    try {
        const common_json params = common_json::parse(chat);
        common_chat_parser_params syntax;
        syntax.format = (common_chat_format) params.at("format").get<int64_t>();
        syntax.generation_prompt = params.value("generation_prompt", std::string());
        syntax.parse_tool_calls = true;
        const std::string parser = params.value("parser", std::string());
        if (!parser.empty()) {
            syntax.parser.load(parser);
        }
        message = common_chat_parse(text, is_partial != 0, syntax).to_json_oaicompat().dump();
    } catch (const std::exception & e) {
        if (err && err_cap > 0) {
            std::snprintf(err, err_cap, "the answer could not be parsed: %s", e.what());
        }
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    return give_text(nullptr, message, out, capacity, n_out);
}

meshnet_status meshnet_json_schema_grammar(const char * schema, char * text, size_t capacity, size_t * n_out,
                                           char * err, size_t err_cap) {
    if (!schema || !n_out || (capacity > 0 && !text)) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    std::string grammar;
    try {
        grammar = json_schema_to_grammar(common_json::parse(schema));
    } catch (const std::exception & e) {
        if (err && err_cap > 0) {
            std::snprintf(err, err_cap, "%s", e.what());
        }
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    *n_out = grammar.size() + 1;
    if (capacity < grammar.size() + 1) {
        return MESHNET_ERR_BUFFER_TOO_SMALL;
    }
    std::memcpy(text, grammar.c_str(), grammar.size() + 1);
    return MESHNET_OK;
}

meshnet_status meshnet_chat_template(meshnet_stage * stage, const meshnet_chat_message * messages, int32_t n_messages,
                                     int32_t add_assistant, char * text, int32_t capacity, int32_t * n_out) {
    if (!stage || n_messages < 0 || (n_messages > 0 && !messages) || capacity < 0 || !n_out || (capacity > 0 && !text)) {
        return MESHNET_ERR_INVALID_ARGUMENT;
    }
    const char * tmpl = llama_model_chat_template(stage->model, nullptr);
    if (!tmpl) {
        return stage->fail(MESHNET_ERR_NO_TEMPLATE, "the model has no chat template (tokenizer.chat_template)");
    }
    std::vector<llama_chat_message> chat(n_messages);
    for (int32_t i = 0; i < n_messages; ++i) {
        if (!messages[i].role || !messages[i].content) {
            return stage->fail(MESHNET_ERR_INVALID_ARGUMENT, format("message %d has no role or no content", i));
        }
        chat[i] = { messages[i].role, messages[i].content };
    }
    const int32_t n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant != 0, text, capacity);
    if (n < 0) {
        return stage->fail(MESHNET_ERR_NO_TEMPLATE,
                "the model's chat template is not one llama.cpp knows (it applies built-in templates, not Jinja)");
    }
    *n_out = n;
    if (n > capacity) {
        return stage->fail(MESHNET_ERR_BUFFER_TOO_SMALL, format("the chat prompt needs %d bytes", n));
    }
    return MESHNET_OK;
}

} // extern "C"
