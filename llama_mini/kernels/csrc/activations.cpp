// Activations reused from one layer to the next (activations.h).
//
// Why: a prompt's chunk of 256 positions allocates a dozen activations of up to a few MB in
// every layer, each as large as the same one of the layer before. The C library serves them
// from its heap or maps them anew: a small model's prompt then peaks at about twice the
// activations it holds at once (the heap grows around what is still held, and does not give
// back), or pays a page fault for every page of every activation of every layer. Here a buffer
// let go is kept, and the next request of its size takes it: a chunk's buffers are mapped in the
// first layer and reused by every other, and a prompt's chunks (all of one size but the last)
// reuse them in turn.
//
// What is kept is bounded: buffers let go are kept up to the most bytes ever held at once, and
// beyond that returned to the system. Below REUSED_MIN bytes (a decoding step's activations)
// the C library's own allocator serves, as fast as anything here would be.

#include "activations.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <sys/mman.h>

#include <map>
#include <mutex>

namespace llama_mini {

namespace {

constexpr size_t REUSED_MIN = 64 << 10;
constexpr size_t PAGE = 4096;

thread_local bool reusing = false;

struct Buffers {
    std::mutex lock;
    std::multimap<size_t, void*> idle;  // bytes -> buffer
    size_t idle_bytes = 0, held_bytes = 0, most_held = 0;

    // A buffer of `bytes` (a multiple of PAGE): an idle one of that size, or a new mapping.
    void* take(size_t bytes) {
        {
            std::lock_guard<std::mutex> guard(lock);
            held_bytes += bytes;
            most_held = std::max(most_held, held_bytes);
            if (auto it = idle.find(bytes); it != idle.end()) {
                void* p = it->second;
                idle.erase(it);
                idle_bytes -= bytes;
                return p;
            }
        }
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            std::lock_guard<std::mutex> guard(lock);
            held_bytes -= bytes;
            TORCH_CHECK(false, "llama_mini: out of memory for an activation of ", bytes, " bytes");
        }
        return p;
    }

    void give_back(void* p, size_t bytes) {
        {
            std::lock_guard<std::mutex> guard(lock);
            held_bytes -= bytes;
            if (idle_bytes + bytes <= most_held) {
                idle.emplace(bytes, p), idle_bytes += bytes;
                return;
            }
        }
        munmap(p, bytes);
    }
};

Buffers& buffers() {
    static Buffers* all = new Buffers();  // never destroyed: tensors may be freed during exit
    return *all;
}

}  // namespace

at::Tensor activation(at::IntArrayRef sizes, const at::TensorOptions& options) {
    int64_t count = 1;
    for (int64_t size : sizes) count *= size;
    const size_t bytes = static_cast<size_t>(count) * options.dtype().itemsize();
    if (!reusing || bytes < REUSED_MIN) return at::empty(sizes, options);
    const size_t held = (bytes + PAGE - 1) / PAGE * PAGE;
    return at::from_blob(buffers().take(held), sizes, [held](void* data) { buffers().give_back(data, held); }, options);
}

ReusedActivations::ReusedActivations() : outer_(!reusing) { reusing = true; }
ReusedActivations::~ReusedActivations() {
    if (outer_) reusing = false;
}

}  // namespace llama_mini
