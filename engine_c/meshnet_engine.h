/*
 * meshnet engine: one pipeline stage of a GGUF model, a contiguous layer range
 * [layer_start, layer_end), over the pinned and patched llama.cpp.
 *
 * The head stage (layer_start == 0) takes token ids; any other stage takes the
 * residual stream (f32, n_tokens x n_embd) that the previous stage returned. A stage
 * before the tail returns the residual after its last layer for every token; the tail
 * returns the last token's logits and next token per entry: the most likely one, or,
 * for a session given sampling parameters, llama.cpp's sampler chain's choice.
 *
 * Every call returns a meshnet_status; on failure the stage's last error says what
 * went wrong in words (meshnet_stage_last_error). No C++ exception crosses this ABI.
 * A stage is used by one thread at a time, except meshnet_stage_abort which any
 * thread may call. Two stages share nothing.
 */
#ifndef MESHNET_ENGINE_H
#define MESHNET_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MESHNET_ENGINE_ABI_VERSION 18

#if defined(__GNUC__)
#define MESHNET_API __attribute__((visibility("default")))
#else
#define MESHNET_API
#endif

typedef enum {
    MESHNET_OK                    = 0,
    MESHNET_ERR_INVALID_ARGUMENT  = 1,  /* a parameter is missing or out of its range */
    MESHNET_ERR_NOT_GGUF          = 2,  /* the file is missing or is not a GGUF model */
    MESHNET_ERR_MODEL_LOAD        = 3,  /* llama.cpp could not load the model */
    MESHNET_ERR_UNSUPPORTED_ARCH  = 4,  /* the architecture cannot be split yet */
    MESHNET_ERR_BAD_RANGE         = 5,  /* layer range empty or outside the model */
    MESHNET_ERR_BAD_TOKEN         = 6,  /* token id outside the vocabulary */
    MESHNET_ERR_BAD_WIDTH         = 7,  /* residual rows not seam_width wide */
    MESHNET_ERR_CONTEXT_FULL      = 8,  /* position past the session's context */
    MESHNET_ERR_UNKNOWN_SESSION   = 9,
    MESHNET_ERR_TOO_MANY_SESSIONS = 10,
    MESHNET_ERR_ABORTED           = 11, /* meshnet_stage_abort stopped the forward pass */
    MESHNET_ERR_DECODE            = 12, /* llama.cpp failed to compute the batch */
    MESHNET_ERR_BUFFER_TOO_SMALL  = 13,
    MESHNET_ERR_INTERNAL          = 14,
    MESHNET_ERR_BAD_VALUE         = 15, /* a residual or logit that is not finite, or too large to be real */
    MESHNET_ERR_NO_TEMPLATE       = 16, /* the model has no chat template llama.cpp knows */
    MESHNET_ERR_NO_GPU            = 17, /* a GPU stage was asked of an engine without one */
    MESHNET_ERR_CANNOT_ROLL_BACK  = 18, /* a recurrent state cannot be cut back to an earlier position */
    MESHNET_ERR_KV_FULL           = 19, /* the stage's KV pool has no room for the session's next positions */
    MESHNET_ERR_TP_EXCHANGE       = 20  /* a tensor-parallel member's exchange with its group failed */
} meshnet_status;

typedef struct meshnet_stage meshnet_stage;

/* What a stage may do with an architecture: engine_c/architectures.tsv, built in. */
typedef enum {
    MESHNET_ARCH_UNKNOWN  = -1, /* not an architecture of the pinned llama.cpp */
    MESHNET_ARCH_SPLITS   = 0,  /* any layer range: a split gives the whole model's logits bit for bit */
    MESHNET_ARCH_WHOLE    = 1,  /* the whole range only; the reason says why */
    MESHNET_ARCH_NOT_TEXT = 2   /* not a text-generation model; the reason says what it is */
} meshnet_arch_support;

/* Which kernels a stage computes with: part of a route's compatibility class, since the
 * two classes round differently and a route mixing them would give neither's output. */
typedef enum {
    /* every row's result is bit-identical however the rows were batched: alone, in a
     * prompt chunk of any size, beside other sessions' rows (each kernel a smaller call
     * falls back to sums a row as the larger call's does: patches 0005, 0015, 0016); CPU only */
    MESHNET_NUMERICS_INVARIANT = 0,
    /* stock llama.cpp's kernels, as its default build runs them: the same tokens as
     * stock for a session fed as stock feeds it; a row depends on its batch */
    MESHNET_NUMERICS_STOCK     = 1,
    /* the kernels of meshnet before the classes (no repacked layouts, the rest stock),
     * kept so that `meshnet bench` can measure the classes against it */
    MESHNET_NUMERICS_BASELINE  = 2
} meshnet_numerics;

/* The KV cache's element types, K and V each (llama.cpp's -ctk / -ctv). A quantized V
 * needs flash attention (llama.cpp keeps V transposed without it); a quantized type's
 * block (32) must divide every layer's head size. The row-invariant class stays exact
 * with any of them: a cell is quantized on its own when it is written. */
typedef enum {
    MESHNET_KV_F16    = 0,
    MESHNET_KV_F32    = 1,
    MESHNET_KV_BF16   = 2,
    MESHNET_KV_Q8_0   = 3,
    MESHNET_KV_Q4_0   = 4,
    MESHNET_KV_Q4_1   = 5,
    MESHNET_KV_Q5_0   = 6,
    MESHNET_KV_Q5_1   = 7,
    MESHNET_KV_IQ4_NL = 8
} meshnet_kv_type;

typedef struct {
    const char * model_path;
    int32_t layer_start;   /* both 0: the whole model */
    int32_t layer_end;
    int32_t n_ctx;         /* tokens of context per session */
    int32_t max_sessions;  /* sessions that can hold KV at once (a recurrent or hybrid model: the
                              largest count up to it that divides the physical batch; info says) */
    int32_t n_batch;       /* most tokens in one forward call */
    int32_t n_ubatch;      /* physical batch: longer calls run in chunks of this; 0 = n_batch */
    int32_t n_threads;     /* 0 = meshnet_default_threads() */
    int32_t flash_attn;    /* 1 = flash attention; results then depend on how a prompt is chunked */
    int32_t gpu;           /* 1 = every layer, the KV cache and the compute on the first GPU;
                              0 = the CPU alone, also in an engine built with a GPU backend */
    int32_t numerics;      /* a meshnet_numerics */
    /* NULL, or called as the weights load (llama.cpp's progress_callback) with the fraction
     * read so far, 0 to 1, and progress_user; answering 0 stops the load (MODEL_LOAD) */
    int32_t (*progress)(float fraction, void * user);
    void * progress_user;
    /* 0: each session a KV stream of n_ctx cells (n_ctx x max_sessions in all); > 0: one KV
     * pool of this many cells (rounded up to 256, at least n_ctx) that the sessions share,
     * each holding up to n_ctx as it grows, with the tokens it would have alone; a session
     * the pool has no room for gets MESHNET_ERR_KV_FULL, and no other session is touched.
     * A model whose memory is not a plain KV cache (recurrent, hybrid, an indexer's cache)
     * holds as many whole contexts as the pool has cells for instead: pool_cells / n_ctx
     * sessions (at least 1, at most max_sessions) of a stream of n_ctx cells each, which
     * info.max_sessions reports (info.pool_cells is then 0). An
     * invariant-class pool computes in physical batches of 64 rows (n_ubatch 0), so that
     * its attention scratch stays small beside the pool. */
    int32_t pool_cells;
    int32_t type_k;        /* a meshnet_kv_type (0: f16) */
    int32_t type_v;
    /* 0..100: how long the compute threads poll for the next forward pass before they
     * sleep (ggml's threadpool poll; llama.cpp's default is 50). 0: they sleep at once, and
     * leave the cores to another stage on this machine; a stage with cores of its own polls,
     * since waking a sleeping core costs the VMs measured up to milliseconds a token */
    int32_t thread_poll;
    /* Tensor parallelism: member tp_rank of a group of tp_size (both 0: whole layers). The
     * member holds its share of every layer of its range: its attention heads (whole KV
     * groups, or the single KV head of a one-KV-head model, replicated), its rows of the
     * attention output and of the FFN's gate, up and down; everything else whole. Where a
     * layer sums over a split dimension, tp_gather (required then) gathers the group's rows:
     * it fills WHOLE (n_whole floats a row, n_rows rows) with every member's columns in
     * member order, this member's n_local columns (LOCAL) beginning at column OFFSET; POINT
     * is 0 (attention heads), 1 (attention output), 2 (FFN activation) or 3 (FFN output) of
 * LAYER, or 4, the tail's logits (LAYER = n_layer), where it holds its rows of the output.
     * Every member computes every value exactly as the whole model does. tp_gather runs on
     * a compute thread inside meshnet_stage_forward, in the same order on every member;
     * nonzero stops the forward pass with MESHNET_ERR_TP_EXCHANGE. CPU stages only; the
     * llama family, qwen2, qwen3 and gemma3. */
    int32_t tp_rank;
    int32_t tp_size;
    int32_t (*tp_gather)(void * user, int32_t layer, int32_t point, const float * local, int64_t n_local,
                         int64_t offset, float * whole, int64_t n_whole, int64_t n_rows);
    void * tp_gather_user;
} meshnet_stage_params;

typedef struct {
    char     arch[32];
    int32_t  n_layer;
    int32_t  n_embd;
    int32_t  n_vocab;
    int32_t  layer_start;
    int32_t  layer_end;
    int32_t  is_head;
    int32_t  is_tail;
    int32_t  n_ctx;           /* per session */
    int32_t  max_sessions;
    int32_t  n_batch;
    int32_t  n_sessions;      /* sessions open now */
    uint64_t model_bytes;     /* weight bytes this stage allocated */
    uint64_t kv_bytes;        /* KV cache bytes allocated (all sessions) */
    uint64_t kv_bytes_used;   /* KV bytes holding tokens of open sessions */
    uint64_t compute_bytes;   /* scratch buffers for the forward pass */
    uint64_t device_bytes;    /* of the three above, the bytes in the GPU's own memory (VRAM) */
    uint64_t device_total;    /* the GPU's memory; 0 on the CPU */
    char     backend[16];     /* where the layers run: "CPU", or the GPU backend's name ("CUDA") */
    char     device[128];     /* that processor, as ggml describes it ("NVIDIA H200", a CPU's model name) */
    char     engine_pin[192]; /* as meshnet_engine_pin() */
    int32_t  numerics;        /* the meshnet_numerics it computes with */
    int32_t  seam_width;      /* floats per residual row between stages: n_embd, or more where
                                 per-token state beside the residual crosses too (RWKV-7's
                                 first-layer value, Gemma 4's per-layer inputs) */
    int32_t  pool_cells;      /* the KV pool's cells, which the sessions share; 0: a stream per session */
    int32_t  n_threads;       /* the compute threads it runs */
    int32_t  tp_rank;         /* its place in a tensor-parallel group, 0/0 for whole layers */
    int32_t  tp_size;
} meshnet_stage_info;

/* One session's input in a forward batch. The head passes token ids; any other
 * stage passes n_tokens residual rows of embd_width (= info.seam_width) floats each.
 *
 * verify (the tail; other stages compute the rows as any others): the rows are the
 * session's last drawn token, then n_tokens - 1 drafted tokens, whose ids `tokens` holds
 * on every stage. The tail draws the token after each row as it would have, had the rows
 * come one by one (the most likely, or the sampler's draw for that position, knowing the
 * drafts before it), and keeps the rows up to the first draft that differs from its own
 * draw: the session then holds pos + n_accepted + 1 tokens. A model with recurrent state
 * cannot drop the rows it does not keep, and is refused (MESHNET_ERR_CANNOT_ROLL_BACK). */
typedef struct {
    uint64_t        session_id;
    int32_t         pos;         /* position of the first row: the session's length so far */
    int32_t         n_tokens;
    const int32_t * tokens;
    const float   * embd;
    int32_t         embd_width;
    int32_t         verify;
} meshnet_entry;

/* Caller-owned output buffers. A stage before the tail fills residual with one row of
 * seam_width floats per input row, in entry order. The tail fills token[e] with entry e's
 * next token and, when logits is not NULL, logits[e * n_vocab ...] with the logits it came
 * from (before any sampler). For a verify entry, n_accepted[e] is how many of its drafts
 * were kept, drawn[row] the tail's draw after each of its rows up to the first refused
 * draft (rows in entry order, as residual's), and token[e] the draw after the last row
 * kept; drawn and n_accepted may be NULL in a call without verify entries. */
typedef struct {
    float   * residual;
    float   * logits;
    int32_t * token;
    int32_t * drawn;
    int32_t * n_accepted;
} meshnet_output;

/* How the tail picks a session's next token: llama.cpp's sampler chain, in llama.cpp's
 * order: penalties, top-k, top-p, min-p, temperature, then a draw. The draw for the token
 * at position p is seeded from (seed, p), and the penalties look at the session's tokens
 * so far, so the choice is a pure function of these parameters, the seed and the tokens
 * before it: whatever the route, and again after a replay. A grammar (llama.cpp's GBNF,
 * the rule "root" first) goes before the chain: the draw is among the tokens it takes after
 * the history's tokens from grammar_from on (the prompt's length: the prompt is not
 * constrained). */
typedef struct {
    float    temperature;       /* <= 0: the most likely token after the penalties */
    int32_t  top_k;             /* <= 0: off */
    float    top_p;             /* >= 1: off */
    float    min_p;             /* <= 0: off */
    float    repeat_penalty;    /* 1: off */
    int32_t  penalty_last_n;    /* tokens the penalties look back on; -1: the whole context */
    float    frequency_penalty; /* 0: off */
    float    presence_penalty;  /* 0: off */
    uint64_t seed;
    const char * grammar;       /* NULL or "": none; copied by meshnet_session_sampling */
    int32_t  grammar_from;      /* the history's first token the grammar takes */
    int32_t  grammar_lazy;      /* nonzero: the grammar holds from the first trigger on (a tool call) */
    const char * const * trigger_patterns;   /* regexes over the text generated so far */
    int32_t  n_trigger_patterns;
    const int32_t * trigger_tokens;
    int32_t  n_trigger_tokens;
} meshnet_sampling;

typedef struct {
    const char * role;      /* "system", "user", "assistant" */
    const char * content;
} meshnet_chat_message;

MESHNET_API int32_t      meshnet_engine_abi_version(void);
/* "llama.cpp@<commit> sdist=<sha256> patches=<sha256>" */
MESHNET_API const char * meshnet_engine_pin(void);
/* The compute threads of a stage whose params leave n_threads 0: llama.cpp's own default
 * (one per physical core; a hybrid CPU's performance cores), at most the CPUs this process
 * may run on. A thread on every SMT sibling adds no arithmetic, only another member to the
 * pool's barrier that waits whenever anything else on the machine takes its CPU. */
MESHNET_API int32_t      meshnet_default_threads(void);
/* The support table's line for a GGUF general.architecture name; *reason (may be NULL)
 * is set to a static string, empty for an architecture that splits. */
MESHNET_API meshnet_arch_support meshnet_arch_support_of(const char * arch, const char ** reason);

/* What one layer keeps per session beside its weights, as llama.cpp sizes its memory for a
 * stage of this engine with K and V of the given meshnet_kv_types (f32 recurrent state). */
typedef struct {
    int64_t kv_bytes_per_cell;  /* K and V of one token (0: the layer keeps no KV) */
    int32_t window;             /* 0: full attention; else a sliding window of this many tokens (a
                                 * stage's cache still spans the context: it keeps swa_full) */
    int64_t state_bytes;        /* its recurrent state (0: none) */
} meshnet_layer_memory;

/* The model's hyperparameters only (no weights are read): each layer's memory, into
 * layers[0 .. min(capacity, n_layer)); *n_layer is the model's layer count. A KV type the
 * model's head sizes cannot hold is MESHNET_ERR_INVALID_ARGUMENT. */
MESHNET_API meshnet_status meshnet_layer_memory_of(const char * model_path, int32_t type_k, int32_t type_v,
                                    meshnet_layer_memory * layers, int32_t capacity, int32_t * n_layer,
                                    char * err, size_t err_cap);

/* On failure *out is NULL and err (err_cap bytes, may be NULL) holds the reason. */
MESHNET_API meshnet_status meshnet_stage_open(const meshnet_stage_params * params, meshnet_stage ** out,
                                  char * err, size_t err_cap);
MESHNET_API void           meshnet_stage_close(meshnet_stage * stage);
MESHNET_API const char *   meshnet_stage_last_error(const meshnet_stage * stage);
MESHNET_API meshnet_status meshnet_stage_info_get(meshnet_stage * stage, meshnet_stage_info * info);

MESHNET_API meshnet_status meshnet_session_open    (meshnet_stage * stage, uint64_t session_id);
MESHNET_API meshnet_status meshnet_session_release (meshnet_stage * stage, uint64_t session_id);
/* A model with recurrent state (Mamba, RWKV, the hybrids) keeps no state per position:
 * it cannot drop the last tokens, and truncate returns MESHNET_ERR_CANNOT_ROLL_BACK,
 * the session unchanged. A forward pass past position 0 that fails after such a state
 * moved cannot be undone either: the session is emptied, and later calls on it are
 * refused with that code until it is released and fed again from the start (a failed
 * pass from position 0 only leaves the session empty, as a transformer's would be). */
MESHNET_API meshnet_status meshnet_session_truncate(meshnet_stage * stage, uint64_t session_id, int32_t n_keep);
MESHNET_API meshnet_status meshnet_session_length  (meshnet_stage * stage, uint64_t session_id, int32_t * n_tokens);
/* A session's memory on this stage (its layers' KV cells, and any recurrent state), as
 * bytes to give back to meshnet_session_restore of this stage, or of another opened with
 * the same model, layer range and parameters: a prefix store keeps ended sessions this way.
 * *n_out is the byte count written, or needed when the call returns
 * MESHNET_ERR_BUFFER_TOO_SMALL (buf may then be NULL). */
MESHNET_API meshnet_status meshnet_session_save    (meshnet_stage * stage, uint64_t session_id,
                                    void * buf, size_t capacity, size_t * n_out);
/* An open session that holds no tokens takes the memory meshnet_session_save gave, of
 * n_tokens positions: it goes on from there as the saved session would have. Bytes whose
 * layers, widths or length do not fit this stage are refused, the session left empty
 * (llama.cpp cannot tell two ranges of one shape apart: the bytes are the caller's to keep
 * with the stage they came from). */
MESHNET_API meshnet_status meshnet_session_restore (meshnet_stage * stage, uint64_t session_id,
                                    const void * buf, size_t size, int32_t n_tokens);
/* The tail samples the session's tokens from now on (NULL: the most likely token again).
 * history holds the session's tokens so far (the prompt, and any tokens generated before
 * a replay); each sampled token is added to it. A forward call whose rows end before the
 * end of the history (a prompt chunk) returns the most likely token, untouched by the
 * sampler; rows that end past it are refused: the tokens in between are unknown. */
MESHNET_API meshnet_status meshnet_session_sampling(meshnet_stage * stage, uint64_t session_id,
                                    const meshnet_sampling * sampling, const int32_t * history, int32_t n_history);

/* llama.cpp's GBNF for a JSON schema (common/json-schema-to-grammar, as llama-server
 * builds it for response_format): *n_out is the bytes with the final NUL, written or
 * needed (MESHNET_ERR_BUFFER_TOO_SMALL). A schema it cannot take: INVALID_ARGUMENT, with
 * the reason in err. */
MESHNET_API meshnet_status meshnet_json_schema_grammar(const char * schema, char * text, size_t capacity,
                                    size_t * n_out, char * err, size_t err_cap);

/* The model's Jinja chat template applied by llama.cpp's common chat code, as llama-server
 * applies it. request: JSON {"messages": OpenAI's messages (tool calls and results too),
 * "tools": OpenAI's tools, "tool_choice": "auto" | "none" | "required", "parallel_tool_calls",
 * "add_generation_prompt"}. The answer (JSON, NUL-terminated; *n_out bytes written, or needed
 * with MESHNET_ERR_BUFFER_TOO_SMALL): {"prompt", "grammar", "grammar_lazy",
 * "trigger_patterns", "trigger_tokens" (for meshnet_sampling), "additional_stops",
 * "generation_prompt", "format", "format_name", "parser", "caps": the template's capabilities
 * (supports_tools, supports_tool_calls, supports_system_role, ...)}. */
MESHNET_API meshnet_status meshnet_chat_apply(meshnet_stage * stage, const char * request, char * out,
                                    size_t capacity, size_t * n_out);
/* The text an answer gave, as an OpenAI message (JSON: content, tool_calls), parsed by the
 * format of a meshnet_chat_apply answer (chat: that answer's JSON, or its format,
 * generation_prompt and parser). is_partial: the text may go on (a stream). It needs no
 * stage, so the process that serves the API parses what the tail drew; a text or format it
 * cannot take: INVALID_ARGUMENT, with the reason in err. */
MESHNET_API meshnet_status meshnet_chat_parse(const char * chat, const char * text, int32_t is_partial, char * out,
                                    size_t capacity, size_t * n_out, char * err, size_t err_cap);

MESHNET_API meshnet_status meshnet_stage_forward(meshnet_stage * stage, const meshnet_entry * entries,
                                     int32_t n_entries, meshnet_output * out);
/* Ask the forward pass running now to stop (thread-safe); it returns MESHNET_ERR_ABORTED
 * and the aborted tokens are not kept in the session. */
MESHNET_API void           meshnet_stage_abort(meshnet_stage * stage);

/* Tokenizing as llama.cpp does for this model. *n_out is the count written, or the
 * count needed when the call returns MESHNET_ERR_BUFFER_TOO_SMALL. */
MESHNET_API meshnet_status meshnet_tokenize(meshnet_stage * stage, const char * text, int32_t text_len,
                                int32_t add_special, int32_t parse_special,
                                int32_t * tokens, int32_t capacity, int32_t * n_out);
MESHNET_API meshnet_status meshnet_detokenize(meshnet_stage * stage, const int32_t * tokens, int32_t n_tokens,
                                  char * text, int32_t capacity, int32_t * n_out);
MESHNET_API int32_t        meshnet_token_is_eog(meshnet_stage * stage, int32_t token);

/* The model's own chat template (from the GGUF), applied by llama.cpp to the messages,
 * ending with the assistant's turn when add_assistant. *n_out is the byte count written,
 * or needed when the call returns MESHNET_ERR_BUFFER_TOO_SMALL; the text is not
 * NUL-terminated. */
MESHNET_API meshnet_status meshnet_chat_template(meshnet_stage * stage, const meshnet_chat_message * messages,
                                 int32_t n_messages, int32_t add_assistant,
                                 char * text, int32_t capacity, int32_t * n_out);

/* A tensor-parallel member's exchange over stream sockets (TCP) the caller connected to each
 * other member and keyed: meshnet_tp_link_gather is a meshnet_stage_params.tp_gather, with
 * the link as tp_gather_user. FDS[r] is the socket to member r (-1 for the member itself);
 * the link reads and writes them without blocking, and owns them from a successful new on
 * (meshnet_tp_link_free closes them; on NULL from new they stay the caller's). With SEAL and OPEN
 * (libsodium's crypto_aead_chacha20poly1305_ietf_encrypt and _decrypt, or functions of the
 * same contract), each message's rows are sealed with KEYS[32 r .. 32 r + 31], the key the
 * member shares with member r, under a nonce of the sender's rank and its count of messages
 * on that link, and its header is authenticated with them; without (both NULL, KEYS
 * unused) the rows go as they are. A gather sends this member's rows to every peer while
 * it takes each peer's, checking its header (layer, gather point, rows, and columns that fit
 * the whole row beside the others' without overlap) before reading its rows, and opening
 * them before they go into place. It spins on the sockets for up to SPIN_US microseconds
 * before sleeping in poll(); a gather not done in TIMEOUT_MS, a peer that closes its
 * socket or answers wrongly fails the gather (meshnet_tp_link_error says why) and breaks
 * the link: the streams may be out of step, so every later gather fails too, until the
 * group is linked anew. NULL from new: a bad rank, size, socket list, key or time. */
typedef int (*meshnet_tp_seal_fn)(unsigned char * sealed, unsigned long long * sealed_len, const unsigned char * plain,
                                  unsigned long long plain_len, const unsigned char * ad, unsigned long long ad_len,
                                  const unsigned char * nsec, const unsigned char * nonce, const unsigned char * key);
typedef int (*meshnet_tp_open_fn)(unsigned char * plain, unsigned long long * plain_len, unsigned char * nsec,
                                  const unsigned char * sealed, unsigned long long sealed_len, const unsigned char * ad,
                                  unsigned long long ad_len, const unsigned char * nonce, const unsigned char * key);
typedef struct meshnet_tp_link meshnet_tp_link;
MESHNET_API meshnet_tp_link * meshnet_tp_link_new(int32_t rank, int32_t size, const int32_t * fds, const uint8_t * keys,
                                                  meshnet_tp_seal_fn seal, meshnet_tp_open_fn open,
                                                  int32_t timeout_ms, int32_t spin_us);
MESHNET_API void              meshnet_tp_link_free(meshnet_tp_link * link);
/* What the link's gathers have cost so far: how many, their time, the part of it spent with
 * nothing to send or read (waiting for a peer: its compute or the wire), bytes sent. */
typedef struct meshnet_tp_link_stats {
    int64_t gathers;
    int64_t gather_ns;
    int64_t idle_ns;
    int64_t bytes_sent;
} meshnet_tp_link_stats;
MESHNET_API void              meshnet_tp_link_get_stats(const meshnet_tp_link * link, meshnet_tp_link_stats * out);
MESHNET_API const char *      meshnet_tp_link_error(const meshnet_tp_link * link);
MESHNET_API int32_t           meshnet_tp_link_gather(void * link, int32_t layer, int32_t point, const float * local,
                                                     int64_t n_local, int64_t offset, float * whole, int64_t n_whole,
                                                     int64_t n_rows);

#ifdef __cplusplus
}
#endif

#endif /* MESHNET_ENGINE_H */
