// A tensor-parallel member's exchange with its group over stream sockets that the caller
// connected and keyed (meshnet_engine.h: meshnet_tp_link). It runs on the compute thread
// that reaches a gather, with no thread between it and the socket: at four gathers a layer
// the exchange's round trip is most of what a group pays for reading half the weights, and
// a hop through a messaging library's I/O thread (ZeroMQ: 100-200 us a gather, measured)
// costs more than the compute it saves. So the receiver spins on its sockets for a while
// before it sleeps in poll(), and each message is sealed here, on the same thread.

#include "meshnet_engine.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace {

// what precedes a member's rows in each message: the gather it belongs to and where its
// columns lie in the whole row, which the receiver checks against its own before it reads
// the rows; sealed messages authenticate it as the cipher's additional data
struct gather_header {
    int32_t layer;
    int32_t point;
    int64_t n_rows;
    int64_t n_local;
    int64_t offset;
};

constexpr size_t KEY_BYTES   = 32;
constexpr size_t NONCE_BYTES = 12;
constexpr size_t TAG_BYTES   = 16;

using clock_type = std::chrono::steady_clock;

// one peer's socket and where this gather stands with it
struct peer_channel {
    int fd = -1;
    unsigned char key[KEY_BYTES] = {};
    uint64_t sent = 0;       // messages sealed to this peer (the nonce's counter)
    uint64_t received = 0;   // messages opened from it
    std::vector<unsigned char> out;   // header + sealed rows, going
    size_t out_done = 0;
    gather_header theirs = {};
    size_t header_done = 0;
    std::vector<unsigned char> in;    // their sealed rows, coming
    size_t in_done = 0;
    bool placed = false;
};

}  // namespace

struct meshnet_tp_link {
    int32_t rank = 0;
    int32_t size = 0;
    std::vector<peer_channel> peers;   // by rank; this member's own entry unused
    meshnet_tp_seal_fn seal = nullptr;   // both null: the rows go as they are (loopback, --insecure)
    meshnet_tp_open_fn open = nullptr;
    int32_t timeout_ms = 30000;
    int32_t spin_us = 0;
    std::vector<char> taken;      // the whole row's columns filled in this gather
    std::vector<float> rows;      // a peer's rows, opened, before they go into place
    std::string error;
    meshnet_tp_link_stats stats = {};
    // a failed gather leaves the streams out of step (a message half read, or one the peer
    // never sent): every later gather fails too, until the group is linked anew
    bool broken = false;

    int32_t fail(std::string message) {
        error = std::move(message);
        broken = true;
        return 1;
    }

    size_t sealed_bytes(size_t plain) const { return plain + (seal ? TAG_BYTES : 0); }

    // the nonce of message COUNT sent by member FROM: each direction of a pair has its own
    // sender, so one key never sees a nonce twice
    static void nonce(unsigned char * out, int32_t from, uint64_t count) {
        std::memcpy(out, &from, 4);
        std::memcpy(out + 4, &count, 8);
    }
};

namespace {

std::string where(int32_t layer, int32_t point) {
    return "layer " + std::to_string(layer) + "'s gather " + std::to_string(point);
}

std::string errno_text() {
    return "errno " + std::to_string(errno) + ": " + std::strerror(errno);
}

// this member's message to peer R: its header and its rows, sealed with their key
int32_t prepare(meshnet_tp_link * link, int32_t r, const gather_header & mine, const float * local, size_t bytes) {
    auto & peer = link->peers[(size_t) r];
    peer.out.resize(sizeof(mine) + link->sealed_bytes(bytes));
    std::memcpy(peer.out.data(), &mine, sizeof(mine));
    if (!link->seal) {
        std::memcpy(peer.out.data() + sizeof(mine), local, bytes);
    } else {
        unsigned char nonce[NONCE_BYTES];
        meshnet_tp_link::nonce(nonce, link->rank, peer.sent++);
        unsigned long long sealed = 0;
        if (link->seal(peer.out.data() + sizeof(mine), &sealed, (const unsigned char *) local, bytes,
                       (const unsigned char *) &mine, sizeof(mine), nullptr, nonce, peer.key) != 0) {
            return link->fail("could not seal " + where(mine.layer, mine.point) + "'s rows for member " +
                              std::to_string(r));
        }
    }
    peer.out_done = 0;
    peer.header_done = 0;
    peer.in_done = 0;
    peer.placed = false;
    return 0;
}

// a peer's header, whole: its rows are read only if they fit this gather exactly
int32_t check_header(meshnet_tp_link * link, int32_t r, const gather_header & mine, int64_t n_whole) {
    auto & peer = link->peers[(size_t) r];
    const gather_header & theirs = peer.theirs;
    if (theirs.layer != mine.layer || theirs.point != mine.point || theirs.n_rows != mine.n_rows ||
        theirs.n_local < 1 || theirs.offset < 0 || theirs.offset > n_whole - theirs.n_local) {
        return link->fail("member " + std::to_string(r) + " answered " + where(mine.layer, mine.point) +
                          " with another gather's rows (layer " + std::to_string(theirs.layer) + ", gather " +
                          std::to_string(theirs.point) + ", " + std::to_string(theirs.n_rows) + " x " +
                          std::to_string(theirs.n_local) + " at " + std::to_string(theirs.offset) + ")");
    }
    for (int64_t c = theirs.offset; c < theirs.offset + theirs.n_local; ++c) {
        if (link->taken[(size_t) c]) {
            return link->fail("member " + std::to_string(r) + "'s columns of " + where(mine.layer, mine.point) +
                              " overlap another member's");
        }
        link->taken[(size_t) c] = 1;
    }
    peer.in.resize(link->sealed_bytes(sizeof(float) * (size_t) theirs.n_local * (size_t) theirs.n_rows));
    return 0;
}

// a peer's rows, all read: opened (their key, their nonce, their header) and put in place
int32_t place(meshnet_tp_link * link, int32_t r, float * whole, int64_t n_whole) {
    auto & peer = link->peers[(size_t) r];
    const gather_header & theirs = peer.theirs;
    const size_t bytes = sizeof(float) * (size_t) theirs.n_local * (size_t) theirs.n_rows;
    const float * rows = (const float *) peer.in.data();
    if (link->open) {
        unsigned char nonce[NONCE_BYTES];
        meshnet_tp_link::nonce(nonce, r, peer.received++);
        link->rows.resize((size_t) theirs.n_local * (size_t) theirs.n_rows);
        unsigned long long opened = 0;
        if (link->open((unsigned char *) link->rows.data(), &opened, nullptr, peer.in.data(), peer.in.size(),
                       (const unsigned char *) &theirs, sizeof(theirs), nonce, peer.key) != 0 || opened != bytes) {
            return link->fail("member " + std::to_string(r) + "'s rows of " + where(theirs.layer, theirs.point) +
                              " do not open with the group's key: altered, replayed or not from the member");
        }
        rows = link->rows.data();
    }
    for (int64_t row = 0; row < theirs.n_rows; ++row) {
        std::memcpy(whole + row * n_whole + theirs.offset, rows + row * theirs.n_local,
                    sizeof(float) * (size_t) theirs.n_local);
    }
    peer.placed = true;
    return 0;
}

}  // namespace

extern "C" {

meshnet_tp_link * meshnet_tp_link_new(int32_t rank, int32_t size, const int32_t * fds, const uint8_t * keys,
                                      meshnet_tp_seal_fn seal, meshnet_tp_open_fn open, int32_t timeout_ms,
                                      int32_t spin_us) {
    if (size < 2 || rank < 0 || rank >= size || !fds || (!seal) != (!open) || (seal && !keys) || timeout_ms < 1 ||
        spin_us < 0) {
        return nullptr;
    }
    for (int32_t r = 0; r < size; ++r) {
        if ((r == rank) != (fds[r] < 0)) {
            return nullptr;   // a socket to every other member, none to itself
        }
    }
    auto * link = new meshnet_tp_link();
    link->rank = rank;
    link->size = size;
    link->peers.resize((size_t) size);
    for (int32_t r = 0; r < size; ++r) {
        link->peers[(size_t) r].fd = fds[r];
        if (seal) {
            std::memcpy(link->peers[(size_t) r].key, keys + (size_t) r * KEY_BYTES, KEY_BYTES);
        }
    }
    link->seal       = seal;
    link->open       = open;
    link->timeout_ms = timeout_ms;
    link->spin_us    = spin_us;
    return link;
}

void meshnet_tp_link_free(meshnet_tp_link * link) {
    if (link) {
        for (auto & peer : link->peers) {
            if (peer.fd >= 0) {
                close(peer.fd);
            }
        }
    }
    delete link;
}

const char * meshnet_tp_link_error(const meshnet_tp_link * link) {
    return link ? link->error.c_str() : "no link";
}

void meshnet_tp_link_get_stats(const meshnet_tp_link * link, meshnet_tp_link_stats * out) {
    if (link && out) {
        *out = link->stats;
    }
}

int32_t meshnet_tp_link_gather(void * user, int32_t layer, int32_t point, const float * local, int64_t n_local,
                               int64_t offset, float * whole, int64_t n_whole, int64_t n_rows) {
    auto * link = static_cast<meshnet_tp_link *>(user);
    if (link->broken) {
        return 1;   // (error still says why)
    }
    const gather_header mine = { layer, point, n_rows, n_local, offset };
    const size_t local_bytes = sizeof(float) * (size_t) n_local * (size_t) n_rows;
    for (int32_t r = 0; r < link->size; ++r) {
        if (r != link->rank && prepare(link, r, mine, local, local_bytes) != 0) {
            return 1;
        }
    }
    link->taken.assign((size_t) n_whole, 0);
    for (int64_t row = 0; row < n_rows; ++row) {
        std::memcpy(whole + row * n_whole + offset, local + row * n_local, sizeof(float) * (size_t) n_local);
    }
    std::memset(link->taken.data() + offset, 1, (size_t) n_local);

    // every member sends and receives at once, a piece at a time: a prompt's rows can be far
    // more than the sockets' buffers, and two members each waiting to finish sending first
    // would wait for ever
    const auto began    = clock_type::now();
    struct account {   // the gather's time, added to the link's figures however it ends
        meshnet_tp_link_stats & stats;
        clock_type::time_point began;
        clock_type::time_point idle_since;
        int64_t idle_ns = 0;
        ~account() {
            stats.gathers += 1;
            stats.gather_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now() - began).count();
            stats.idle_ns += idle_ns;
        }
    } counted{ link->stats, began, began };
    bool was_idle = false;
    const auto deadline = began + std::chrono::milliseconds(link->timeout_ms);
    const auto spin_end = began + std::chrono::microseconds(link->spin_us);
    std::vector<pollfd> waiting;
    for (;;) {
        bool pending = false;
        bool moved = false;
        waiting.clear();
        for (int32_t r = 0; r < link->size; ++r) {
            if (r == link->rank) {
                continue;
            }
            auto & peer = link->peers[(size_t) r];
            short events = 0;
            while (peer.out_done < peer.out.size()) {
                const ssize_t n = send(peer.fd, peer.out.data() + peer.out_done, peer.out.size() - peer.out_done,
                                       MSG_DONTWAIT | MSG_NOSIGNAL);
                if (n < 0) {
                    if (errno == EAGAIN || errno == EWOULDBLOCK) {
                        events |= POLLOUT;
                        break;
                    }
                    if (errno == EINTR) {
                        continue;
                    }
                    return link->fail("could not send " + where(layer, point) + "'s rows to member " +
                                      std::to_string(r) + " (" + errno_text() + "): the group has lost it");
                }
                peer.out_done += (size_t) n;
                link->stats.bytes_sent += n;
                moved = true;
            }
            while (!peer.placed) {
                const bool header = peer.header_done < sizeof(gather_header);
                unsigned char * into = header ? (unsigned char *) &peer.theirs + peer.header_done
                                              : peer.in.data() + peer.in_done;
                const size_t want = header ? sizeof(gather_header) - peer.header_done : peer.in.size() - peer.in_done;
                const ssize_t n = recv(peer.fd, into, want, MSG_DONTWAIT);
                if (n == 0) {
                    return link->fail("member " + std::to_string(r) + " closed its link at " + where(layer, point) +
                                      ": the group has lost it");
                }
                if (n < 0) {
                    if (errno == EAGAIN || errno == EWOULDBLOCK) {
                        events |= POLLIN;
                        break;
                    }
                    if (errno == EINTR) {
                        continue;
                    }
                    return link->fail("could not read member " + std::to_string(r) + "'s rows of " +
                                      where(layer, point) + " (" + errno_text() + "): the group has lost it");
                }
                moved = true;
                if (header) {
                    peer.header_done += (size_t) n;
                    if (peer.header_done == sizeof(gather_header) && check_header(link, r, mine, n_whole) != 0) {
                        return 1;
                    }
                } else {
                    peer.in_done += (size_t) n;
                }
                if (peer.header_done == sizeof(gather_header) && peer.in_done == peer.in.size() &&
                    place(link, r, whole, n_whole) != 0) {
                    return 1;
                }
            }
            if (events) {
                pending = true;
                waiting.push_back({ peer.fd, events, 0 });
            }
        }
        if (moved && was_idle) {
            counted.idle_ns +=
                std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now() - counted.idle_since).count();
            was_idle = false;
        }
        if (!pending) {
            break;
        }
        if (moved) {
            continue;
        }
        const auto now = clock_type::now();
        if (!was_idle) {
            counted.idle_since = now;
            was_idle = true;
        }
        if (now >= deadline) {
            return link->fail("a member sent nothing for " + where(layer, point) + " in " +
                              std::to_string(link->timeout_ms) + " ms: the group has lost it");
        }
        if (now < spin_end) {
            // the peer's rows are usually microseconds away: a sleep and wake-up costs more;
            // a process that shares this CPU (another member, on a small machine) runs first
            sched_yield();
            continue;
        }
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
        if (poll(waiting.data(), waiting.size(), (int) left) < 0 && errno != EINTR) {
            return link->fail("could not wait for the group at " + where(layer, point) + " (" + errno_text() + ")");
        }
    }
    int64_t filled = 0;
    for (char c : link->taken) {
        filled += c;
    }
    if (filled != n_whole) {
        return link->fail("the group's rows of " + where(layer, point) + " fill " + std::to_string(filled) + " of its " +
                          std::to_string(n_whole) + " columns");
    }
    return 0;
}

}  // extern "C"
