// A tensor-parallel member's exchange with its group over ZeroMQ sockets that the caller
// made and configured (meshnet_engine.h: meshnet_tp_link). It runs on the compute thread
// that reaches a gather, without Python: at one gather per sum over a split dimension
// (four a layer) its cost is most of what a group pays for reading half the weights.

#include "meshnet_engine.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

// what precedes a member's rows in each message: the gather it belongs to and where its
// columns lie in the whole row, which the receiver checks against its own
struct gather_header {
    int32_t layer;
    int32_t point;
    int64_t n_rows;
    int64_t n_local;
    int64_t offset;
};

}  // namespace

struct meshnet_tp_link {
    int32_t rank = 0;
    int32_t size = 0;
    std::vector<void *> peers;
    int (*send)(void *, const void *, size_t, int) = nullptr;
    int (*recv)(void *, void *, size_t, int) = nullptr;
    std::vector<float> scratch;   // a peer's rows of a prompt, before they go into place
    std::vector<char> taken;      // the whole row's columns filled in this gather
    std::string error;
    // a failed gather leaves the sockets out of step (a message unread, or one the peer
    // never sent): every later gather fails too, until the group is linked anew
    bool broken = false;

    int32_t fail(std::string message) {
        error = std::move(message);
        broken = true;
        return 1;
    }
};

extern "C" {

meshnet_tp_link * meshnet_tp_link_new(int32_t rank, int32_t size, void * const * peers,
                                      int (*send)(void *, const void *, size_t, int),
                                      int (*recv)(void *, void *, size_t, int)) {
    if (size < 2 || rank < 0 || rank >= size || !peers || !send || !recv) {
        return nullptr;
    }
    for (int32_t r = 0; r < size; ++r) {
        if ((r == rank) != (peers[r] == nullptr)) {
            return nullptr;   // a socket to every other member, none to itself
        }
    }
    auto * link = new meshnet_tp_link();
    link->rank  = rank;
    link->size  = size;
    link->peers.assign(peers, peers + size);
    link->send  = send;
    link->recv  = recv;
    return link;
}

void meshnet_tp_link_free(meshnet_tp_link * link) {
    delete link;
}

const char * meshnet_tp_link_error(const meshnet_tp_link * link) {
    return link ? link->error.c_str() : "no link";
}

int32_t meshnet_tp_link_gather(void * user, int32_t layer, int32_t point, const float * local, int64_t n_local,
                               int64_t offset, float * whole, int64_t n_whole, int64_t n_rows) {
    auto * link = static_cast<meshnet_tp_link *>(user);
    if (link->broken) {
        return 1;   // (error still says why)
    }
    const gather_header mine = { layer, point, n_rows, n_local, offset };
    const size_t local_bytes = sizeof(float) * (size_t) n_local * (size_t) n_rows;
    // every peer gets this member's rows first: no member waits on another to send
    for (int32_t r = 0; r < link->size; ++r) {
        if (r == link->rank) {
            continue;
        }
        if (link->send(link->peers[r], &mine, sizeof(mine), 2 /* ZMQ_SNDMORE */) < 0 ||
            link->send(link->peers[r], local, local_bytes, 0) < 0) {
            return link->fail("could not send layer " + std::to_string(layer) + "'s rows to member " + std::to_string(r) +
                              " (errno " + std::to_string(errno) + ": " + std::strerror(errno) + ")");
        }
    }
    link->taken.assign((size_t) n_whole, 0);
    for (int64_t row = 0; row < n_rows; ++row) {
        std::memcpy(whole + row * n_whole + offset, local + row * n_local, sizeof(float) * (size_t) n_local);
    }
    std::memset(link->taken.data() + offset, 1, (size_t) n_local);
    int64_t filled = n_local;
    for (int32_t r = 0; r < link->size; ++r) {
        if (r == link->rank) {
            continue;
        }
        gather_header theirs = {};
        const int got = link->recv(link->peers[r], &theirs, sizeof(theirs), 0);
        if (got < 0) {
            return link->fail("member " + std::to_string(r) + " sent nothing for layer " + std::to_string(layer) +
                              "'s gather " + std::to_string(point) + " in time (errno " + std::to_string(errno) + ": " +
                              std::strerror(errno) + "): the group has lost it");
        }
        // a peer's rows go where its header says only if they fit this gather exactly
        if (got != (int) sizeof(theirs) || theirs.layer != layer || theirs.point != point || theirs.n_rows != n_rows ||
            theirs.n_local < 1 || theirs.offset < 0 || theirs.offset > n_whole - theirs.n_local) {
            return link->fail("member " + std::to_string(r) + " answered layer " + std::to_string(layer) + "'s gather " +
                              std::to_string(point) + " with another gather's rows (layer " + std::to_string(theirs.layer) +
                              ", gather " + std::to_string(theirs.point) + ", " + std::to_string(theirs.n_rows) + " x " +
                              std::to_string(theirs.n_local) + " at " + std::to_string(theirs.offset) + ")");
        }
        for (int64_t c = theirs.offset; c < theirs.offset + theirs.n_local; ++c) {
            if (link->taken[(size_t) c]) {
                return link->fail("member " + std::to_string(r) + "'s columns of layer " + std::to_string(layer) +
                                  "'s gather " + std::to_string(point) + " overlap another member's");
            }
            link->taken[(size_t) c] = 1;
        }
        const size_t bytes = sizeof(float) * (size_t) theirs.n_local * (size_t) n_rows;
        float * into = whole + theirs.offset;
        if (n_rows > 1) {
            link->scratch.resize((size_t) theirs.n_local * (size_t) n_rows);
            into = link->scratch.data();
        }
        const int data = link->recv(link->peers[r], into, bytes, 0);
        if (data < 0 || (size_t) data != bytes) {
            return link->fail("member " + std::to_string(r) + "'s rows of layer " + std::to_string(layer) + "'s gather " +
                              std::to_string(point) + " are " + std::to_string(data) + " bytes, not " +
                              std::to_string(bytes));
        }
        if (n_rows > 1) {
            for (int64_t row = 0; row < n_rows; ++row) {
                std::memcpy(whole + row * n_whole + theirs.offset, into + row * theirs.n_local,
                            sizeof(float) * (size_t) theirs.n_local);
            }
        }
        filled += theirs.n_local;
    }
    if (filled != n_whole) {
        return link->fail("the group's rows of layer " + std::to_string(layer) + "'s gather " + std::to_string(point) +
                          " fill " + std::to_string(filled) + " of its " + std::to_string(n_whole) + " columns");
    }
    return 0;
}

}  // extern "C"
