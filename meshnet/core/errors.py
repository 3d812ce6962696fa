"""The one error type of meshnet: a stable code a program can branch on, a sentence a
person can act on, and the context (stage, session, ...) that locates it.

Every code is defined here, once: a constant named as the code in upper case whose value
is the plain string that goes on the wire, with the CLI's exit status for it, what it
means, the HTTP status `meshnet serve` answers it with and, for a code the engine
returns, its meshnet_status in meshnet_engine.h. Other modules raise
`MeshnetError(errors.BAD_RANGE, ...)`, never a string literal.
A code that arrives from the wire and is not listed here is still carried (exit status 1).
"""

from __future__ import annotations

# code -> (exit status of the CLI, one line saying what it means)
CODES: dict[str, tuple[int, str]] = {}
# code -> the HTTP status meshnet serve answers with (500 where none is given)
HTTP_STATUS: dict[str, int] = {}
# the engine's meshnet_status (meshnet_engine.h) -> code
BY_ENGINE_STATUS: dict[int, str] = {}


def _code(code: str, exit_status: int, meaning: str, *, http: int | None = None, engine: int | None = None) -> str:
    if code in CODES:
        raise ValueError(f"error code {code!r} is defined twice")
    CODES[code] = (exit_status, meaning)
    if http is not None:
        HTTP_STATUS[code] = http
    if engine is not None:
        if engine in BY_ENGINE_STATUS:
            raise ValueError(f"engine status {engine} is given to {BY_ENGINE_STATUS[engine]!r} and {code!r}")
        BY_ENGINE_STATUS[engine] = code
    return code


# Exit statuses: 1 anything else, 2 a bad command line (click's own), 3 the model or the
# engine, 4 the workers or the network, 5 the request.

# 2: the command line
BAD_ADDRESS = _code("bad_address", 2, "an address that cannot be listened on or connected to as given")

# 3: the model or the engine
NOT_GGUF = _code("not_gguf", 3, "a file that is not a readable GGUF model", engine=2)
TRUNCATED_GGUF = _code("truncated_gguf", 3, "a GGUF file shorter than its header says")
MODEL_NOT_FOUND = _code("model_not_found", 3, "neither a known model name nor an existing file")
MODEL_CHECKSUM = _code("model_checksum", 3, "a known model whose bytes do not have the recorded sha256")
MODEL_SOURCE = _code("model_source", 3, "a model source (Hugging Face, Ollama's store) that could not give the model")
UNKNOWN_MODEL = _code("unknown_model", 3, "a model name that is not in the list of known models")
MODEL_LOAD = _code("model_load", 3, "the engine could not load the model", engine=3)
UNSUPPORTED_ARCH = _code("unsupported_arch", 3, "a model architecture the engine cannot split into stages", engine=4)
MODEL_DOES_NOT_FIT = _code("model_does_not_fit", 3, "the nodes' memory cannot hold the model (the shortfall is named)")
BAD_RANGE = _code("bad_range", 3, "a layer range or split that is empty, reversed or outside the model", engine=5)
ENGINE_MISSING = _code("engine_missing", 3, "the engine library has not been built")
ENGINE_MISMATCH = _code("engine_mismatch", 3, "the engine library speaks another ABI version than this package")
NO_GPU = _code("no_gpu", 3, "a GPU stage asked of a machine or engine build without a GPU", engine=17)

# 4: the workers, the network
ROUTE_INCOMPLETE = _code("route_incomplete", 4, "the registered workers do not make a route over the whole model",
                         http=503)
UNASSIGNED = _code("unassigned", 4, "a worker that waits for the coordinator to give it a layer range")
STAGE_LOST = _code("stage_lost", 4, "a worker holding a stage of the session went away", http=503)
HOP_UNREACHABLE = _code("hop_unreachable", 4, "a stage could not pass its output to the next stage", http=503)
UNREACHABLE = _code("unreachable", 4, "a peer (a coordinator's metrics, a worker) did not answer", http=503)
DEADLINE_EXCEEDED = _code("deadline_exceeded", 4, "no answer came within the request's deadline", http=503)
BUSY = _code("busy", 4, "a worker's queue is full; try again later", http=429)
SHUTTING_DOWN = _code("shutting_down", 4, "a worker that is shutting down takes no new work", http=503)
WORKER_EXITED = _code("worker_exited", 4, "a worker process exited or stopped before the route formed")
ADDRESS_IN_USE = _code("address_in_use", 4, "the address to listen on is already taken")
TIMEOUT = _code("timeout", 4, "an operation did not finish in the time given to it", http=503)
JOIN_REFUSED = _code("join_refused", 4, "a join token this mesh does not admit: rotated, forged or not a token")
TP_EXCHANGE = _code("tp_exchange", 4, "a tensor-parallel member could not exchange its rows with its group "
                    "(a member lost, or its answer refused)", http=503, engine=20)
FETCH_FAILED = _code("fetch_failed", 4, "a model's bytes could not be fetched from any holder, or failed their hash")

# 5: the request
CONTEXT_FULL = _code("context_full", 5, "the prompt and the tokens asked for do not fit the context",
                     http=400, engine=8)
BAD_TOKEN = _code("bad_token", 5, "a token id outside the model's vocabulary", http=400, engine=6)
BAD_WIDTH = _code("bad_width", 5, "residual rows whose shape is not (n_tokens, seam_width)", engine=7)
KV_FULL = _code("kv_full", 4, "a stage's KV pool has no room for a session's next positions: other sessions hold it",
                http=503, engine=19)
CANNOT_ROLL_BACK = _code("cannot_roll_back", 5, "a model with recurrent state cannot drop its last tokens (release the session, feed it again)",
                         engine=18)
INVALID_ARGUMENT = _code("invalid_argument", 5, "an argument the operation cannot take (an empty prompt, bad UTF-8)",
                         http=400, engine=1)
TOO_MANY_SESSIONS = _code("too_many_sessions", 5, "a stage already holds as many sessions as it was opened for",
                          http=429, engine=10)
TOO_MANY_STREAMS = _code("too_many_streams", 5, "a server already holds as many console event streams open as it "
                         "allows (meshnet/serve/console.py)", http=429)
UNKNOWN_SESSION = _code("unknown_session", 5, "a session id the stage does not hold", engine=9)
CANCELLED = _code("cancelled", 5, "the session was cancelled by its caller")
BAD_PAYLOAD = _code("bad_payload", 5, "a payload (residual, logits, token ids) that is missing, mis-sized or not finite",
                    engine=15)
NO_CHAT_TEMPLATE = _code("no_chat_template", 5, "a model without a chat template llama.cpp knows: give raw text instead",
                         http=400, engine=16)
BAD_KEY = _code("bad_key", 5, "a data message without the session's token")

# 1: the protocol's refusals of a message, and what should never happen
MALFORMED = _code("malformed", 1, "a message that is not valid msgpack or not a map in 1 or 2 frames")
BAD_VERSION = _code("bad_version", 1, "a message of another protocol version")
UNKNOWN_TYPE = _code("unknown_type", 1, "a message type the protocol does not define")
BAD_FIELD = _code("bad_field", 1, "a message field that is missing, unknown or has a bad value")
OVERSIZED = _code("oversized", 1, "a header or payload over the protocol's size limit")
DUPLICATE_REQUEST = _code("duplicate_request", 1, "a request id already in flight on this connection")
ABORTED = _code("aborted", 1, "the engine stopped a forward pass on request (abort callback)", engine=11)
DECODE_FAILED = _code("decode_failed", 1, "llama.cpp failed to decode a batch", engine=12)
BUFFER_TOO_SMALL = _code("buffer_too_small", 1, "an output buffer too small for the engine's answer", engine=13)
CLOSED = _code("closed", 1, "an engine stage used after it was closed")
INTERNAL = _code("internal", 1, "a failure meshnet did not expect: a bug", engine=14)


def http_status(code: str) -> int:
    """What meshnet serve answers a request that failed with CODE: 500 for a code not given one."""
    return HTTP_STATUS.get(code, 500)


def exit_status(code: str) -> int:
    """The CLI's exit status for a code; 1 for a code not listed (one from the wire, say)."""
    return CODES.get(code, (1, ""))[0]


def meaning(code: str) -> str:
    return CODES.get(code, (1, "a code this version of meshnet does not know"))[1]


class MeshnetError(Exception):
    def __init__(self, code: str, message: str, **context):
        super().__init__(message)
        self.code = code
        self.message = message
        self.context = context

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, **self.context}

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"
